"""Planning from metadata: every checkpoint key is used exactly once or reported; plans reverse exactly.

The property tests draw random MoE-shaped key sets (random layer and expert counts, random deletions, random
unrelated or look-alike keys) and check, for the built-in mappings plus the seeds' fused ``q/k/v`` converter:

* no key is matched twice (it feeds at most one output or group);
* none is silently dropped (a key that feeds nothing is named, or its layer is, in ``plan.problems``);
* complete key sets plan without problems, their groups reverse bit for bit, and ``plan_save`` on the runtime
  layout gives back exactly the checkpoint's keys and shapes.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelpatch import (
    Chunk,
    Concatenate,
    ConversionError,
    MergeModulelist,
    SplitModulelist,
    WeightConverter,
    WeightRenaming,
)
from modelpatch.conversion import TensorMeta, plan_load, plan_save
from modelpatch.conversion.registry import get_checkpoint_conversion_mapping
from support.compare import assert_tensor_bitwise_equal

# Dimension letters as the shape formulas below write them (I is not ambiguous there).
H, KV, I = 8, 4, 6  # noqa: E741 - hidden, kv rows (grouped-query: k/v have half q's rows), expert intermediate
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEED_QKV = [WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])]


def meta(*shape, dtype=torch.float32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def moe_checkpoint(layers: int, experts: int, style: str = "qwen", bias: bool = True) -> dict[str, TensorMeta]:
    keys = {"model.embed_tokens.weight": meta(32, H), "model.norm.weight": meta(H), "lm_head.weight": meta(32, H)}
    container, (g, u, d) = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if style == "mixtral"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    for i in range(layers):
        p = f"model.layers.{i}."
        keys.update({p + "input_layernorm.weight": meta(H), p + "post_attention_layernorm.weight": meta(H)})
        for name, rows in (("q", H), ("k", KV), ("v", KV)):
            keys[f"{p}self_attn.{name}_proj.weight"] = meta(rows, H)
            if bias:
                keys[f"{p}self_attn.{name}_proj.bias"] = meta(rows)
        keys[p + "self_attn.o_proj.weight"] = meta(H, H)
        keys[f"{p}{container}.gate.weight"] = meta(experts, H)
        for e in range(experts):
            keys[f"{p}{container}.experts.{e}.{g}.weight"] = meta(I, H)
            keys[f"{p}{container}.experts.{e}.{u}.weight"] = meta(I, H)
            keys[f"{p}{container}.experts.{e}.{d}.weight"] = meta(H, I)
    return keys


def check_no_key_twice_none_dropped(checkpoint, plan) -> None:
    counts = plan.reads()
    assert set(counts) <= set(checkpoint)
    assert all(n == 1 for n in counts.values()), f"matched twice: {[k for k, n in counts.items() if n > 1]}"
    outputs = plan.produced_keys()
    assert len(outputs) == len(set(outputs)) == len(plan.outputs)
    lines = plan.problem_lines()
    for key in set(checkpoint) - set(counts):
        layer = re.match(r"model\.layers\.\d+\.", key)
        named = key if layer is None else layer.group(0)
        assert any(named in line for line in lines), f"{key} silently dropped"


def transforms_for(style: str, fused_qkv: bool):
    return [
        *(SEED_QKV if fused_qkv else []),
        *get_checkpoint_conversion_mapping("mixtral" if style == "mixtral" else "qwen2_moe"),
    ]


styles = st.sampled_from(["qwen", "mixtral"])


@given(st.integers(1, 4), st.integers(1, 5), styles, st.booleans(), st.booleans())
@PROPERTY
def test_complete_key_sets_plan_cleanly(layers, experts, style, fused_qkv, bias):
    checkpoint = moe_checkpoint(layers, experts, style, bias)
    plan = plan_load(checkpoint, transforms_for(style, fused_qkv))
    assert not plan.problem_lines()
    check_no_key_twice_none_dropped(checkpoint, plan)
    assert set(plan.reads()) == set(checkpoint)  # every key feeds exactly one output
    for i in range(layers):
        assert plan.outputs[f"model.layers.{i}.mlp.experts.gate_up_proj"].shape == (experts, 2 * I, H)
        assert plan.outputs[f"model.layers.{i}.mlp.experts.down_proj"].shape == (experts, H, I)
        if fused_qkv:
            assert plan.outputs[f"model.layers.{i}.self_attn.qkv_proj.weight"].shape == (H + 2 * KV, H)
    assert not any(".experts.0." in k for k in plan.outputs)


@given(st.integers(1, 3), st.integers(1, 4), styles)
@PROPERTY
def test_plan_save_inverts_plan_load(layers, experts, style):
    checkpoint = moe_checkpoint(layers, experts, style)
    transforms = transforms_for(style, fused_qkv=False)
    loaded = plan_load(checkpoint, transforms)
    saved = plan_save(loaded.outputs, transforms)
    assert not saved.problem_lines()
    assert saved.outputs == checkpoint


junk_keys = st.lists(
    st.sampled_from(
        [
            "model.layers.0.mlp.experts.1.gate_proj.weight_scale",  # look-alike of a source pattern
            "model.layers.0.mlp.experts.gate_up_proj",  # already fused: a runtime key in the checkpoint
            "model.layers.1.mlp.experts.9.up_proj.weight",  # an index past the others
            "model.layers.0.block_sparse_moe.experts.0.w1.weight",
            "model.layers.1.self_attn.q_proj.lora_A.weight",
            "extra.unrelated.tensor",
            "model.layers.0.mlp.experts.0.down_proj.bias",
        ]
    ),
    max_size=4,
    unique=True,
)


@given(st.integers(1, 3), st.integers(1, 4), styles, st.booleans(), st.data(), junk_keys)
@PROPERTY
def test_random_damage_never_matches_twice_or_drops_silently(layers, experts, style, fused_qkv, data, junk):
    complete = moe_checkpoint(layers, experts, style)
    checkpoint = dict(complete)
    victims = data.draw(st.lists(st.sampled_from(sorted(checkpoint)), max_size=5, unique=True))
    for key in victims:
        del checkpoint[key]
    for key in junk:
        checkpoint[key] = meta(I, H)
    transforms = transforms_for(style, fused_qkv)
    plan = plan_load(checkpoint, transforms)
    check_no_key_twice_none_dropped(checkpoint, plan)
    # Whatever the planner does not report, the model-level check sees: an output that looks exactly like the
    # undamaged one (same key, same shape) is built from exactly the same checkpoint keys. So deleting, say, the
    # last expert everywhere changes the fused shapes (a shape mismatch for the loader), never fills them silently.
    full = plan_load(complete, transforms)
    full_sources, sources = full.sources_of(), plan.sources_of()
    for key, value in plan.outputs.items():
        if full.outputs.get(key) == value:
            assert sources[key] == full_sources[key], key


def test_groups_reverse_bit_for_bit():
    checkpoint = moe_checkpoint(2, 3, "mixtral")
    generator = torch.Generator().manual_seed(0)
    tensors = {
        k: torch.randint(
            0, 256, (m.shape[0] * (m.shape[1] if len(m.shape) > 1 else 1) * 2,), dtype=torch.uint8, generator=generator
        )
        .view(torch.bfloat16)
        .reshape(m.shape)
        for k, m in checkpoint.items()
    }
    checkpoint = {k: meta(*m.shape, dtype=torch.bfloat16) for k, m in checkpoint.items()}
    plan = plan_load(checkpoint, transforms_for("mixtral", fused_qkv=True))
    assert not plan.problem_lines()
    for group in plan.groups:
        outputs = group.run(tensors.__getitem__)
        assert {k: tuple(v.shape) for k, v in outputs.items()} == {k: m.shape for k, m in group.target_metas().items()}
        restored = group.reverse().run(outputs.__getitem__)
        assert sorted(restored) == sorted(group.source_keys())
        for key, value in restored.items():
            assert value.dtype == torch.bfloat16
            assert_tensor_bitwise_equal(value, tensors[key], key)


def test_the_deprecated_inversion_verbs_still_answer_and_warn():
    """``reverse()`` is the one verb (operations, renamings, groups); ``ConversionGroup.reversed()`` and
    ``WeightRenaming.inverse()``, public before, still give the same answer, with a DeprecationWarning."""
    plan = plan_load(moe_checkpoint(1, 2, "mixtral"), transforms_for("mixtral", fused_qkv=True))
    group = plan.groups[0]
    with pytest.warns(DeprecationWarning, match=r"reversed\(\) is deprecated; use \.reverse\(\)"):
        assert group.reversed() == group.reverse()
    renaming = WeightRenaming(r"\.feed_forward\.", ".mlp.")
    with pytest.warns(DeprecationWarning, match=r"WeightRenaming\.inverse\(\) is deprecated"):
        assert renaming.inverse() == renaming.reverse()


def test_grouped_query_sizes_are_bound_from_headers():
    checkpoint = moe_checkpoint(1, 1)
    plan = plan_load(checkpoint, SEED_QKV)
    weight_group = plan.group_producing("model.layers.0.self_attn.qkv_proj.weight")
    assert weight_group.target_keys() == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert plan.produced_keys().count("model.layers.0.self_attn.qkv_proj.weight") == 1
    assert weight_group.operations == (Concatenate(dim=0, sizes=(H, KV, KV)),)
    assert weight_group.sources == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    assert weight_group.reverse().target_shapes == ((H, H), (KV, H), (KV, H))


def test_plan_load_and_plan_save_translate_transformers_own_transforms():
    """``plan_load`` / ``plan_save`` are entry points too: a transformers transform handed to them is translated
    (through the border module), and plans as modelpatch's own."""
    from transformers import core_model_loading as hf

    checkpoint = {f"layers.0.{p}.weight": TensorMeta((4, 8), torch.float32) for p in ("q_proj", "k_proj", "v_proj")}
    stock = hf.WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [hf.Concatenate(dim=0)])
    own = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0, equal_parts=True)])
    loaded = plan_load(checkpoint, [stock])
    assert loaded.outputs == plan_load(checkpoint, [own]).outputs
    assert [g.converter for g in loaded.groups] == [own]
    assert plan_save(loaded.outputs, [stock]).outputs == plan_save(loaded.outputs, [own]).outputs
    with pytest.raises(TypeError, match="plan_load.*'q_proj'"):
        plan_load(checkpoint, ["q_proj"])


