"""``modelpatch.verify``: per-output differences, verdict and timings, with text and vision-language inputs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2VLForConditionalGeneration

import modelpatch
from modelpatch.verify import Timing, VerificationReport, default_inputs
from support.models import tiny_config
from support.process import run_fresh


def _qwen2_vl_checkpoint(path):
    config = tiny_config(
        "qwen2_vl", image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    return path


def test_vision_language_inputs_carry_an_image_and_verify_a_fused_patch_embedding(tmp_path):
    path = _qwen2_vl_checkpoint(tmp_path / "qwen2_vl")
    reference = modelpatch.from_pretrained(Qwen2VLForConditionalGeneration, path)
    fused = modelpatch.from_pretrained(Qwen2VLForConditionalGeneration, path, fusion_config={"patch_embeddings": True})

    inputs = default_inputs(reference)
    assert inputs["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert (inputs["input_ids"] == 60).sum() == 4  # 16 patches merged 2x2 -> 4 image tokens
    assert torch.equal(default_inputs(reference)["pixel_values"], inputs["pixel_values"])  # deterministic

    report = modelpatch.verify(reference, fused, atol=1e-4, rtol=1e-3)
    assert report.passed, str(report)
    assert "logits" in {o.name for o in report.outputs}
    assert 0 < max(o.max_abs for o in report.outputs) < 1e-4  # Conv3d vs Linear: not bitwise, but close
    assert report.reference_seconds > 0 and report.candidate_seconds > 0


def test_a_different_model_fails_and_the_report_says_which_output(tmp_path):
    torch.manual_seed(0)
    config = tiny_config("llama")
    reference, other = LlamaForCausalLM(config), LlamaForCausalLM(config)
    report = modelpatch.verify(reference, other)
    assert not report.passed
    logits = next(o for o in report.outputs if o.name == "logits")
    assert not logits.passed and logits.max_abs > 1e-3
    assert "FAILED" in str(report) and "NO" in str(report)
    assert modelpatch.verify(reference, reference).passed


def test_timings_come_from_alternating_benchmark_rounds():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama"))
    report = modelpatch.verify(model, model, rounds=2, min_run_time=0.01)
    for timing in (report.reference_timing, report.candidate_timing):
        assert timing.runs >= 2 and 0 < timing.low <= timing.high
        assert timing.spread >= 0
    assert "speed ratio" in str(report) and "±" in str(report)
    untimed = modelpatch.verify(model, model, rounds=0)
    assert untimed.passed and untimed.reference_timing.runs == 0


def test_default_inputs_need_a_transformers_model():
    """Inputs are made from a transformers config: any other module needs inputs=, said before anything runs."""
    reference, candidate = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"verify needs inputs=\.\.\. for a Linear"):
        modelpatch.verify(reference, candidate)
    report = modelpatch.verify(reference, reference, {"input": torch.randn(2, 4)}, rounds=0)
    assert report.passed


def _report(reference: Timing, candidate: Timing) -> VerificationReport:
    return VerificationReport(outputs=(), atol=1e-5, rtol=1e-4, reference_timing=reference, candidate_timing=candidate)


def test_a_speed_ratio_is_printed_only_when_the_rounds_tell_the_models_apart():
    """The demo printed "0.25x" beside PASSED with a spread of ±1635%: a ratio inside the noise is not reported."""
    noisy = _report(Timing(0.001, 0.0009, 0.0011, 30), Timing(0.004, 0.0008, 0.07, 30))
    assert not noisy.speed_measured
    assert "speed ratio not measurable" in str(noisy) and "0.25x" not in str(noisy)
    apart = _report(Timing(0.004, 0.0039, 0.0041, 30), Timing(0.001, 0.0009, 0.0011, 30))
    assert apart.speed_measured and "speed ratio 4.00x" in str(apart)
    assert not _report(Timing(math.nan, math.nan, math.nan, 0), Timing(math.nan, math.nan, math.nan, 0)).speed_measured


def test_a_timing_whose_rounds_disagree_is_not_measurable():
    """verify printed "speed ratio 0.00x" beside PASSED, with a reference timing of ±22660%: one slow round among fast
    ones made the reference's range end below the candidate's, so the ratio of two meaningless medians was shown."""
    unsteady = Timing(0.001, 0.001, 0.4542, 30)  # round medians 1 ms ... 454 ms: ±22660% around the 1 ms median
    steady_slow = Timing(0.5, 0.49, 0.51, 30)
    text = str(_report(unsteady, steady_slow))
    assert not _report(unsteady, steady_slow).speed_measured
    assert "reference not measurable (its rounds vary beyond ±25%)" in text
    assert "speed ratio not measurable (the rounds vary beyond ±25%)" in text
    assert "0.00x" not in text and "22660" not in text
    assert "candidate 500 ms (±2%)" in text
    # Steady and far apart: a real ratio, however small, is given with its digits.
    apart = _report(Timing(0.001, 0.00099, 0.00101, 30), steady_slow)
    assert apart.speed_measured and "speed ratio 0.002x" in str(apart)
    assert "forward: not timed" in str(
        _report(Timing(math.nan, math.nan, math.nan, 0), Timing(math.nan, math.nan, math.nan, 0))
    )


def test_importing_verify_leaves_torch_s_benchmark_tools_for_the_timing():
    # Every command of the CLI imports modelpatch.verify at start-up; torch.utils.benchmark (which imports torch's
    # C++ extension builder, and that setuptools) is only needed once a timing is asked for. setuptools itself is no
    # sign: torch 2.6's triton imports it when torchao does.
    script = (
        "import sys, modelpatch.verify\n"
        "print(sorted(m for m in ('torch.utils.benchmark', 'torch.utils.cpp_extension') if m in sys.modules))"
    )
    assert run_fresh(script).stdout.strip() == "[]"
