"""Conversion operations: binding, and reverse(forward(x)) == x bit for bit over random shapes and dtypes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelpatch import (
    Chunk,
    Concatenate,
    Conv3dToLinear,
    ConversionError,
    FuseExpertGroups,
    Interleave,
    LinearToConv3d,
    MergeModulelist,
    MergeRowGroups,
    PermuteForRope,
    Split,
    SplitExpertGroups,
    SplitModulelist,
    Transpose,
    Unpad,
    WithoutCompanions,
)
from modelpatch.conversion.operations import (
    bind_operations,
    reverse_operations,
    run_operations,
)
from support.compare import same_bits

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_tensor(shape, dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, subnormals, -0.0 included) of ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def same(a, b) -> bool:
    """Bitwise equality of two tensors, or of two lists of them (a slot of the operations)."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return same_bits(a, b)


def shape_of(slot):
    return [tuple(t.shape) for t in slot] if isinstance(slot, list) else tuple(slot.shape)


def roundtrip(operations, slots, num_targets: int):
    """Bind, run forward, run the exact reverse (as save does), and check shapes and bits come back."""
    shapes = [shape_of(s) for s in slots]
    bound, out_shapes = bind_operations(list(operations), shapes, num_targets)
    outputs = run_operations(bound, slots)
    assert [shape_of(o) for o in outputs] == out_shapes, "bound shapes predict the real output shapes"
    reverse = reverse_operations(bound)
    restored = run_operations(reverse, outputs)
    assert len(restored) == len(slots)
    for original, back in zip(slots, restored, strict=True):
        assert same(back, original)
    # Re-binding the reverse on the output shapes predicts the original shapes (what planning a save does).
    _, back_shapes = bind_operations(reverse, out_shapes, len(slots))
    assert back_shapes == shapes
    return bound, outputs


dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)
dims = st.integers(1, 5)


@st.composite
def concat_case(draw):
    rank = draw(st.integers(1, 4))
    dim = draw(st.integers(-rank, rank - 1))
    base = [draw(dims) for _ in range(rank)]
    sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    shapes = []
    for size in sizes:
        shape = list(base)
        shape[dim] = size
        shapes.append(tuple(shape))
    return dim, shapes


@given(concat_case(), dtypes, seeds)
@PROPERTY
def test_concatenate_reverses_to_the_original_unequal_parts(case, dtype, seed):
    dim, shapes = case
    parts = [random_tensor(s, dtype, seed + i) for i, s in enumerate(shapes)]
    bound, (fused,) = roundtrip([Concatenate(dim=dim)], parts, 1)
    assert bound[0].sizes == tuple(s[dim] for s in shapes)


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), dtypes, seeds, st.integers(1, 3))
@PROPERTY
def test_chunk_equal_parts_roundtrip(rank, parts, unit, dtype, seed, dim_choice):
    dim = dim_choice % rank
    shape = [3] * rank
    shape[dim] = parts * unit
    tensor = random_tensor(tuple(shape), dtype, seed)
    bound, outputs = roundtrip([Chunk(dim=dim)], [tensor], parts)
    assert len(outputs) == parts and bound[0].sizes == (unit,) * parts


@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), dtypes, seeds)
@PROPERTY
def test_chunk_with_sizes_roundtrip(sizes, dtype, seed):
    tensor = random_tensor((sum(sizes), 3), dtype, seed)
    roundtrip([Chunk(dim=0, sizes=tuple(sizes))], [tensor], len(sizes))


@given(st.integers(1, 5), st.integers(1, 3), st.integers(0, 3), dtypes, seeds, st.data())
@PROPERTY
def test_merge_modulelist_roundtrip(count, num_slots, rank, dtype, seed, data):
    dim = data.draw(st.integers(-(rank + 1), rank))
    shape = tuple(data.draw(dims) for _ in range(rank))
    slots = [[random_tensor(shape, dtype, seed + 10 * s + i) for i in range(count)] for s in range(num_slots)]
    bound, outputs = roundtrip([MergeModulelist(dim=dim)], slots, num_slots)
    assert bound[0].count == count
    assert all(o.shape[dim] == count for o in outputs)