def test_first_matching_converter_wins():
    broad = WeightConverter(["proj"], ["proj_renamed"], [])
    narrow = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    checkpoint = moe_checkpoint(1, 1, bias=False)
    plan = plan_load(checkpoint, [narrow, broad])
    assert "model.layers.0.self_attn.qkv_proj.weight" in plan.outputs
    assert "model.layers.0.self_attn.o_proj_renamed.weight" in plan.outputs
    check_no_key_twice_none_dropped(checkpoint, plan)
    plan = plan_load(checkpoint, [broad, narrow])
    assert "model.layers.0.self_attn.qkv_proj.weight" not in plan.outputs
    check_no_key_twice_none_dropped(checkpoint, plan)


def test_incomplete_group_is_reported_with_its_keys():
    checkpoint = moe_checkpoint(1, 1, bias=False)
    del checkpoint["model.layers.0.self_attn.v_proj.weight"]
    plan = plan_load(checkpoint, SEED_QKV)
    (line,) = plan.problems["incomplete groups"]
    assert "model.layers.0.self_attn.q_proj.weight" in line and "v_proj" in line
    with pytest.raises(ConversionError, match="incomplete groups"):
        plan.raise_problems()


def test_non_contiguous_expert_indices_are_reported():
    checkpoint = moe_checkpoint(1, 3)
    for name in ("gate_proj", "up_proj", "down_proj"):
        del checkpoint[f"model.layers.0.mlp.experts.1.{name}.weight"]
    plan = plan_load(checkpoint, get_checkpoint_conversion_mapping("qwen2_moe"))
    assert any("[0, 2]" in line for line in plan.problems["conversion errors"])


