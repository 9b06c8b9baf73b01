"""Prove that a patched or fused model still computes what the original computes.

:func:`verify` runs two models on identical deterministic inputs and compares every tensor output.
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel


@dataclass(frozen=True)
class OutputDifference:
    """How far one output of the candidate is from the reference's."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    passed: bool


@dataclass(frozen=True)
class VerificationReport:
    """Per-output differences, the verdict and timings of :func:`verify`."""

    outputs: tuple[OutputDifference, ...]
    atol: float
    rtol: float
    reference_seconds: float
    candidate_seconds: float
    missing: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return not self.missing and all(o.passed for o in self.outputs)

    @property
    def speedup(self) -> float:
        """Reference time / candidate time (above 1: the candidate is faster)."""
        return self.reference_seconds / self.candidate_seconds if self.candidate_seconds else math.inf

    def __str__(self) -> str:
        width = max([len("output"), *(len(o.name) for o in self.outputs)])
        lines = [f"{'output':<{width}}  {'shape':<18} {'max abs':>10} {'max rel':>10}  ok"]
        for o in self.outputs:
            shape = "x".join(map(str, o.shape))
            lines.append(f"{o.name:<{width}}  {shape:<18} {o.max_abs:>10.3g} {o.max_rel:>10.3g}  {'yes' if o.passed else 'NO'}")
        lines.extend(f"{name:<{width}}  missing from the candidate's outputs  NO" for name in self.missing)
        lines.append(
            f"forward: reference {self.reference_seconds * 1e3:.2f} ms, candidate {self.candidate_seconds * 1e3:.2f} ms "
            f"(speed ratio {self.speedup:.2f}x)"
        )
        lines.append(f"{'PASSED' if self.passed else 'FAILED'} (atol={self.atol:g}, rtol={self.rtol:g})")
        return "\n".join(lines)


def default_inputs(model: PreTrainedModel, seq_len: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic inputs for ``model``: token ids, plus an image for Qwen-VL-style vision-language models."""
    config = model.config
    text_config = config.get_text_config()
    generator = torch.Generator().manual_seed(seed)
    vocab = int(getattr(text_config, "vocab_size", 2))
    special = {getattr(config, n, None) for n in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
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
        prompt = [t for t in (start,) if t is not None] + [image_token] * image_tokens + [t for t in (end,) if t is not None]
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


def _run_both(
    reference: nn.Module, candidate: nn.Module, inputs: Mapping[str, torch.Tensor], repeats: int
) -> tuple[Any, Any, float, float]:
    """Outputs of both models, then their median forward times, timed alternately after the warm-up run."""
    times: tuple[list[float], list[float]] = ([], [])
    with torch.inference_mode():
        outputs = reference(**inputs), candidate(**inputs)
        for _ in range(repeats):
            for model, bucket in zip((reference, candidate), times):
                start = time.perf_counter()
                model(**inputs)
                bucket.append(time.perf_counter() - start)
    ref_time, cand_time = (statistics.median(t) if t else math.nan for t in times)
    return outputs[0], outputs[1], ref_time, cand_time


def verify(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Mapping[str, torch.Tensor] | None = None,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    repeats: int = 3,
) -> VerificationReport:
    """Run ``reference`` and ``candidate`` on the same inputs and compare every tensor output.

    Args:
        reference: The model to trust (e.g. the stock, unpatched model).
        candidate: The patched or fused model.
        inputs: Keyword inputs of ``forward``; by default :func:`default_inputs` of ``reference``.
        atol, rtol: An output passes when ``|c - r| <= atol + rtol * |r|`` everywhere.
        repeats: Timed forward passes per model after the warm-up pass that gives the outputs (medians reported).
    """
    if inputs is None:
        inputs = default_inputs(reference)
    was_training = reference.training, candidate.training
    reference.eval()
    candidate.eval()
    try:
        ref_out, cand_out, ref_time, cand_time = _run_both(reference, candidate, inputs, repeats)
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
        reference_seconds=ref_time,
        candidate_seconds=cand_time,
        missing=tuple(n for n in ref_tensors if n not in cand_tensors),
    )
