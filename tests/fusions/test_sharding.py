"""How each built-in fusion family declares its sharding (``ModuleFusionSpec.tensor_parallel_layout``), given the
model's own TP plan, and the row arithmetic of fused tensors (``fusions/sharding.py``) that tensor parallelism, the
FSDP2 sharded load and the collective save share. The two-rank loads that apply them: tests/modes/."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch._transformers import tensor_parallel_supported
from modelpatch.errors import TensorParallelError
from modelpatch.fusions import get_fusion
from modelpatch.fusions.sharding import FusedParts, HeldRows, TensorParallelLayout, TensorParallelShard
from modelpatch.modes.parallel import rules_under
from support.models import tiny_config


def _meta_model(model_type: str, fusion_config: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return modelpatch.from_config(AutoModelForCausalLM, tiny_config(model_type), fusion_config=fusion_config)


def _rules(model: torch.nn.Module, generic: str) -> dict[str, str]:
    """The model's own TP plan rules at or under ``generic``, relative to it, as the mode hands them to the hook."""
    return rules_under(model.tp_plan, generic)


@pytest.fixture(scope="module")
def llama():
    return _meta_model("llama", {"qkv": True, "gate_up": True})


def test_qkv_shards_its_fused_projection_part_by_part(llama):
    attention = llama.model.layers[0].self_attn
    rules = _rules(llama, "model.layers.*.self_attn")
    assert rules == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
    layout = get_fusion("qkv").tensor_parallel_layout(attention, rules, 2)
    # q/k/v rows 32/16/16 (grouped-query attention); o_proj's rule stays the plan's.
    assert layout == TensorParallelLayout(
        frozenset({"q_proj", "k_proj", "v_proj"}),
        {"qkv_proj": TensorParallelShard("colwise", parts=FusedParts((32, 16, 16)))},
    )


def test_gate_up_shards_its_fused_projection_part_by_part(llama):
    rules = _rules(llama, "model.layers.*.mlp")
    layout = get_fusion("gate_up").tensor_parallel_layout(llama.model.layers[0].mlp, rules, 2)
    assert layout == TensorParallelLayout(
        frozenset({"gate_proj", "up_proj"}),
        {"gate_up_proj": TensorParallelShard("colwise", parts=FusedParts((64, 64)))},
    )


def test_projections_follow_what_the_plan_says_of_their_parts(llama):
    spec, attention = get_fusion("qkv"), llama.model.layers[0].self_attn
    assert spec.tensor_parallel_layout(attention, {"o_proj": "rowwise"}, 2) is None  # parts not sharded: whole
    # A plan naming the fused projection itself keeps that rule; the parts' rules name nothing any more.
    named = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "qkv_proj": "colwise"}
    assert spec.tensor_parallel_layout(attention, named, 2) == TensorParallelLayout(
        frozenset({"q_proj", "k_proj", "v_proj"}), {}
    )
    with pytest.raises(TensorParallelError, match=r"shards the parts of qkv_proj as .*'k_proj': 'rowwise'"):
        spec.tensor_parallel_layout(attention, {"q_proj": "colwise", "k_proj": "rowwise", "v_proj": "colwise"}, 2)
    with pytest.raises(TensorParallelError, match="only when every part is 'colwise'"):
        spec.tensor_parallel_layout(attention, {"q_proj": "colwise"}, 2)


def test_projection_slices_read_their_local_part_sizes_once_sharded():
    model = _meta_model("llama", {"qkv": True})
    attention = model.model.layers[0].self_attn
    spec = get_fusion("qkv")
    layout = spec.tensor_parallel_layout(attention, _rules(model, "model.layers.*.self_attn"), 2)
    spec.finish_tensor_parallel(attention, layout, 2)
    assert [(s.part_sizes, s.out_features) for s in (attention.q_proj, attention.k_proj, attention.v_proj)] == [
        ((16, 8, 8), 16),
        ((16, 8, 8), 8),
        ((16, 8, 8), 8),
    ]


@pytest.mark.skipif(not tensor_parallel_supported(), reason="tensor-parallel loads need transformers 5.23's plans")
def test_linear_experts_shard_each_expert_as_the_plan_shards_the_stacked_experts():
    model = _meta_model("qwen2_moe", {"linear_experts": True})
    experts = model.model.layers[0].mlp.experts
    spec = get_fusion("linear_experts")
    rules = _rules(model, "model.layers.*.mlp.experts")
    assert rules == {"": "moe_tp_experts", "gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    assert spec.tensor_parallel_layout(experts, rules, 2) == TensorParallelLayout(
        frozenset({"gate_up_proj", "down_proj"}),
        {
            "*.gate_proj": TensorParallelShard("colwise", local=True),
            "*.up_proj": TensorParallelShard("colwise", local=True),
            "*.down_proj": TensorParallelShard("rowwise", local=True),
        },
    )
    assert spec.tensor_parallel_layout(experts, {}, 2) is None
    with pytest.raises(TensorParallelError, match="linear_experts follow the .* plan only"):
        spec.tensor_parallel_layout(experts, {**rules, "down_proj": "colwise"}, 2)


