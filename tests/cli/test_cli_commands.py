"""Each ``modelpatch`` command run as a subprocess, as a new user would, on stock-saved checkpoints."""

from __future__ import annotations

import filecmp
import json

import pytest
import torch
from transformers import LlamaForCausalLM

import modelpatch

COMMANDS = ["inspect", "plan", "convert", "verify", "demo"]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help(run_cli, command):
    result = run_cli(*([command] if command else []), "--help")
    assert result.returncode == 0
    assert "usage: modelpatch" in result.stdout
    if command is None:
        assert all(c in result.stdout for c in COMMANDS) and "Exit codes" in result.stdout


def test_inspect_describes_model_fusions_and_layout(run_cli, moe_checkpoint):
    result = run_cli("inspect", moe_checkpoint)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "model type:   qwen2_moe" in out and "architecture: Qwen2MoeForCausalLM" in out
    assert "2  Qwen2MoeExperts" in out
    assert "linear_experts     2 modules of Qwen2MoeExperts" in out
    assert "patch_embeddings   not applicable" in out
    assert "model.layers.*.mlp.experts.*.gate_proj.weight" in out
    assert "55 tensors in 1 file(s)" in out


def test_plan_lists_every_parameter_with_operations(run_cli, llama_checkpoint):
    result = run_cli("plan", llama_checkpoint, "--fusion", "qkv,gate_up")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    fused = [line for line in lines if line.startswith("model.layers.0.self_attn.qkv_proj.weight <- ")]
    assert len(fused) == 1
    assert "q_proj.weight" in fused[0] and "v_proj.weight" in fused[0]
    assert "Concatenate(dim=0, sizes=(32, 16, 16))" in fused[0]
    planned = modelpatch.plan_pretrained(LlamaForCausalLM, llama_checkpoint, fusion_config={"qkv": True, "gate_up": True})
    targets = {line.split(" <- ")[0] for line in lines[1:] if " <- " in line}
    assert targets == set(planned.plan.expected)


def test_convert_round_trip_and_refusals(run_cli, llama_checkpoint, tmp_path):
    runtime = tmp_path / "runtime"
    result = run_cli("convert", llama_checkpoint, runtime, "--fusion", "qkv,gate_up", "--runtime-format")
    assert result.returncode == 0, result.stderr
    config = json.loads((runtime / "config.json").read_text())
    assert config["modelpatch_runtime_layout"] is True and config["modelpatch_fusion_config"] == {"qkv": True, "gate_up": True}
    assert "fusion_config" not in config  # transformers 5.23 would act on that key itself

    back = tmp_path / "back"
    assert run_cli("convert", runtime, back).returncode == 0
    assert run_cli("convert", llama_checkpoint, back).returncode == 2  # exists, no --force
    assert run_cli("convert", llama_checkpoint, back, "--fusion", "none", "--force").returncode == 0
    assert filecmp.cmp(llama_checkpoint / "model.safetensors", back / "model.safetensors", shallow=False)

    reloaded = modelpatch.from_pretrained(LlamaForCausalLM, runtime)
    stock = LlamaForCausalLM.from_pretrained(llama_checkpoint)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(reloaded(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-5)


def test_verify_passes_for_equivalent_fusions(run_cli, moe_checkpoint):
    result = run_cli("verify", moe_checkpoint, "--fusion", "qkv,gate_up,linear_experts")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout and "logits" in result.stdout and "speed ratio" in result.stdout


def test_verify_fails_above_tolerance(run_cli, llama_checkpoint):
    same = run_cli("verify", llama_checkpoint, "--patch", "LlamaMLP=cli_patches:SameMLP")
    assert same.returncode == 0, same.stdout + same.stderr
    doubled = run_cli("verify", llama_checkpoint, "--patch", "LlamaMLP=cli_patches:DoubledMLP")
    assert doubled.returncode == 1
    assert "FAILED" in doubled.stdout and "NO" in doubled.stdout


def test_demo_runs_end_to_end(run_cli):
    result = run_cli("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("byte-identical to the source: yes") == 2
    assert "demo PASSED" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "/nonexistent/checkpoint"], "is not a local directory"),
        (["plan", "{empty}"], "has no config.json"),
        (["verify", "{llama}", "--fusion", "qkv,bogus"], "Unknown fusion 'bogus'"),
        (["plan", "{llama}", "--patch", "LlamaMLP"], "expected ORIGINAL=package.module:Class"),
        (["plan", "{llama}", "--patch", "LlamaMLP=no_such_module:X"], "cannot import 'no_such_module'"),
        (["plan", "{llama}", "--patch", "LlamaMLP=cli_patches:Missing"], "has no 'Missing'"),
        (["plan", "{llama}", "--patch", "LlamaMLP=cli_patches:NOT_A_MODULE"], "must be a subclass of torch.nn.Module"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(run_cli, llama_checkpoint, tmp_path, args, message):
    args = [a.format(llama=llama_checkpoint, empty=tmp_path) for a in args]
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # Only modelpatch's own line: other packages may log at import time (torchao does when installed).
    assert len([line for line in result.stderr.splitlines() if line.startswith("modelpatch")]) == 1


def test_runtime_layout_back_to_the_original_and_inspect_says_which(llama_checkpoint, tmp_path, capsys):
    from modelpatch.cli.main import main

    runtime = tmp_path / "runtime"
    assert main(["convert", str(llama_checkpoint), str(runtime), "--fusion", "qkv,gate_up", "--runtime-format"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(runtime)]) == 0
    assert "runtime layout of fusions ['gate_up', 'qkv']" in capsys.readouterr().out
    assert main(["inspect", str(llama_checkpoint)]) == 0
    assert "layout:       original" in capsys.readouterr().out

    # --fusion none names the target layout; the source is loaded with the fusions it was saved in.
    back = tmp_path / "back"
    assert main(["convert", str(runtime), str(back), "--fusion", "none"]) == 0
    assert filecmp.cmp(llama_checkpoint / "model.safetensors", back / "model.safetensors", shallow=False)
    assert main(["convert", str(runtime), str(tmp_path / "other"), "--fusion", "qkv", "--runtime-format"]) == 2
    assert "convert it to the original layout first" in capsys.readouterr().err