@given(st.integers(1, 4), dtypes, seeds, st.data())
@PROPERTY
def test_split_modulelist_roundtrip(rank, dtype, seed, data):
    dim = data.draw(st.integers(-rank, rank - 1))
    shape = tuple(data.draw(dims) for _ in range(rank))
    roundtrip([SplitModulelist(dim=dim)], [random_tensor(shape, dtype, seed)], 1)


@given(st.integers(2, 5), dtypes, seeds, st.data())
@PROPERTY
def test_transpose_roundtrip(rank, dtype, seed, data):
    d0 = data.draw(st.integers(-rank, rank - 1))
    d1 = data.draw(st.integers(-rank, rank - 1))
    shape = tuple(data.draw(dims) for _ in range(rank))
    tensors = [random_tensor(shape, dtype, seed), [random_tensor(shape, dtype, seed + 1)]]  # tensor and list slots
    roundtrip([Transpose(d0, d1)], tensors, 2)


@given(st.tuples(dims, dims, dims, dims, dims), dtypes, seeds)
@PROPERTY
def test_conv3d_to_linear_roundtrip(shape, dtype, seed):
    kernel = random_tensor(shape, dtype, seed)
    bound, (linear,) = roundtrip([Conv3dToLinear()], [kernel], 1)
    assert linear.shape == (shape[0], shape[1] * shape[2] * shape[3] * shape[4])
    assert bound[0].kernel_shape == shape[1:]


@given(st.tuples(dims, dims, dims, dims), dims, dtypes, seeds)
@PROPERTY
def test_linear_to_conv3d_roundtrip(kernel_shape, out, dtype, seed):
    numel = kernel_shape[0] * kernel_shape[1] * kernel_shape[2] * kernel_shape[3]
    weight = random_tensor((out, numel), dtype, seed)
    roundtrip([LinearToConv3d(kernel_shape=kernel_shape)], [weight], 1)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), dtypes, seeds, st.booleans())
@PROPERTY
def test_moe_chain_roundtrip(experts, rows_gate, rows_up, cols, dtype, seed, transpose):
    """The built-in per-expert -> fused chain, with unequal gate/up rows, optionally transposed after."""
    gate = [random_tensor((rows_gate, cols), dtype, seed + i) for i in range(experts)]
    up = [random_tensor((rows_up, cols), dtype, seed + 100 + i) for i in range(experts)]
    ops = [MergeModulelist(dim=0), Concatenate(dim=1)] + ([Transpose(1, 2)] if transpose else [])
    _, (fused,) = roundtrip(ops, [gate, up], 1)
    expected = (experts, cols, rows_gate + rows_up) if transpose else (experts, rows_gate + rows_up, cols)
    assert tuple(fused.shape) == expected


# ------------------------------------------------------------- the operations of transformers' conversion mapping


def _stock(op, inputs: dict, sources: list[str], targets: list[str], **kwargs) -> dict:
    """transformers' own operation on the same tensors (what stock loading computes)."""
    return op.convert(dict(inputs), source_patterns=sources, target_patterns=targets, **kwargs)


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.booleans(), dtypes, seeds, st.data())
@PROPERTY
def test_interleave_roundtrip_and_matches_transformers(rank, half, other, inverse, dtype, seed, data):
    from transformers.core_model_loading import Interleave as StockInterleave

    dim = data.draw(st.integers(0, rank - 1))
    shape = [other] * rank
    shape[dim] = 2 * half
    tensor = random_tensor(tuple(shape), dtype, seed)
    _, (out,) = roundtrip([Interleave(dim=dim, inverse=inverse)], [tensor], 1)
    (stock,) = _stock(StockInterleave(dim, inverse), {"w": tensor}, ["w"], ["w"]).values()
    assert same(out, stock)


def test_interleave_rejects_an_odd_size():
    with pytest.raises(ConversionError, match="odd"):
        Interleave(dim=0).bind([(3, 2)], 1)