def test_mixed_dtypes_in_one_group_are_reported():
    checkpoint = moe_checkpoint(1, 2)
    checkpoint["model.layers.0.mlp.experts.1.up_proj.weight"] = meta(I, H, dtype=torch.float16)
    plan = plan_load(checkpoint, get_checkpoint_conversion_mapping("qwen2_moe"))
    assert any("different dtypes" in line for line in plan.problems["conversion errors"])


def test_renaming_collisions_are_reported():
    checkpoint = {"visual.a": meta(2), "model.visual.a": meta(2), "model.layers.0.w": meta(2)}
    plan = plan_load(checkpoint, get_checkpoint_conversion_mapping("Qwen2VLForConditionalGeneration"))
    assert plan.problems["duplicate keys"] and "'model.visual.a'" in plan.problems["duplicate keys"][0]
    assert plan.direct == {"model.visual.a": "visual.a", "model.language_model.layers.0.w": "model.layers.0.w"} or (
        plan.direct == {"model.visual.a": "model.visual.a", "model.language_model.layers.0.w": "model.layers.0.w"}
    )


@given(
    st.lists(
        st.sampled_from(
            [
                "visual.blocks.0.w",
                "visual.merger.w",
                "model.layers.0.w",
                "model.norm.w",
                "model.embed_tokens.w",
                "lm_head.w",
            ]
        ),
        unique=True,
        min_size=1,
    ),
    st.booleans(),
)
@PROPERTY
def test_qwen2_vl_either_layout_maps_to_runtime_keys_and_back(keys, runtime):
    transforms = get_checkpoint_conversion_mapping("Qwen2VLForConditionalGeneration")
    legacy = {k: meta(2) for k in keys}
    to_runtime = {
        k: (
            k
            if k.startswith("lm_head")
            else "model." + (k if k.startswith("visual") else "language_model." + k[len("model.") :])
        )
        for k in keys
    }
    checkpoint = {to_runtime[k]: m for k, m in legacy.items()} if runtime else legacy
    plan = plan_load(checkpoint, transforms)
    assert not plan.problem_lines()
    assert set(plan.outputs) == set(to_runtime.values())
    assert plan_save(plan.outputs, transforms).outputs == legacy


