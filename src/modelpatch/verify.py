"""Prove that a patched or fused model still computes what the original computes.

:func:`verify` runs two models on identical deterministic inputs and compares every tensor output.
"""

from __future__ import annotations

import inspect
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from torch.utils import benchmark


@dataclass(frozen=True)
class OutputDifference:
    """How far one output of the candidate is from the reference's."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    passed: bool


MAX_DISPERSION = 0.25
"""The largest half-range of a model's round medians, relative to its median (±25%), for which its timing is
reported: beyond it the rounds disagree too much (another process took the CPU, a frequency change) for the median,
or a ratio of medians, to mean anything."""


@dataclass(frozen=True)
class Timing:
    """Forward time of one model: the median over all timed runs and the spread of the per-round medians."""

    median: float
    low: float
    high: float
    runs: int

    @property
    def spread(self) -> float:
        """(highest - lowest round median) / median: how much the figure moved between rounds."""
        return (self.high - self.low) / self.median if self.median else math.inf

    @property
    def dispersion(self) -> float:
        """Half the spread: the ± around the median that the round medians cover."""
        return self.spread / 2

    @property
    def measured(self) -> bool:
        """Whether the model was timed and its rounds agree within :data:`MAX_DISPERSION`."""
        return self.runs > 0 and self.dispersion <= MAX_DISPERSION

    def describe(self) -> str:
        """``"41.2 ms (±3%)"``, or why there is no figure to give."""
        if self.runs == 0:
            return "not timed"
        if not self.measured:
            return f"not measurable (its rounds vary beyond ±{MAX_DISPERSION:.0%})"
        return f"{self.median * 1e3:.3g} ms (±{self.dispersion:.0%})"


@dataclass(frozen=True)
class VerificationReport:
    """Per-output differences, the verdict and timings of :func:`verify`."""

    outputs: tuple[OutputDifference, ...]
    atol: float
    rtol: float
    reference_timing: Timing
    candidate_timing: Timing
    missing: tuple[str, ...] = field(default=())

    @property
    def reference_seconds(self) -> float:
        return self.reference_timing.median

    @property
    def candidate_seconds(self) -> float:
        return self.candidate_timing.median

    @property
    def passed(self) -> bool:
        return not self.missing and all(o.passed for o in self.outputs)

    @property
    def speedup(self) -> float:
        """Reference time / candidate time (above 1: the candidate is faster)."""
        return self.reference_seconds / self.candidate_seconds if self.candidate_seconds else math.inf

    @property
    def speed_measured(self) -> bool:
        """Whether the timings tell the two models apart: both are measured (their rounds agree within
        :data:`MAX_DISPERSION`) and every round of one was faster than every round of the other. Otherwise the ratio
        of the medians is noise and is not reported."""
        ref, cand = self.reference_timing, self.candidate_timing
        return ref.measured and cand.measured and (ref.high < cand.low or cand.high < ref.low)

    def _speed(self) -> str:
        """The speed ratio as the report words it."""
        ref, cand = self.reference_timing, self.candidate_timing
        if not (ref.measured and cand.measured):
            return f"not measurable (the rounds vary beyond ±{MAX_DISPERSION:.0%})"
        if not self.speed_measured:
            return "not measurable (the rounds' ranges overlap)"
        # Two decimals, but never "0.00x" for a candidate more than 200 times slower.
        return f"{self.speedup:.2f}x" if self.speedup >= 0.1 else f"{self.speedup:.2g}x"

    def __str__(self) -> str:
        width = max([len("output"), *(len(o.name) for o in self.outputs)])
        lines = [f"{'output':<{width}}  {'shape':<18} {'max abs':>10} {'max rel':>10}  ok"]
        for o in self.outputs:
            shape = "x".join(map(str, o.shape))
            lines.append(
                f"{o.name:<{width}}  {shape:<18} {o.max_abs:>10.3g} {o.max_rel:>10.3g}  {'yes' if o.passed else 'NO'}"
            )
        lines.extend(f"{name:<{width}}  missing from the candidate's outputs  NO" for name in self.missing)
        ref, cand = self.reference_timing, self.candidate_timing
        if ref.runs == 0 and cand.runs == 0:
            lines.append("forward: not timed")
        else:
            lines.append(
                f"forward: reference {ref.describe()}, candidate {cand.describe()}: speed ratio {self._speed()} "
                f"over {ref.runs} + {cand.runs} runs"
            )
        lines.append(f"{'PASSED' if self.passed else 'FAILED'} (atol={self.atol:g}, rtol={self.rtol:g})")
        return "\n".join(lines)


def default_inputs(model: PreTrainedModel, seq_len: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic inputs for ``model``: token ids, plus an image for Qwen-VL-style vision-language models."""
    config = model.config
    text_config = config.get_text_config()
    generator = torch.Generator().manual_seed(seed)
    vocab = int(getattr(text_config, "vocab_size", 2))
    special = {
        getattr(config, n, None)
        for n in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    }
    low = max(3, min(100, vocab // 2)) if vocab > 3 else 0
    ids = torch.randint(low, vocab, (1, seq_len), generator=generator)
    for token in special - {None}:
        ids[ids == token] = low
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    vision = getattr(config, "vision_config", None)
    image_token = getattr(config, "image_token_id", None)
    if vision is not None and image_token is not None and hasattr(vision, "temporal_patch_size"):
        merge = int(getattr(vision, "spatial_merge_size", 1))
        grid = torch.tensor([[1, 2 * merge, 2 * merge]])
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        inputs["pixel_values"] = torch.randn(int(grid.prod()), patch_dim, generator=generator)
        inputs["image_grid_thw"] = grid
        image_tokens = int(grid.prod()) // merge**2
        start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
        prompt = (
            [t for t in (start,) if t is not None] + [image_token] * image_tokens + [t for t in (end,) if t is not None]
        )
        inputs["input_ids"] = torch.cat([torch.tensor([prompt]), ids], dim=1)
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            # What the processor returns beside input_ids: 1 marks image tokens (multimodal RoPE needs it).
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_token).int()
    first = next(model.parameters(), None)
    device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
    return {k: v.to(device) for k, v in inputs.items()}


def _tensor_outputs(output: Any) -> dict[str, torch.Tensor]:
    items = output.items() if isinstance(output, Mapping) else [("output", output)]
    result: dict[str, torch.Tensor] = {}
    for name, value in items:
        if isinstance(value, torch.Tensor):
            result[name] = value
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
            result.update({f"{name}[{i}]": v for i, v in enumerate(value)})
    return result


def _timer(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> benchmark.Timer:
    # Imported here, when a timing is asked for: torch.utils.benchmark imports torch's C++ extension builder and
    # setuptools (~0.1 s), which every command of the CLI paid at start-up (it imports this module for ``verify``).
    from torch.utils import benchmark

    def forward() -> None:
        with torch.inference_mode():
            model(**inputs)

    return benchmark.Timer(stmt="forward()", globals={"forward": forward}, num_threads=torch.get_num_threads())


def _time_both(
    reference: nn.Module, candidate: nn.Module, inputs: Mapping[str, torch.Tensor], rounds: int, min_run_time: float
) -> tuple[Timing, Timing]:
    """Both models' forward times with ``torch.utils.benchmark``, in alternating rounds.

    Each round lets the timer pick a block size and run at least ``min_run_time`` seconds; alternating the two
    models round by round makes a drift of the machine (frequency, other load) hit both alike.
    """
    timers = _timer(reference, inputs), _timer(candidate, inputs)
    for timer in timers:
        timer.timeit(2)  # warm-up: first-call allocations and caches
    medians: tuple[list[float], list[float]] = ([], [])
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(max(1, rounds)):
        for timer, bucket, all_times in zip(timers, medians, times, strict=True):
            measurement = timer.blocked_autorange(min_run_time=min_run_time)
            bucket.append(measurement.median)
            all_times.extend(measurement.times)
    ref, cand = (
        Timing(statistics.median(all_times), min(bucket), max(bucket), len(all_times))
        for bucket, all_times in zip(medians, times, strict=True)
    )
    return ref, cand


def check_tolerances(atol: float, rtol: float) -> None:
    """Refuse tolerances that make every comparison pass (infinite) or fail (negative, NaN).

    Raises:
        ValueError: naming the tolerance and its value.
    """
    for name, value in (("atol", atol), ("rtol", rtol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")


def verify(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Mapping[str, torch.Tensor] | None = None,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    rounds: int = 3,
    min_run_time: float = 0.2,
) -> VerificationReport:
    """Run ``reference`` and ``candidate`` on the same inputs and compare every tensor output.

    Args:
        reference: The model to trust (e.g. the stock, unpatched model).
        candidate: The patched or fused model.
        inputs: Keyword inputs of ``forward``; by default :func:`default_inputs` of ``reference``.
        atol, rtol: An output passes when ``|c - r| <= atol + rtol * |r|`` everywhere.
        rounds: Alternating timing rounds per model (``torch.utils.benchmark``, after a warm-up); the report gives
            the median over all runs and the spread between rounds. 0 skips timing.
        min_run_time: Seconds each round runs at least.

    Raises:
        ValueError: ``atol`` or ``rtol`` is negative, NaN or infinite.
    """
    check_tolerances(atol, rtol)
    if inputs is None:
        if not isinstance(reference, PreTrainedModel):
            raise TypeError(
                f"verify needs inputs=... for a {type(reference).__name__}: default inputs are made from a "
                "transformers model's config."
            )
        inputs = default_inputs(reference)
    was_training = reference.training, candidate.training
    reference.eval()
    candidate.eval()
    try:
        with torch.inference_mode():
            ref_out, cand_out = reference(**inputs), candidate(**inputs)
        if rounds > 0:
            ref_timing, cand_timing = _time_both(reference, candidate, inputs, rounds, min_run_time)
        else:
            ref_timing = cand_timing = Timing(math.nan, math.nan, math.nan, 0)
    finally:
        reference.train(was_training[0])
        candidate.train(was_training[1])
    ref_tensors, cand_tensors = _tensor_outputs(ref_out), _tensor_outputs(cand_out)
    differences = []
    for name, ref in ref_tensors.items():
        if name not in cand_tensors:
            continue
        cand = cand_tensors[name]
        if cand.shape != ref.shape:
            differences.append(OutputDifference(name, tuple(ref.shape), math.inf, math.inf, False))
            continue
        ref64, cand64 = ref.detach().double().cpu(), cand.detach().double().cpu()
        diff = (cand64 - ref64).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = float((diff / ref64.abs().clamp_min(1e-12)).max()) if diff.numel() else 0.0
        passed = bool(torch.all(diff <= atol + rtol * ref64.abs()))
        differences.append(OutputDifference(name, tuple(ref.shape), max_abs, max_rel, passed))
    return VerificationReport(
        outputs=tuple(differences),
        atol=atol,
        rtol=rtol,
        reference_timing=ref_timing,
        candidate_timing=cand_timing,
        missing=tuple(n for n in ref_tensors if n not in cand_tensors),
    )