@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2]), st.booleans(), seeds)
@PROPERTY
def test_permute_for_rope_roundtrip_and_matches_transformers(heads, half, rank, inverse, seed):
    from transformers.core_model_loading import PermuteForRope as StockPermute

    class Config:
        num_attention_heads = heads

    shape = (heads * half * 2, 5)[:rank]
    q, k, v = (random_tensor(shape, torch.float32, seed + i) for i in range(3))
    op = PermuteForRope(inverse=inverse, slots=(0, 1)).configured(Config())
    assert op.num_heads == heads
    _, (pq, pk, pv) = roundtrip([op], [q, k, v], 3)
    stock = _stock(
        StockPermute(permute_layer_names=["q_proj", "k_proj"], inverse=inverse),
        {"q_proj": q, "k_proj": k, "v_proj": v},
        ["qkv"],
        ["q_proj", "k_proj", "v_proj"],
        config=Config(),
    )
    assert same(pq, stock["q_proj"]) and same(pk, stock["k_proj"]) and same(pv, v)


def test_permute_for_rope_reads_the_sub_config_and_needs_heads():
    class Vision:
        num_attention_heads = 3

    class Config:
        vision_config = Vision()
        num_attention_heads = 8

    assert PermuteForRope(subconfig_key="vision_config").configured(Config()).num_heads == 3
    with pytest.raises(ConversionError, match="heads"):
        PermuteForRope().bind([(4, 2)], 1)
    with pytest.raises(ConversionError, match="row pairs"):
        PermuteForRope(num_heads=2).bind([(6, 2)], 1)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), dtypes, seeds)
@PROPERTY
def test_split_sizes_come_from_the_targets(sizes, dtype, seed):
    tensor = random_tensor((sum(sizes), 3), dtype, seed)
    op = Split(dim=0).for_targets([(size, 3) for size in sizes])
    bound, _ = roundtrip([op], [tensor], len(sizes))
    assert bound[0].reverse() == Concatenate(dim=0, sizes=tuple(sizes), equal_parts=False)
    with pytest.raises(ConversionError, match="target parameters"):
        Split(dim=0).for_targets([None]).bind([(4, 3)], 1)


def test_transpose_with_check_dims_applies_only_when_the_layout_differs():
    tensor = random_tensor((2, 3, 4), torch.float32, 0)
    op = Transpose(1, 2, check_dims=True)
    bound, (out,) = roundtrip([op.for_targets([(2, 4, 3)])], [tensor], 1)
    assert bound[0].applied and out.shape == (2, 4, 3)
    bound, (out,) = roundtrip([op.for_targets([(2, 3, 4)])], [tensor], 1)
    assert not bound[0].applied and out is tensor
    # With nothing to compare (saving a never-loaded model) it does nothing, as transformers' reverse.
    assert op.reverse().bind([(2, 3, 4)], 1) == (Transpose(2, 1, check_dims=True, applied=False), [(2, 3, 4)])


@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), dtypes, seeds)
@PROPERTY
def test_expert_groups_roundtrip_and_match_transformers(experts, targets, sources, rows, dtype, seed):
    from transformers.core_model_loading import ErnieFuseAndSplitTextVisionExperts

    if -(-experts // targets) * (targets - 1) >= experts:
        return  # transformers' best-effort split would leave a group empty; ours refuses it (below)
    slots = [[random_tensor((rows + s, 2), dtype, seed + 10 * s + e) for e in range(experts)] for s in range(sources)]
    bound, outputs = roundtrip([FuseExpertGroups(stack_dim=0, concat_dim=1)], slots, targets)
    assert isinstance(bound[0].reverse(), SplitExpertGroups)
    names, target_names = [f"s{i}" for i in range(sources)], [f"t{i}" for i in range(targets)]
    stock = _stock(
        ErnieFuseAndSplitTextVisionExperts(0, 1), dict(zip(names, slots, strict=True)), names, target_names, config=None
    )
    assert all(same(out, stock[name]) for out, name in zip(outputs, target_names, strict=True))


def test_expert_groups_refuse_empty_groups():
    with pytest.raises(ConversionError, match="groups"):
        FuseExpertGroups().bind([[(2, 2)] * 2], 3)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), dtypes, seeds)