def test_plan_save_of_an_unsized_concatenate_explains_how_to_fix_it():
    runtime = {"model.layers.0.self_attn.qkv_proj.weight": meta(16, H)}
    plan = plan_save(runtime, SEED_QKV)
    with pytest.raises(ConversionError, match="equal_parts=True"):
        plan.raise_problems()
    equal = [WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0, equal_parts=True)])]
    plan = plan_save({"model.layers.0.self_attn.qkv_proj.weight": meta(12, H)}, equal)
    assert plan.outputs == {f"model.layers.0.self_attn.{p}_proj.weight": meta(4, H) for p in "qkv"}


def test_plan_save_cannot_derive_keys_from_regex_sources():
    converter = WeightConverter(
        [r"experts\.*.w1", "experts.*.w3"], "experts.gate_up", [MergeModulelist(0), Concatenate(1)]
    )
    plan = plan_save({"m.experts.gate_up": meta(2, 8, 4)}, [converter])
    assert plan.problem_lines()


def test_planning_reads_no_data():
    """plan_load works on metadata alone: no tensor exists anywhere in this test."""
    plan = plan_load(moe_checkpoint(2, 2), get_checkpoint_conversion_mapping("qwen2_moe"))
    assert all(isinstance(m, TensorMeta) for m in plan.outputs.values())


def test_plan_queries_answer_from_the_plan_itself():
    """The queries tests ask of a plan: where each output comes from, how often each input is read, and its run."""
    checkpoint = {
        "a.q_proj.weight": meta(4, 2),
        "a.k_proj.weight": meta(2, 2),
        "a.v_proj.weight": meta(2, 2),
        "a.norm.weight": meta(2),
        "b.k_proj.weight": meta(2, 2),
    }  # b's q and v are missing
    plan = plan_load(checkpoint, SEED_QKV)
    fused = ("a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight")
    assert plan.sources_of() == {"a.norm.weight": ("a.norm.weight",), "a.qkv_proj.weight": fused}
    assert plan.reads() == dict.fromkeys([*fused, "a.norm.weight"], 1)  # b.k_proj is unread: a problem says so
    assert plan.produced_keys() == ["a.norm.weight", "a.qkv_proj.weight"]
    assert len(plan.problem_lines()) == 1 and "b." in plan.problem_lines()[0]
    assert plan.group_producing("a.qkv_proj.weight").source_keys() == list(fused)
    with pytest.raises(KeyError, match="a.norm.weight"):
        plan.group_producing("a.norm.weight")  # read unchanged: no group produces it
    generator = torch.Generator().manual_seed(0)
    tensors = {key: torch.randn(m.shape, generator=generator) for key, m in checkpoint.items()}
    outputs = plan.run(tensors.__getitem__)
    assert outputs.keys() == {"a.norm.weight", "a.qkv_proj.weight"}
    assert outputs["a.norm.weight"] is tensors["a.norm.weight"]
    assert_tensor_bitwise_equal(outputs["a.qkv_proj.weight"], torch.cat([tensors[key] for key in fused]))


