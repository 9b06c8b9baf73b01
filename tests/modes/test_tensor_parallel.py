"""Tensor-parallel loading: two CPU processes under ``torchrun`` with the gloo backend.

Every case runs in one launch (tensor_parallel_worker.py): llama plain and with fused q/k/v and gate/up, qwen2_moe
with per-expert Linear experts and plain, llama with a user-defined fusion (tests/fusions/test_user_defined_fusion.py)
declaring its sharding and declaring none. Each rank's logits must equal the single-process stock model's, the TP
model's saves must be byte-identical to the single-process saves, each rank must read only its shards, and an
unfused model must be sharded exactly as transformers' own TP load shards it (same DTensor placements, same hooks).
"""

from __future__ import annotations

import filecmp
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_user_defined_fusion import MISDECLARED_LAYOUTS, TENSOR_PARALLEL_FUSIONS
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import modelpatch
from modelpatch import register_fusion
from modelpatch._transformers import tensor_parallel_supported
from modelpatch.modes.parallel import TensorParallelError
from support.checkpoints import TinyCheckpoint
from support.compare import assert_bitwise_equal
from support.distributed import run_ranks
from support.files import read_tensors

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
RANKS = 2
# id: (checkpoint, fusion_config, compare with stock transformers' TP layout)
CASES = {
    "llama": ("llama", None, True),
    "llama_fused": ("llama", {"qkv": True, "gate_up": True}, False),
    "llama_tied": ("llama_tied", None, True),  # embeddings and head share one sharded weight
    "qwen2_moe_linear_experts": ("qwen2_moe", {"linear_experts": True}, False),
    "qwen2_moe": ("qwen2_moe", None, True),
    "llama_user_fusion": ("llama", {"swiglu": True}, False),  # declares its sharding
    "llama_user_fusion_whole": ("llama", {"swiglu_whole": True}, False),  # declares none: its MLPs stay whole
}
# Cases whose every parameter is sharded over the ranks.
SHARDED_CASES = sorted(set(CASES) - {"llama_user_fusion_whole"})


# A tp_plan rule naming no module (q_proj misspelt): transformers warns and shards without it.
PLAN_TYPO = "model.layers.*.self_attn.qq_proj"
# Head counts that do not divide by the ranks, unfused and with q/k/v fused (whose parts' rows do divide: 32/8/8):
# (checkpoint, fusion_config, the attention class and heads the refusal names, the TP sizes that work).
HEAD_REFUSALS = [
    ("llama_one_kv_head", None, "LlamaAttention) has 4 attention heads and 1 key/value heads", [1]),
    ("llama_one_kv_head", {"qkv": True}, "QKVFusedLlamaAttention) has 4 attention heads and 1 key/value heads", [1]),
    ("llama_three_heads", None, "LlamaAttention) has 3 attention heads and 3 key/value heads", [1, 3]),
]


@pytest.fixture(autouse=True)
def user_fusions():
    """The user-defined fusions of the cases, registered here too (as in the ranks) for the single-process loads."""
    for name, spec in TENSOR_PARALLEL_FUSIONS.items():
        register_fusion(name, spec())


@pytest.fixture(scope="module")
def checkpoints(tiny) -> dict[str, TinyCheckpoint]:
    """The checkpoints of the cases (the shared tiny ones)."""
    return {name: tiny(name) for name in ("llama", "llama_tied", "qwen2_moe")}


@pytest.fixture(scope="module")
def tp_run(checkpoints, tiny, tmp_path_factory):
    """Runs every case on two ranks once; returns the output directory."""
    if not tensor_parallel_supported():
        pytest.skip("this transformers predates the distributed API tensor-parallel loads drive (5.23)")
    out = tmp_path_factory.mktemp("tp")
    cases = []
    for case_id, (name, fusion_config, compare_stock) in CASES.items():
        checkpoint = checkpoints[name]
        cases.append(
            dict(
                id=case_id,
                name=name,
                path=str(checkpoint.path),
                fusion_config=fusion_config,
                compare_stock=compare_stock,
                **{"class": checkpoint.model_class.__name__},
            )
        )
    job = out / "job.json"
    refusals = [
        {"path": str(checkpoints["llama"].path), "tp_plan": {PLAN_TYPO: "colwise"}},
        *({"path": str(checkpoints["llama"].path), "fusion_config": {name: True}} for name in MISDECLARED_LAYOUTS),
        *({"path": str(tiny(name).path), "fusion_config": fusion_config} for name, fusion_config, *_ in HEAD_REFUSALS),
    ]
    job.write_text(json.dumps({"out": str(out), "cases": cases, "refusals": refusals}))
    run_ranks(WORKER, job, RANKS)
    return out


