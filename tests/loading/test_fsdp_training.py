"""Training with FSDP2 (``fully_shard``) on models modelpatch builds: two CPU processes under ``torchrun`` (gloo).

Every case runs in one launch (fsdp_worker.py): llama plain and with fused q/k/v and gate/up, qwen2_moe with
per-expert Linear experts (rank 0's batch is one token, so most experts get no token there), each beside FSDP2 on
stock transformers' model of the same checkpoint. Losses and first-step gradients must equal stock's, the weights
after training too, and the weight stream of the sharded model must equal the unsharded model's, bitwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import modelpatch
from support.compare import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORKER = Path(__file__).with_name("fsdp_worker.py")
RANKS = 2
# id: (checkpoint, fusion_config, placement of the shards: FSDP's default dim 0, or "dim1")
CASES = {
    "llama": ("llama", None, None),
    "llama_fused": ("llama", {"qkv": True, "gate_up": True}, None),
    "llama_fused_dim1": ("llama", {"qkv": True, "gate_up": True}, "dim1"),
    "qwen2_moe_linear_experts": ("qwen2_moe", {"linear_experts": True}, None),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_run(tiny, tmp_path_factory):
    """Runs every case (and stock FSDP2 on each checkpoint) on two ranks once; returns the output directory."""
    out = tmp_path_factory.mktemp("fsdp")
    cases = []
    for case_id, (name, fusion_config, placement) in CASES.items():
        checkpoint = tiny(name)
        common = dict(path=str(checkpoint.path), placement=placement, routed=name == "qwen2_moe")
        common["class"] = checkpoint.model_class.__name__
        cases.append(dict(common, id=case_id, fusion_config=fusion_config, stock=False))
        cases.append(dict(common, id=f"{case_id}_stock", fusion_config=None, stock=True))
    job = out / "job.json"
    job.write_text(json.dumps({"out": str(out), "cases": cases}))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(Path(modelpatch.__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={RANKS}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        str(WORKER),
        str(job),
    ]
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def _records(out: Path, case_id: str) -> list[dict]:
    return [torch.load(out / f"{case_id}_rank{rank}.pt", weights_only=False) for rank in range(RANKS)]


@pytest.mark.parametrize("case_id", [case for case in sorted(CASES) if case != "qwen2_moe_linear_experts"])
def test_training_matches_stock_fsdp2_bitwise(fsdp_run, case_id):
    for record, stock in zip(_records(fsdp_run, case_id), _records(fsdp_run, f"{case_id}_stock"), strict=True):
        torch.testing.assert_close(record["losses"], stock["losses"], atol=0, rtol=0)
        assert_bitwise_equal(record["grads"], stock["grads"])
        assert_bitwise_equal(record["trained"], stock["trained"])


def test_expert_training_matches_stock_fsdp2_closely(fsdp_run):
    """Per-expert Linears with gradients run expert by expert, gate and up as two products where stock takes one of
    their stacked rows: CPU kernels may round those last bits differently (first-step gradients within 1e-6; three
    AdamW steps, which divide by the root of the squared gradients, within 1e-4). The first loss is bitwise stock's."""
    case_id = "qwen2_moe_linear_experts"
    for record, stock in zip(_records(fsdp_run, case_id), _records(fsdp_run, f"{case_id}_stock"), strict=True):
        assert sorted(record["grads"]) == sorted(stock["grads"])  # every expert's, on every rank
        torch.testing.assert_close(record["losses"][0], stock["losses"][0], atol=0, rtol=0)
        torch.testing.assert_close(record["losses"], stock["losses"], atol=1e-6, rtol=0)
        torch.testing.assert_close(record["grads"], stock["grads"], atol=1e-6, rtol=0)
        torch.testing.assert_close(record["trained"], stock["trained"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_sharded_weight_stream_equals_the_unsharded_one(fsdp_run, case_id):
    for record in _records(fsdp_run, case_id):
        assert_bitwise_equal(record["streamed"], record["unsharded"])


def test_the_expert_case_leaves_experts_without_tokens_on_one_rank(fsdp_run):
    """What made the first backward desynchronise the ranks before experts without tokens took part: on rank 0 some
    experts of a layer get no token while rank 1 routes to all of them."""
    first, second = (record["routed"] for record in _records(fsdp_run, "qwen2_moe_linear_experts"))
    assert any(len(experts) < 4 for experts in first)
    assert all(len(experts) == 4 for experts in second)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_load_state_dict_in_the_original_layout_on_the_sharded_model(fsdp_run, tiny, case_id):
    original = tiny(CASES[case_id][0]).tensors()
    plus_one = {key: tensor + 1 for key, tensor in original.items()}
    part = "model.layers.0.self_attn.k_proj.weight"
    for record in _records(fsdp_run, case_id):
        assert_bitwise_equal(record["reloaded"], plus_one)
        assert_bitwise_equal(record["partly_reloaded"], {**original, part: plus_one[part]})


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_fuse_and_unfuse_refuse_a_sharded_model_by_name(fsdp_run, case_id):
    for record in _records(fsdp_run, case_id):
        for message in record["refusals"]:
            assert "does not work on a FSDP2-sharded model" in message, message
            assert "before fully_shard" in message
