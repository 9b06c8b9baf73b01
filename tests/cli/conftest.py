"""Tiny checkpoints written by stock ``save_pretrained`` and a runner for the installed ``modelpatch`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MODELPATCH = Path(sys.executable).with_name("modelpatch")
# The command runs this checkout's package (not whichever one the environment installed) and the tests' helpers.
SOURCE = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "qwen2_moe"
    torch.manual_seed(1)
    config = Qwen2MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    Qwen2MoeForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def run_cli():
    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE), str(Path(__file__).parent)])}
        return subprocess.run(
            [str(MODELPATCH), *map(str, args)], capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL
        )

    return run