@PROPERTY
def test_concatenate_of_an_indexed_slot_splits_back_into_it(sizes, dtype, seed):
    shards = [random_tensor((size, 2), dtype, seed + i) for i, size in enumerate(sizes)]
    bound, (joined,) = roundtrip([Concatenate(dim=0)], [shards], 1)
    assert bound[0].indexed and joined.shape == (sum(sizes), 2)


def test_parts_of_an_indexed_slot_come_from_the_config():
    class Text:
        split_ngram_parts = 3

    class Config:
        def get_text_config(self):
            return Text()

    declared = Concatenate(dim=0, equal_parts=True, indexed=True, parts_attribute="split_ngram_parts")
    reverse = declared.configured(Config()).reverse()  # a never-loaded model: equal parts, as many as configured
    assert reverse == Chunk(dim=0, equal_parts=True, indexed=True, parts=3, parts_attribute="split_ngram_parts")
    assert reverse.bind([(6, 2)], 1)[1] == [[(2, 2)] * 3]
    with pytest.raises(ConversionError, match="split_ngram_parts"):
        declared.configured(object())


@given(st.integers(1, 5), st.integers(0, 4), st.integers(1, 3), st.sampled_from(DTYPES[:4]), seeds)
@PROPERTY
def test_unpad_roundtrip_and_matches_transformers(kept, padding, columns, dtype, seed):
    """Dropping a zero padding and restoring it is exact; both directions compute what transformers' op does."""
    stock_op = getattr(pytest.importorskip("transformers.core_model_loading"), "Inkling2UnpadVocab", None)
    if stock_op is None:
        pytest.skip("this transformers has no Inkling2UnpadVocab (5.24 added it)")
    from transformers import Inkling2TextConfig

    config = Inkling2TextConfig(vocab_size=kept + padding, unpadded_vocab_size=kept)
    padded = torch.cat([random_tensor((kept, columns), dtype, seed), torch.zeros(padding, columns, dtype=dtype)])
    declared = Unpad(size_attribute="unpadded_vocab_size", padded_size_attribute="vocab_size").configured(config)
    assert (declared.size, declared.padded_size) == (kept, kept + padding)
    _, (unpadded,) = roundtrip([declared], [padded], 1)
    # transformers casts to the dtype of the parameter it fills: a real module's, of the same dtype here.
    model = torch.nn.Linear(columns, kept, bias=False, dtype=dtype)
    loaded = _stock(stock_op(), {"w": padded}, ["w"], ["w"], config=config, model=model, full_layer_name="weight")
    assert same(unpadded, loaded["w"])
    saved = _stock(stock_op(inverse=True), {"w": unpadded}, ["w"], ["w"], config=config)
    assert same(padded, saved["w"])


def test_unpad_records_the_checkpoint_size_and_refuses_what_it_cannot_do():
    bound, (shape,) = Unpad(dim=1, size=3).bind([(2, 5)], 1)
    assert shape == (2, 3) and bound.reverse() == Unpad(dim=1, size=3, padded_size=5, inverse=True)
    with pytest.raises(ConversionError, match="cannot keep 6"):
        Unpad(size=6).bind([(5, 2)], 1)
    with pytest.raises(ConversionError, match="cannot pad"):
        Unpad(padded_size=4, inverse=True).bind([(5, 2)], 1)
    with pytest.raises(ConversionError, match="unpadded_vocab_size"):
        Unpad(size_attribute="unpadded_vocab_size").configured(object())


def test_grouped_query_concatenate_reverses_to_128_64_64():
    """The transformers defect: an equal Chunk would give 86/86/84 rows."""
    q, k, v = torch.randn(128, 32), torch.randn(64, 32), torch.randn(64, 32)
    bound, _ = bind_operations([Concatenate(dim=0)], [(128, 32), (64, 32), (64, 32)], 1)
    reverse = bound[0].reverse()
    assert reverse == Chunk(dim=0, sizes=(128, 64, 64))
    parts = reverse.apply([torch.cat([q, k, v])])
    assert [p.shape[0] for p in parts] == [128, 64, 64]
    assert all(torch.equal(a, b) for a, b in zip(parts, (q, k, v), strict=True))