def test_renaming_then_converter_records_checkpoint_names():
    checkpoint = moe_checkpoint(1, 2, "mixtral")
    plan = plan_load(checkpoint, get_checkpoint_conversion_mapping("mixtral"))
    group = plan.group_producing("model.layers.0.mlp.experts.gate_up_proj")
    assert group.target_keys() == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert group.sources == (
        tuple(f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(2)),
        tuple(f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight" for e in range(2)),
    )
    assert plan.direct["model.layers.0.mlp.gate.weight"] == "model.layers.0.block_sparse_moe.gate.weight"


def test_empty_checkpoint_plans_nothing():
    plan = plan_load({}, get_checkpoint_conversion_mapping("qwen2_moe") + [WeightRenaming("^a", "b")])
    assert not plan.direct and not plan.groups and not plan.problem_lines()


def test_alternative_converter_loads_its_layout_but_plan_save_keeps_the_targets():
    """An ``alternative`` converter reads another layout (3-D experts) into keys that already are a checkpoint layout
    (per-expert ones): plan_load converts what it finds, plan_save leaves the per-expert keys as they are."""
    split = [
        WeightConverter(
            r"experts\.gate_up_proj$",
            ["experts.*.gate_proj.weight", "experts.*.up_proj.weight"],
            [Chunk(dim=1), SplitModulelist(dim=0)],
            alternative=True,
        ),
        WeightConverter(
            r"experts\.down_proj$", "experts.*.down_proj.weight", [SplitModulelist(dim=0)], alternative=True
        ),
    ]
    fused = {"m.experts.gate_up_proj": meta(3, 2 * I, H), "m.experts.down_proj": meta(3, H, I)}
    per_expert = moe_checkpoint(1, 3)
    plan = plan_load(fused, split)
    assert not plan.problem_lines()
    assert plan.outputs == {
        **{f"m.experts.{e}.{p}_proj.weight": meta(I, H) for e in range(3) for p in ("gate", "up")},
        **{f"m.experts.{e}.down_proj.weight": meta(H, I) for e in range(3)},
    }
    assert [g.reverse().target_shapes for g in plan.groups] == [((3, 2 * I, H),), ((3, H, I),)]
    assert plan_load(per_expert, split).groups == []
    assert not plan_save(per_expert, split).groups and plan_save(per_expert, split).outputs == per_expert

    both = {**per_expert, "model.layers.0.mlp.experts.down_proj": meta(3, H, I)}
    duplicates = plan_load(both, split).problems["duplicate keys"]
    assert len(duplicates) == 3
    assert all("the conversion of ['model.layers.0.mlp.experts.down_proj']" in line for line in duplicates)


# --- optional source slots and dtype-changing operations (quantized checkpoints) ---------------------------------


def test_optional_sources_are_absent_slots_and_the_first_operation_sets_the_dtype():
    from modelpatch.conversion.operations import Fp8BlockDequantize

    patterns = [r"(?<![^.])weight$", r"(?<![^.])weight_scale_inv$"]
    converter = WeightConverter(
        patterns, "weight", [Fp8BlockDequantize(dtype=torch.bfloat16, companions=1)], optional=patterns[1:]
    )
    checkpoint = {
        "a.weight": meta(256, 128, dtype=torch.float8_e4m3fn),
        "a.weight_scale_inv": meta(2, 1),
        "norm.weight": meta(256, dtype=torch.bfloat16),
    }
    plan = plan_load(checkpoint, [converter])
    assert not plan.problem_lines()
    weight, norm = plan.group_producing("a.weight"), plan.group_producing("norm.weight")
    assert weight.dtype == torch.bfloat16 and weight.source_keys() == ["a.weight", "a.weight_scale_inv"]
    assert norm.sources == ("norm.weight", None) and norm.dtype == torch.bfloat16

    # A scale without its weight is an incomplete group; a weight that does not divide into its grid is named.
    broken = plan_load(
        {
            "a.weight_scale_inv": meta(2, 1),
            "b.weight": meta(201, 128, dtype=torch.float8_e4m3fn),
            "b.weight_scale_inv": meta(2, 1),
        },
        [converter],
    )
    assert (
        len(broken.problems["incomplete groups"]) == 1
        and "a.weight_scale_inv" in broken.problems["incomplete groups"][0]
    )
    assert "does not divide into the scale grid (2, 1)" in broken.problems["conversion errors"][0]


def test_optional_patterns_must_be_later_source_patterns():
    with pytest.raises(ConversionError, match="not source patterns after the first"):
        WeightConverter(["a", "b"], "c", optional=["a"])