def _records(out: Path, case_id: str) -> list[dict]:
    return [torch.load(out / f"{case_id}_rank{rank}.pt", weights_only=False) for rank in range(RANKS)]


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_logits_equal_single_process_stock(tp_run, checkpoints, case_id):
    expected = checkpoints[CASES[case_id][0]].stock_outputs()["logits"]
    for record in _records(tp_run, case_id):
        torch.testing.assert_close(record["logits"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_saves_equal_single_process_saves(tp_run, checkpoints, tmp_path, case_id):
    name, fusion_config, _ = CASES[case_id]
    single = checkpoints[name].load(fusion_config)
    single.save_pretrained(tmp_path / "stock_save")
    modelpatch.save_pretrained(single, tmp_path / "modelpatch_save")
    for kind in ("stock_save", "modelpatch_save"):
        written = tp_run / f"{case_id}_{kind}"
        for file in ("model.safetensors", "config.json"):
            assert filecmp.cmp(written / file, tmp_path / kind / file, shallow=False), f"{kind}/{file} differs"
    # The original layout: the tensors of the checkpoint the model was loaded from, bitwise.
    assert filecmp.cmp(
        tp_run / f"{case_id}_stock_save" / "model.safetensors",
        checkpoints[name].path / "model.safetensors",
        shallow=False,
    )


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_every_rank_streams_the_saved_checkpoint(tp_run, case_id):
    saved = read_tensors(tp_run / f"{case_id}_modelpatch_save")
    for record in _records(tp_run, case_id):
        assert_bitwise_equal(record["streamed"], saved)


@pytest.mark.parametrize("case_id", SHARDED_CASES)
def test_each_rank_reads_only_its_shards(tp_run, checkpoints, case_id):
    checkpoint_bytes = (checkpoints[CASES[case_id][0]].path / "model.safetensors").stat().st_size
    for record in _records(tp_run, case_id):
        # The bytes of every parameter's local shard (a tied head is the embedding's: listed and read once).
        local = sum(math.prod(shape) * 4 for _, _, shape in record["layout"]["params"].values())
        assert record["read"] == local < 0.75 * checkpoint_bytes


@pytest.mark.parametrize("case_id", [c for c in sorted(CASES) if CASES[c][2]])
def test_unfused_model_is_sharded_as_transformers_shards_it(tp_run, case_id):
    for record in _records(tp_run, case_id):
        assert record["layout"] == record["stock_layout"]
        torch.testing.assert_close(record["logits"], record["stock_logits"], atol=0, rtol=0)


def test_fused_projections_hold_each_parts_rows(tp_run):
    params = _records(tp_run, "llama_fused")[0]["layout"]["params"]
    # q/k/v rows 32/16/16 and gate/up 64/64 (of 32 inputs): half of every part on each rank.
    assert params["model.layers.0.self_attn.qkv_proj.weight"][2] == (32, 32)
    assert params["model.layers.0.mlp.gate_up_proj.weight"][2] == (64, 32)
    assert params["model.layers.0.self_attn.o_proj.weight"][1:] == ("(Shard(dim=1),)", (32, 16))


def test_experts_shard_like_stock_experts(tp_run):
    params = _records(tp_run, "qwen2_moe_linear_experts")[0]["layout"]["params"]
    expert = "model.layers.0.mlp.experts.1"
    assert params[f"{expert}.gate_proj.weight"][1:] == ("(Shard(dim=0),)", (8, 32))
    assert params[f"{expert}.up_proj.weight"][1:] == ("(Shard(dim=0),)", (8, 32))
    assert params[f"{expert}.down_proj.weight"][1:] == ("(Shard(dim=1),)", (32, 8))


def test_a_user_fusion_shards_as_it_declares(tp_run):
    params = _records(tp_run, "llama_user_fusion")[0]["layout"]["params"]
    # w12: half of gate's 64 rows and half of up's on each rank; w3 split along its input, as stock's down_proj.
    assert params["model.layers.0.mlp.w12.weight"] == ("Tensor", None, (64, 32))
    assert params["model.layers.0.mlp.w3.weight"][1:] == ("(Shard(dim=1),)", (32, 32))


def test_a_user_fusion_declaring_no_sharding_stays_whole_on_every_rank(tp_run):
    for record in _records(tp_run, "llama_user_fusion_whole"):
        params = record["layout"]["params"]
        assert params["model.layers.0.mlp.w12.weight"] == ("Tensor", None, (128, 32))
        assert params["model.layers.0.mlp.w3.weight"] == ("Tensor", None, (32, 64))
        assert params["model.layers.0.self_attn.o_proj.weight"][1:] == ("(Shard(dim=1),)", (32, 16))


def test_plan_rules_naming_nothing_are_refused_on_every_rank(tp_run):
    for rank in range(RANKS):
        message = json.loads((tp_run / f"refusals_rank{rank}.json").read_text())[0]
        assert f"tp_plan rules ['{PLAN_TYPO}'] name no module or parameter of LlamaForCausalLM" in message


def test_a_user_fusions_layout_that_does_not_fit_its_module_is_refused_by_name_on_every_rank(tp_run):
    """Parts that do not tile w12's rows, a shard naming a module SwiGLU lacks, w12 (gate and up joined) split as one
    block: each loaded silently (the last with logits off by 0.14 at two ranks)."""
    for rank in range(RANKS):
        messages = json.loads((tp_run / f"refusals_rank{rank}.json").read_text())[1 : 1 + len(MISDECLARED_LAYOUTS)]
        for message, (_, expected) in zip(messages, MISDECLARED_LAYOUTS.values(), strict=True):
            assert "tensor_parallel_layout does not fit its module" in message and expected in message, message


def test_head_counts_not_dividing_by_the_ranks_are_refused_on_every_rank(tp_run):
    """Stock's first forward fails on them (a rank holding half a key/value head); the plan refuses, naming the heads
    and the TP sizes that work, fused or not."""
    for rank in range(RANKS):
        messages = json.loads((tp_run / f"refusals_rank{rank}.json").read_text())[1 + len(MISDECLARED_LAYOUTS) :]
        assert len(messages) == len(HEAD_REFUSALS)
        for message, (*_, heads, sizes) in zip(messages, HEAD_REFUSALS, strict=True):
            assert message == (
                f"LlamaForCausalLM cannot be sharded over {RANKS} ranks: each rank computes whole attention heads, "
                f"and model.layers.*.self_attn ({heads}, which do not all divide by {RANKS}. "
                f"TP sizes that divide every head count: {sizes}."
            )


def test_one_process_loads_unsharded(tiny):
    """As in transformers: tp_plan='auto' outside torchrun (world size 1) shards nothing."""
    checkpoint = tiny("llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, tp_plan="auto")
    assert not any(type(p.data) is not torch.Tensor for p in model.parameters())
    expected = checkpoint.stock_outputs()["logits"]
    torch.testing.assert_close(checkpoint.outputs(model)["logits"], expected, atol=0, rtol=0)


@pytest.mark.skipif(not tensor_parallel_supported(), reason="no parallel styles to check a plan against (5.22)")
@pytest.mark.parametrize(
    "keywords",
    [
        {"tp_plan": {PLAN_TYPO: "colwise"}},
        {"tp_plan": {PLAN_TYPO: "colwise"}, "tp_size": 1},
        {"distributed_config": {"tp_plan": {PLAN_TYPO: "colwise"}}},
    ],
)
def test_one_process_refuses_plan_rules_naming_nothing_as_every_rank_does(tiny, keywords):
    """A plan that shards nothing in one process is still the plan the script gives torchrun: a rule naming no
    module is refused by name here too (test_plan_rules_naming_nothing_are_refused_on_every_rank), before any data
    is read; one naming a module loads unsharded."""
    checkpoint = tiny("llama")
    with pytest.raises(TensorParallelError, match=rf"tp_plan rules \['{re.escape(PLAN_TYPO)}'\] name no module"):
        modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, **keywords)
    rule = {"model.layers.*.self_attn.q_proj": "colwise"}
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, tp_plan=rule)
    assert not any(type(p.data) is not torch.Tensor for p in model.parameters())
    torch.testing.assert_close(
        checkpoint.outputs(model)["logits"], checkpoint.stock_outputs()["logits"], atol=0, rtol=0
    )


# Parallel styles and world-size checks exist only with transformers' distributed API (5.23 on); on 5.22 a sharded load
# is refused as a whole (test_sharded_loads_on_a_transformers_without_the_distributed_api_are_refused_by_name).
NEEDS_DISTRIBUTED_API = pytest.mark.skipif(
    not tensor_parallel_supported(), reason="this transformers has no distributed API (5.22): sharded loads are refused"
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 2}, "tp_size=2 needs tp_plan"),
        ({"tp_plan": "auto", "distributed_config": DistributedConfig(tp_size=2)}, "not both"),
        ({"distributed_config": DistributedConfig(tp_size=1, fsdp_size=2)}, r"\(fsdp_size=2\)"),
        ({"distributed_config": "tp"}, "must be a transformers DistributedConfig"),
        ({"tp_plan": 123}, r"tp_plan must be 'auto' or a dict of \{module pattern: parallel style\}, got 123 \(int\)"),
        ({"tp_plan": ["colwise"]}, r"tp_plan must be 'auto' or a dict .*\(list\)"),
        pytest.param(
            {"tp_plan": {"model.layers.*.self_attn.q_proj": "colwize"}},
            r"unknown parallel styles: \{'model.layers.\*.self_attn.q_proj': 'colwize'\}.*colwise",
            marks=NEEDS_DISTRIBUTED_API,
        ),
        pytest.param(
            {"distributed_config": {"tp_plan": {"model.layers.*.mlp.up_proj": "rowwize"}}},
            r"distributed_config.tp_plan names unknown parallel styles",
            marks=NEEDS_DISTRIBUTED_API,
        ),
        pytest.param(
            {"tp_plan": "auto", "tp_size": 64},
            r"tp_size=64 needs 64 processes, but this one was launched with world size 1",
            marks=NEEDS_DISTRIBUTED_API,
        ),
        ({"tp_plan": "auto", "tp_size": 0}, "tp_size must be a positive integer, got 0"),
        ({"distributed_config": {"tp_plan": "auto", "enable_expert_parallel": True}}, "asks for expert parallelism"),
        ({"distributed_config": {"tp_plan": "auto", "enable_sequence_parallel": True}}, "sequence parallelism"),
        ({"distributed_config": DistributedConfig(tp_plan="auto", enable_sequence_parallel=True)}, "sequence parallel"),
        ({"distributed_config": {"tp_plan": "auto", "tp_sise": 2}}, "distributed_config has no field 'tp_sise'"),
    ],
)
def test_bad_tensor_parallel_keywords_are_refused(tiny, kwargs, message):
    with pytest.raises(TensorParallelError, match=message):
        modelpatch.from_pretrained(AutoModelForCausalLM, tiny("llama").path, **kwargs)


def test_sharded_loads_on_a_transformers_without_the_distributed_api_are_refused_by_name(tiny):
    if tensor_parallel_supported():
        pytest.skip("this transformers has the distributed API (the two-rank tests above run)")
    with pytest.raises(TensorParallelError, match=r"tp_size=2.*transformers 5\.23.*Upgrade transformers"):
        modelpatch.from_pretrained(AutoModelForCausalLM, tiny("llama").path, tp_plan="auto", tp_size=2)