def test_operations_are_declared_without_sizes_and_bound_immutably():
    declared = Concatenate(dim=0)
    bound, _ = bind_operations([declared], [(2, 3), (4, 3)], 1)
    assert declared.sizes is None and bound[0].sizes == (2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        declared.dim = 1


# ------------------------------------------------------------------------------------------------- bind errors


@pytest.mark.parametrize(
    ("operation", "shapes", "num_targets", "message"),
    [
        (Concatenate(dim=0), [(2, 3), (2, 4)], 1, "cannot concatenate"),
        (Concatenate(dim=0), [(2, 3), (2, 3, 1)], 1, "cannot concatenate"),
        (Concatenate(dim=2), [(2, 3), (2, 3)], 1, "out of range"),
        (Concatenate(dim=0), [], 1, "no tensors"),
        (Concatenate(dim=0), [[(2, 3)], [(2, 3)]], 1, "MergeModulelist"),
        (Chunk(dim=0), [(7, 3)], 2, "equal parts"),
        (Chunk(dim=0), [(4, 3)], 0, "equal parts"),
        (Chunk(dim=0, sizes=(2, 3)), [(4, 3)], 2, "add up"),
        (Chunk(dim=0), [(4, 3), (4, 3)], 2, "exactly one"),
        (Chunk(dim=-3), [(4, 3)], 2, "out of range"),
        (MergeModulelist(dim=0), [(2, 3)], 1, "indexed"),
        (MergeModulelist(dim=0), [[(2, 3), (2, 4)]], 1, "cannot stack"),
        (MergeModulelist(dim=0), [[]], 1, "cannot stack"),
        (MergeModulelist(dim=0), [[(2, 3)] * 3, [(2, 3)] * 2], 2, "different numbers"),
        (MergeModulelist(dim=3), [[(2, 3)]], 1, "out of range"),
        (SplitModulelist(dim=0, count=3), [(4, 3)], 1, "expected 3"),
        (SplitModulelist(dim=0), [[(4, 3)]], 1, "MergeModulelist"),
        (Transpose(0, 2), [(4, 3)], 1, "out of range"),
        (Conv3dToLinear(), [(4, 3, 2, 2)], 1, "5-D"),
        (Conv3dToLinear(kernel_shape=(3, 2, 2, 2)), [(4, 3, 2, 2, 1)], 1, "differs"),
        (LinearToConv3d(kernel_shape=(3, 2, 2, 2)), [(4, 25)], 1, "cannot reshape"),
        (LinearToConv3d(kernel_shape=(3, 2)), [(4, 6)], 1, "cannot reshape"),
        (LinearToConv3d(kernel_shape=(3, 2, 2, 2)), [(4, 3, 8)], 1, "cannot reshape"),
    ],
)
def test_bind_rejects_incompatible_shapes(operation, shapes, num_targets, message):
    with pytest.raises(ConversionError, match=message):
        operation.bind(shapes, num_targets)


def test_unbound_concatenate_cannot_be_reversed_without_equal_parts():
    with pytest.raises(ConversionError, match="equal_parts=True"):
        Concatenate(dim=0).reverse()
    assert Concatenate(dim=1, equal_parts=True).reverse() == Chunk(dim=1, equal_parts=True)
    assert Concatenate(dim=0, sizes=(3, 1)).reverse() == Chunk(dim=0, sizes=(3, 1))


def test_unbound_conv3d_cannot_be_reversed():
    with pytest.raises(ConversionError, match="bound"):
        Conv3dToLinear().reverse()


def test_declared_reverses_of_size_free_operations():
    assert Transpose(0, 2).reverse() == Transpose(0, 2)
    assert MergeModulelist(dim=1).reverse() == SplitModulelist(dim=1)
    assert SplitModulelist(dim=1).reverse() == MergeModulelist(dim=1)
    assert Chunk(dim=0).reverse() == Concatenate(dim=0, equal_parts=True)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), dtypes, seeds, st.data())
