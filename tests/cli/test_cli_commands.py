"""Each ``modelpatch`` command on stock-saved checkpoints, called in-process; one smoke test of the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import modelpatch
from support.compare import assert_same_files, module_types

COMMANDS = ["inspect", "plan", "convert", "verify", "demo"]


def test_console_script_answers_help_and_version_without_importing_torch():
    """The installed ``modelpatch`` script, on this checkout's sources; ``-X importtime`` lists what it imported."""
    script = Path(sys.executable).with_name("modelpatch")
    env = {**os.environ, "PYTHONPATH": str(Path(modelpatch.__file__).parents[1]), "PYTHONPROFILEIMPORTTIME": "1"}
    for flag, expected in [("--help", "usage: modelpatch"), ("--version", f"modelpatch {modelpatch.__version__}")]:
        result = subprocess.run([script, flag], capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout
        lines = result.stderr.splitlines()
        imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
        assert "modelpatch.cli.main" in imported
        assert not imported & {"torch", "transformers", "safetensors", "numpy"}


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help(cli, command):
    code, out, _ = cli(*([command] if command else []), "--help")
    assert code == 0
    assert "usage: modelpatch" in out
    if command is None:
        assert all(c in out for c in COMMANDS) and "Exit codes" in out and "--version" in out


def test_version(cli):
    assert cli("--version") == (0, f"modelpatch {modelpatch.__version__}\n", "")


def test_inspect_describes_model_fusions_and_layout(cli, moe_checkpoint):
    code, out, err = cli("inspect", moe_checkpoint)
    assert code == 0, err
    assert "model type:   qwen2_moe" in out and "architecture: Qwen2MoeForCausalLM" in out
    assert "2  Qwen2MoeExperts" in out
    assert "linear_experts     2 modules of Qwen2MoeExperts" in out
    assert "patch_embeddings   not applicable" in out
    assert "model.layers.*.mlp.experts.*.gate_proj.weight" in out
    assert "55 tensors in 1 file(s)" in out


def test_inspect_installs_lists_every_process_wide_install(cli, moe_checkpoint):
    cli("inspect", moe_checkpoint)  # a checkpoint inspected first: the build's installs are made
    code, out, err = cli("inspect", "--installs")
    assert code == 0, err
    expected = []
    for install in modelpatch.installs():
        state = "installed" if install.installed else "not installed"
        expected += [f"{install.name}: {state}", f"  patches: {install.patches}", f"  by:      {install.by}, at "]
    lines = out.splitlines()
    assert len(lines) == len(expected) == 3 * 8
    assert all(line.startswith(prefix) for line, prefix in zip(lines, expected, strict=True))
    assert "meta_initialisation: installed" in lines or "transformers_patch_registry: installed" in lines
    # a checkpoint or the installs, not both
    code, out, err = cli("inspect", moe_checkpoint, "--installs")
    assert code == 2 and out == "" and "not allowed with argument" in err


def test_plan_lists_every_parameter_with_operations(cli, llama_checkpoint):
    code, out, err = cli("plan", llama_checkpoint, "--fusion", "qkv,gate_up")
    assert code == 0, err
    lines = out.splitlines()
    fused = [line for line in lines if line.startswith("model.layers.0.self_attn.qkv_proj.weight <- ")]
    assert len(fused) == 1
    assert "q_proj.weight" in fused[0] and "v_proj.weight" in fused[0]
    assert "Concatenate(dim=0, sizes=(32, 16, 16))" in fused[0]
    planned = modelpatch.plan_pretrained(
        LlamaForCausalLM, llama_checkpoint, fusion_config={"qkv": True, "gate_up": True}
    )
    targets = {line.split(" <- ")[0] for line in lines[1:] if " <- " in line}
    assert targets == set(planned.expected)


def test_convert_round_trip_and_refusals(cli, llama_checkpoint, tmp_path):
    runtime = tmp_path / "runtime"
    code, _, err = cli("convert", llama_checkpoint, runtime, "--fusion", "qkv,gate_up", "--runtime-format")
    assert code == 0, err
    config = json.loads((runtime / "config.json").read_text())
    assert config["modelpatch"] == {
        "version": 1,
        "runtime_layout": True,
        "fusion_config": {"qkv": True, "gate_up": True},
    }
    assert "fusion_config" not in config  # transformers 5.23 would act on that key itself

    back = tmp_path / "back"
    assert cli("convert", runtime, back)[0] == 0
    assert cli("convert", llama_checkpoint, back)[0] == 2  # exists, no --force
    assert cli("convert", llama_checkpoint, back, "--fusion", "none", "--force")[0] == 0
    assert_same_files(back, llama_checkpoint)

    reloaded = modelpatch.from_pretrained(LlamaForCausalLM, runtime)
    stock = LlamaForCausalLM.from_pretrained(llama_checkpoint)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(reloaded(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-5)


def test_runtime_layout_back_to_the_original_and_inspect_says_which(cli, llama_checkpoint, tmp_path):
    runtime = tmp_path / "runtime"
    assert cli("convert", llama_checkpoint, runtime, "--fusion", "qkv,gate_up", "--runtime-format")[0] == 0
    code, out, _ = cli("inspect", runtime)
    assert code == 0 and "runtime layout of fusions ['gate_up', 'qkv']" in out
    code, out, _ = cli("inspect", llama_checkpoint)
    assert code == 0 and "layout:       original" in out

    # --fusion none names the target layout; the source is loaded with the fusions it was saved in.
    back = tmp_path / "back"
    assert cli("convert", runtime, back, "--fusion", "none")[0] == 0
    assert_same_files(back, llama_checkpoint)
    code, _, err = cli("convert", runtime, tmp_path / "other", "--fusion", "qkv", "--runtime-format")
    assert code == 2 and "convert it to the original layout first" in err


def test_runtime_layout_back_with_fusion_none_is_the_original_checkpoint(cli, llama_checkpoint, tmp_path):
    """The tensors came back byte for byte, but config.json kept the runtime source's fusion record: a later
    modelpatch load fused the checkpoint again."""
    runtime, back = tmp_path / "runtime", tmp_path / "back"
    assert cli("convert", llama_checkpoint, runtime, "--fusion", "qkv,gate_up", "--runtime-format")[0] == 0
    code, _, err = cli("convert", runtime, back, "--fusion", "none")
    assert code == 0, err
    assert_same_files(back, llama_checkpoint)
    assert (back / "config.json").read_bytes() == (llama_checkpoint / "config.json").read_bytes()
    reloaded = modelpatch.from_pretrained(LlamaForCausalLM, back)
    assert module_types(reloaded) == module_types(LlamaForCausalLM.from_pretrained(llama_checkpoint))

    # --fusion NAMES records those fusions for later loads, as it does for a source in the original layout.
    code, _, err = cli("convert", runtime, tmp_path / "qkv", "--fusion", "qkv")
    assert code == 0, err
    assert json.loads((tmp_path / "qkv" / "config.json").read_text())["modelpatch"]["fusion_config"] == {"qkv": True}


def test_convert_records_only_the_fusions_that_apply_to_the_model(cli, llama_checkpoint, tmp_path):
    """linear_experts fuses nothing in a dense Llama: recorded, config.json said the checkpoint is fused with it."""
    code, _, err = cli("convert", llama_checkpoint, tmp_path / "out", "--fusion", "qkv,linear_experts")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["modelpatch"]["fusion_config"] == {"qkv": True}
    assert "note: --fusion linear_experts fuses nothing in LlamaForCausalLM: not recorded" in err
    code, _, err = cli("convert", llama_checkpoint, tmp_path / "none", "--fusion", "linear_experts")
    assert code == 0, err
    assert_same_files(tmp_path / "none", llama_checkpoint)
    assert (tmp_path / "none" / "config.json").read_bytes() == (llama_checkpoint / "config.json").read_bytes()


def test_verify_passes_for_equivalent_fusions(cli, moe_checkpoint):
    code, out, err = cli("verify", moe_checkpoint, "--fusion", "qkv,gate_up,linear_experts")
    assert code == 0, out + err
    assert "PASSED" in out and "logits" in out and "speed ratio" in out


def test_verify_of_a_runtime_layout_checkpoint_against_its_stock_model(cli, llama_checkpoint, tmp_path):
    """The stock reference was loaded with no fusions, which a runtime layout refuses: every verify of one was
    "cannot be loaded with fusions []", even with --fusion naming the stored fusions."""
    runtime = tmp_path / "runtime"
    assert cli("convert", llama_checkpoint, runtime, "--fusion", "qkv", "--runtime-format")[0] == 0
    for fusions in (["--fusion", "qkv"], []):
        code, out, err = cli("verify", runtime, *fusions)
        assert code == 0, out + err
        assert "PASSED" in out and "runtime layout of fusions ['qkv']" in err
    # The reference is the stock model, not the candidate again: a patch that changes the output fails.
    code, out, _ = cli("verify", runtime, "--patch", "LlamaMLP=cli_patches:DoubledMLP")
    assert code == 1 and "FAILED" in out
    # Other fusions than the stored ones: refused in one line, before anything is loaded.
    code, out, err = cli("verify", runtime, "--fusion", "gate_up")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "runtime layout of fusions ['qkv']" in err and "--fusion qkv" in err


def test_verify_fails_above_tolerance(cli, llama_checkpoint):
    code, out, err = cli("verify", llama_checkpoint, "--patch", "LlamaMLP=cli_patches:SameMLP")
    assert code == 0, out + err
    code, out, _ = cli("verify", llama_checkpoint, "--patch", "LlamaMLP=cli_patches:DoubledMLP")
    assert code == 1
    assert "FAILED" in out and "NO" in out


def test_demo_runs_end_to_end(cli):
    code, out, err = cli("demo")
    assert code == 0, out + err
    assert out.count("byte-identical to the source: yes") == 2
    assert "demo PASSED" in out


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
        (["plan", "{llama}", "--import", "no_such_module"], "cannot import --import module 'no_such_module'"),
        (["--import", "no_such_module", "plan", "{llama}"], "cannot import --import module 'no_such_module'"),
        (["convert", "{llama}", "{empty}/out", "--dtype", "int8"], "--dtype 'int8' is not one of auto, float32"),
        (["verify", "{llama}", "--dtype", "float8_e4m3fn"], "--dtype 'float8_e4m3fn' is not one of auto, float32"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(cli, llama_checkpoint, tmp_path, args, message):
    code, out, err = cli(*[a.format(llama=llama_checkpoint, empty=tmp_path) for a in args])
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args", [["bogus"], ["inspect"], ["convert", "a"], ["verify", "x", "--atol", "small"]])
def test_usage_errors_exit_code_2(cli, args):
    code, out, err = cli(*args)
    assert code == 2 and out == "" and "usage: modelpatch" in err