def test_families_without_sharded_tensors_declare_none():
    """patch_embeddings' fused Linear is in the vision tower, which no TP plan shards: the default, replicated."""
    spec = get_fusion("patch_embeddings")
    assert type(spec).tensor_parallel_layout is modelpatch.ModuleFusionSpec.tensor_parallel_layout
    assert spec.tensor_parallel_layout(torch.nn.Linear(2, 2), {"": "colwise"}, 2) is None


def test_rows_of_a_fused_tensor_held_by_a_row_shard():
    parts = FusedParts((4, 2, 2))
    # Rows 3:6 of [q0..q3; k0 k1; v0 v1]: q3, then k0 k1, then v0.
    assert parts.held(3, 6) == [HeldRows(0, 3, 4, 0, 0), HeldRows(1, 0, 2, 4, 1)]
    assert parts.held(3, 7) == [HeldRows(0, 3, 4, 0, 0), HeldRows(1, 0, 2, 4, 1), HeldRows(2, 0, 1, 6, 3)]
    assert parts.held(5, 5) == []
    fused = torch.arange(8)
    for start, stop in ((0, 8), (3, 7), (4, 6), (6, 8)):
        shard = fused[start:stop]
        pieces = parts.held(start, stop)
        assert torch.equal(torch.cat([shard[held.shard] for held in pieces]), shard)
        assert all(torch.equal(fused[held.fused], shard[held.shard]) for held in pieces)


def test_rows_of_a_fused_tensor_sharded_part_by_part():
    parts = FusedParts((4, 2, 2))
    assert parts.divides(2) and not parts.divides(4)
    assert parts.local_sizes(2) == (2, 1, 1)
    assert parts.by_part(1, 2) == [HeldRows(0, 2, 4, 0, 0), HeldRows(1, 1, 2, 4, 2), HeldRows(2, 1, 2, 6, 3)]
    fused = torch.arange(8)
    shards = [torch.cat([fused[held.fused] for held in parts.by_part(rank, 2)]) for rank in range(2)]
    assert [shard.tolist() for shard in shards] == [[0, 1, 4, 6], [2, 3, 5, 7]]


def test_a_shard_description_is_checked():
    with pytest.raises(ValueError, match="only a colwise split goes part by part"):
        TensorParallelShard("rowwise", parts=FusedParts((2, 2)))
    with pytest.raises(ValueError, match="split must be 'colwise' or 'rowwise'"):
        TensorParallelShard("sideways")  # type: ignore[arg-type]


def test_a_shard_is_checked_against_the_module_it_names():
    """What the tensor-parallel mode refuses a layout for (tests/modes/test_tensor_parallel.py refuses user fusions
    declaring them): parts that do not tile a weight's rows, a split that cuts across the parts a weight is joined
    from, a module with nothing to split. Boundaries finer than the joined parts' keep every rank's rows in them."""
    with torch.device("meta"):
        fused = torch.nn.Linear(32, 128)  # gate and up, 64 rows each, joined along dim 0 (its bias too)
        down = torch.nn.Linear(128, 32, bias=False)  # its columns joined from two parts of 64
    joined = {"weight": (0, (64, 64)), "bias": (0, (64, 64))}
    assert TensorParallelShard("colwise", parts=FusedParts((64, 64))).problems("w12", fused, joined) == []
    assert TensorParallelShard("colwise", parts=FusedParts((32,) * 4)).problems("w12", fused, joined) == []
    assert TensorParallelShard("rowwise").problems("w12", fused, joined) == []  # splits the 32 input columns
    (one_block, bias) = TensorParallelShard("colwise").problems("w12", fused, joined)
    assert one_block.startswith("w12.weight is joined from parts of [64, 64] along dim 0, which a colwise split as one")
    assert one_block.endswith("declare the parts (parts=FusedParts((64, 64)))") and bias.startswith("w12.bias")
    (across, _) = TensorParallelShard("colwise", parts=FusedParts((32, 96))).problems("w12", fused, joined)
    assert "a colwise split by the parts [32, 96] cuts across" in across
    (untiled, _) = TensorParallelShard("colwise", parts=FusedParts((64,))).problems("w12", fused, {})
    assert untiled == "w12.weight has 128 rows, and the parts [64] declared for them tile 64"
    (columns,) = TensorParallelShard("rowwise").problems("w3", down, {"weight": (1, (64, 64))})
    assert columns.startswith("w3.weight is joined from parts of [64, 64] along dim 1, which a rowwise split")
    assert TensorParallelShard("colwise").problems("w3", down, {"weight": (1, (64, 64))}) == []
    assert TensorParallelShard("colwise").problems("act_fn", torch.nn.SiLU(), {}) == [
        "act_fn is a SiLU holding no parameter of its own: it cannot be split colwise"
    ]