@PROPERTY
def test_fused_merge_concatenate_equals_stack_then_cat(experts, num_slots, rank, dtype, seed, data):
    """run_operations writes Merge+Concatenate straight into the output; the result is exactly stack-then-cat."""
    merge_dim = data.draw(st.integers(-(rank + 1), rank))
    cat_dim = data.draw(st.integers(-(rank + 1), rank))
    base = [data.draw(dims) for _ in range(rank)]
    cat_axis = cat_dim % (rank + 1)
    merge_axis = merge_dim % (rank + 1)
    slots = []
    for s in range(num_slots):
        shape = list(base)
        if cat_axis != merge_axis:  # parts may differ along the concatenation axis (in the unstacked shape)
            axis = cat_axis if cat_axis < merge_axis else cat_axis - 1
            shape[axis] = data.draw(dims)
        slots.append([random_tensor(tuple(shape), dtype, seed + 10 * s + e) for e in range(experts)])
    ops = [MergeModulelist(dim=merge_dim), Concatenate(dim=cat_dim)]
    bound, _ = bind_operations(ops, [shape_of(s) for s in slots], 1)
    (fused,) = run_operations(bound, slots)
    slow = slots
    for op in bound:
        slow = op.apply(slow)
    assert same(fused, slow[0])


def test_fused_merge_concatenate_rejects_mismatched_tensors():
    merge, concatenate = MergeModulelist(dim=0, count=2), Concatenate(dim=1, sizes=(2, 2))
    with pytest.raises(ConversionError, match="cannot stack"):
        run_operations([merge, concatenate], [[torch.zeros(2, 3), torch.zeros(2, 4)], [torch.zeros(2, 3)] * 2])
    with pytest.raises(ConversionError, match="cannot stack"):
        run_operations(
            [merge, concatenate], [[torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)], [torch.zeros(2, 3)] * 2]
        )


# --- quantizer operations: exact forward, no reverse ---------------------------------------------------------------


def test_fp8_block_dequantize_multiplies_each_block_by_its_scale_and_has_no_reverse():
    from modelpatch.conversion.operations import Fp8BlockDequantize

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(4, 6, generator=generator) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=generator)  # blocks of 2 x 2
    experts = [weight, weight.flip(0)]
    op = Fp8BlockDequantize(dtype=torch.bfloat16, companions=2)
    bound, shapes = bind_operations([op], [(4, 6), (2, 3), None, [(4, 6)] * 2, [(2, 3)] * 2, None], 2)
    assert shapes == [(4, 6), [(4, 6)] * 2]
    single, stacked = run_operations(bound, [weight, scale, None, experts, [scale, scale], None])
    expected = (weight.float() * scale.repeat_interleave(2, 0).repeat_interleave(2, 1)).to(torch.bfloat16)
    assert torch.equal(single, expected) and torch.equal(stacked[0], expected)
    assert bound[0].output_dtype([torch.float8_e4m3fn, torch.float32, None] * 2) == torch.bfloat16
    with pytest.raises(ConversionError, match="no exact reverse"):
        bound[0].reverse()
    with pytest.raises(ConversionError, match="not float8"):
        bound[0].output_dtype([torch.int8, torch.float32, None])


@given(st.integers(1, 4), st.integers(1, 4), st.sampled_from(DTYPES[:4]), seeds)
@PROPERTY
def test_merge_row_groups_roundtrip_and_matches_transformers(layers, hidden, dtype, seed):
    """Both directions compute what transformers' ``Inkling2LoopMergeMessageQueries`` does, and reverse exactly."""
    stock_op = getattr(pytest.importorskip("transformers.core_model_loading"), "Inkling2LoopMergeMessageQueries", None)
    if stock_op is None:
        pytest.skip("this transformers has no Inkling2LoopMergeMessageQueries (5.24 added it)")
    queries = random_tensor((2 * layers, hidden), dtype, seed)
    kv_queries = random_tensor((2 * layers, hidden), dtype, seed + 1)
    _, (merged,) = roundtrip([MergeRowGroups((2, 2), (0, 2, 3, 1))], [queries, kv_queries], 1)
    assert merged.shape == (layers, 4, hidden)
    (stock,) = _stock(stock_op(), {"q": queries, "kv": kv_queries}, ["q", "kv"], ["m"]).values()
    assert same(merged, stock)
    back = _stock(stock_op(inverse=True), {"m": merged}, ["m"], ["q", "kv"])
    assert same(back["q"], queries) and same(back["kv"], kv_queries)


def test_merge_row_groups_refuses_what_does_not_fit():
    with pytest.raises(ConversionError, match="permutation"):
        MergeRowGroups((2, 2), (0, 1, 2, 2))
    with pytest.raises(ConversionError, match="row groups"):
        MergeRowGroups((2, 2), (0, 2, 3, 1)).bind([(4, 3), (6, 3)], 1)
    with pytest.raises(ConversionError, match="row groups"):
        MergeRowGroups((2, 2), (0, 2, 3, 1)).bind([(3, 3), (3, 3)], 1)
    with pytest.raises(ConversionError, match="one tensor of shape"):
        MergeRowGroups((2, 2), (0, 2, 3, 1), inverse=True).bind([(2, 3, 5)], 1)


def test_without_companions_passes_a_lone_weight_and_refuses_its_scales():
    op = WithoutCompanions(companions=2, format="FP4 scale")
    weight = random_tensor((3, 4), torch.bfloat16, 0)
    bound, shapes = op.bind([(3, 4), None, None], 1)
    assert shapes == [(3, 4)] and bound.output_dtype([torch.bfloat16, None, None]) == torch.bfloat16
    (out,) = bound.apply([weight, None, None])
    assert out is weight
    reverse = bound.reverse()
    assert reverse.bind([(3, 4)], 3)[1] == [(3, 4), None, None]
    back = reverse.apply([out])
    assert back[0] is weight and back[1:] == [None, None]
    with pytest.raises(ConversionError, match="FP4 scale data beside the weight"):
        op.bind([(3, 4), (3, 1), None], 1)
    stock_op = getattr(pytest.importorskip("transformers.core_model_loading"), "Inkling2LoopDequantizeExperts", None)
    if stock_op is not None:  # transformers' op on a lone weight: the weight
        (stock,) = _stock(stock_op(), {"w": weight}, ["w", "s", "a", "d"], ["t"]).values()
        assert same(stock, weight)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: MergeRowGroups((), ()), ConversionError, "sizes must not be empty"),
        (
            lambda: MergeRowGroups([2, 2], (0, 2, 3, 1)),
            TypeError,
            r"sizes must be a tuple of ints, got \[2, 2\] \(list\)",
        ),
        (lambda: MergeRowGroups((2, 2), [0, 2, 3, 1]), TypeError, r"order must be a tuple of ints, got \[0, 2, 3, 1\]"),
        (lambda: MergeRowGroups((2, 2), (0.0, 2, 3, 1)), TypeError, r"order .* \(0\.0 is a float\)"),
        (
            lambda: MergeRowGroups((2, 0), (0, 1)),
            ConversionError,
            r"every entry of sizes must be at least 1, got \(2, 0\)",
        ),
        (lambda: MergeRowGroups((True, 1), (0, 1)), TypeError, r"sizes .* \(True is a bool\)"),
        (lambda: MergeRowGroups((2, 2), (0, 2, 3, 1), inverse=1), TypeError, "inverse must be a bool, got 1"),
        (lambda: WithoutCompanions(companions=-1), ConversionError, "companions must be at least 0, got -1"),
        (lambda: WithoutCompanions(companions=2.0), TypeError, r"companions must be an int, got 2\.0 \(float\)"),
        (lambda: WithoutCompanions(format=None), TypeError, "format must be a str, got None"),
    ],
)
def test_merge_row_groups_and_without_companions_refuse_bad_arguments_when_built(build, error, message):
    """They were accepted: empty sizes merged nothing, lists broke hash() of the frozen operation later, a float
    order failed as an index when a checkpoint was converted, and companions=-1 took no weight at all."""
    with pytest.raises(error, match=rf"^(MergeRowGroups|WithoutCompanions): {message}"):
        build()
