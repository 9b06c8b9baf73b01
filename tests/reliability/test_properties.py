"""Property tests of key matching and reversibility that tests/conversion does not already cover.

tests/conversion checks each operation's ``reverse(forward(x)) == x`` over random shapes and dtypes, and
``plan_load`` / ``plan_save`` over random MoE key sets with the built-in mappings. Here:

* random *synthetic* architectures (random module names, layer and expert counts, part sizes, dtypes, an optional
  legacy prefix renamed away) with random converter sets: a complete key set plans with every key consumed exactly
  once, gives exactly the runtime keys and shapes an independent oracle predicts, runs forward to the oracle's
  values, runs back bit for bit (what ``save_pretrained`` does), and ``plan_save`` of the runtime keys gives back
  the original key set;
* damaged key sets (deletions, look-alike and runtime-layout junk keys, shadowing converters that compete for the
  same keys): no key is ever matched twice, none is dropped without a problem naming it or its group, and an
  output that looks undamaged is built from exactly the undamaged sources;
* the real fusion converters (``qkv``, ``gate_up``) over random grouped-query Llama shapes: ``plan_load`` of the stock
  layout gives exactly the fused model's parameters, and ``plan_save`` gives back exactly the stock layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from modelpatch import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
from modelpatch.conversion import TensorMeta, plan_load, plan_save
from modelpatch.fusions.apply import prepare_fusions, resolve_fusion_config
from modelpatch.loading.build import build_empty_model
from support.compare import same_bits

pytestmark = pytest.mark.reliability

PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKENS = ("query", "key", "value", "gate", "up", "left", "right", "down")
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
)


# ------------------------------------------------------------------------------------------- synthetic architectures


@dataclass(frozen=True)
class Family:
    """One group of checkpoint tensors per layer fused into one runtime tensor."""

    number: int
    # "concat": parts -> cat(dim 0); "experts": per-expert -> stack; "experts_concat": two stacks -> cat(dim 1)
    kind: str
    tokens: tuple[str, ...]
    rows: tuple[int, ...]
    experts: int
    equal: bool  # Concatenate(equal_parts=True): plan_save can split it without a recorded load

    def converter(self) -> WeightConverter:
        if self.kind == "concat":
            return WeightConverter(
                [f".{t}." for t in self.tokens], f".fused{self.number}.", [Concatenate(dim=0, equal_parts=self.equal)]
            )
        sources = [f"experts.*.{t}.weight" for t in self.tokens]
        operations = [MergeModulelist(dim=0)]
        if self.kind == "experts_concat":
            operations.append(Concatenate(dim=1, equal_parts=True))
        return WeightConverter(sources, f"experts.fused{self.number}", operations)


@dataclass(frozen=True)
class Architecture:
    layers: int
    cols: int
    legacy: bool  # checkpoint keys under "legacy." that a WeightRenaming moves to "model."
    dtype: torch.dtype
    families: tuple[Family, ...]

    @property
    def root(self) -> str:
        return "legacy." if self.legacy else "model."

    def transforms(self):
        renaming = [WeightRenaming(r"^legacy\.", "model.")] if self.legacy else []
        return [*renaming, *(f.converter() for f in self.families)]

    def checkpoint(self) -> dict[str, TensorMeta]:
        keys = {f"{self.root}embed.weight": TensorMeta((5, self.cols), self.dtype)}
        for i in range(self.layers):
            layer = f"{self.root}layers.{i}."
            keys[layer + "norm.weight"] = TensorMeta((self.cols,), self.dtype)
            for f in self.families:
                for t, rows in zip(f.tokens, f.rows, strict=True):
                    if f.kind == "concat":
                        keys[f"{layer}blk.{t}.weight"] = TensorMeta((rows, self.cols), self.dtype)
                    else:
                        for e in range(f.experts):
                            keys[f"{layer}blk.experts.{e}.{t}.weight"] = TensorMeta((rows, self.cols), self.dtype)
        return keys

    def runtime(self) -> dict[str, TensorMeta]:
        """The oracle: runtime keys and shapes, derived without the planner."""
        keys = {"model.embed.weight": TensorMeta((5, self.cols), self.dtype)}
        for i in range(self.layers):
            layer = f"model.layers.{i}."
            keys[layer + "norm.weight"] = TensorMeta((self.cols,), self.dtype)
            for f in self.families:
                if f.kind == "concat":
                    keys[f"{layer}blk.fused{f.number}.weight"] = TensorMeta((sum(f.rows), self.cols), self.dtype)
                else:
                    keys[f"{layer}blk.experts.fused{f.number}"] = TensorMeta(
                        (f.experts, sum(f.rows), self.cols), self.dtype
                    )
        return keys

    def forward_oracle(self, ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The runtime tensors, computed with plain torch from the checkpoint tensors."""
        out = {"model.embed.weight": ckpt[f"{self.root}embed.weight"]}
        for i in range(self.layers):
            layer, src = f"model.layers.{i}.", f"{self.root}layers.{i}."
            out[layer + "norm.weight"] = ckpt[src + "norm.weight"]
            for f in self.families:
                if f.kind == "concat":
                    parts = [ckpt[f"{src}blk.{t}.weight"] for t in f.tokens]
                    out[f"{layer}blk.fused{f.number}.weight"] = torch.cat(parts)
                else:
                    stacks = [
                        torch.stack([ckpt[f"{src}blk.experts.{e}.{t}.weight"] for e in range(f.experts)])
                        for t in f.tokens
                    ]
                    out[f"{layer}blk.experts.fused{f.number}"] = torch.cat(stacks, dim=1)
        return out


@st.composite
def architectures(draw) -> Architecture:
    tokens = list(draw(st.permutations(TOKENS)))
    families = []
    for number in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["concat", "experts", "experts_concat"]))
        count = {"concat": draw(st.integers(2, 3)), "experts": 1, "experts_concat": 2}[kind]
        if len(tokens) < count:
            break
        picked = tuple(tokens.pop() for _ in range(count))
        equal = kind != "concat" or draw(st.booleans())
        rows = (draw(st.integers(1, 4)),) * count if equal else tuple(draw(st.integers(1, 4)) for _ in range(count))
        experts = draw(st.integers(1, 4)) if kind != "concat" else 0
        families.append(Family(number, kind, picked, rows, experts, equal))
    return Architecture(
        layers=draw(st.integers(1, 3)),
        cols=draw(st.integers(1, 4)),
        legacy=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        families=tuple(families),
    )


def random_tensor(meta: TensorMeta, generator: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, -0.0 included)."""
    shape = meta.shape
    if meta.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * meta.dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(meta.dtype).reshape(shape)


@given(architectures(), st.integers(0, 2**31 - 1))
@PROPERTY
def test_complete_key_sets_match_the_oracle_and_round_trip_bit_for_bit(arch, seed):
    checkpoint, transforms = arch.checkpoint(), arch.transforms()
    plan = plan_load(checkpoint, transforms)
    assert not plan.problem_lines()
    counts = plan.reads()
    assert set(counts) == set(checkpoint) and set(counts.values()) == {1}, "a key unused or used twice"
    assert plan.outputs == arch.runtime()

    # Forward on real tensors gives the oracle's values; the recorded groups run backwards give the checkpoint back.
    generator = torch.Generator().manual_seed(seed)
    tensors = {key: random_tensor(meta, generator) for key, meta in checkpoint.items()}
    runtime = plan.run(tensors.__getitem__)
    oracle = arch.forward_oracle(tensors)
    assert runtime.keys() == oracle.keys()
    assert all(same_bits(runtime[k], oracle[k]) for k in oracle), "forward differs from plain torch"
    back = {src: runtime[out] for out, src in plan.direct.items()}
    for group in plan.groups:
        back.update(group.reverse().run(runtime.__getitem__))
    assert back.keys() == tensors.keys()
    assert all(same_bits(back[k], tensors[k]) for k in tensors), "reverse(forward(x)) != x"

    # Without a recorded load (a from_config model), plan_save maps the runtime keys back by the transforms alone.
    saved = plan_save(plan.outputs, transforms)
    if all(f.equal for f in arch.families):
        assert not saved.problem_lines()
        assert saved.outputs == checkpoint
    else:
        # Unequal parts cannot be split without the sizes recorded at load: reported, never guessed.
        assert saved.problem_lines()


JUNK = [
    "model.layers.0.blk.experts.9.{t}.weight",  # an expert index past the others
    "{root}layers.0.blk.{t}.bias",  # a look-alike of a concat source
    "model.layers.0.blk.fused0.weight",  # a runtime-layout key inside the checkpoint
    "{root}layers.0.blk.experts.0.{t}.weight_scale",  # a look-alike of an expert source
    "unrelated.tensor",
    "legacy.embed.weight",  # collides with model.embed.weight once renamed
]


def group_of(key: str, arch: Architecture) -> tuple[str, int] | None:
    """(layer, family) of a family key, by the naming scheme above: the keys that feed one converter group."""
    match = re.search(r"layers\.(\d+)\.blk\.(?:experts\.\d+\.)?(\w+)\.", key)
    family = next((f.number for f in arch.families if match and match.group(2) in f.tokens), None)
    return (match.group(1), family) if family is not None else None


@given(architectures(), st.data())
@PROPERTY
def test_damaged_key_sets_never_match_twice_or_drop_silently(arch, data):
    complete = arch.checkpoint()
    checkpoint = dict(complete)
    for key in data.draw(st.lists(st.sampled_from(sorted(checkpoint)), max_size=4, unique=True)):
        del checkpoint[key]
    tokens = [t for f in arch.families for t in f.tokens]
    for template in data.draw(st.lists(st.sampled_from(JUNK), max_size=3, unique=True)):
        checkpoint[template.format(root=arch.root, t=data.draw(st.sampled_from(tokens)))] = TensorMeta(
            (1, arch.cols), arch.dtype
        )
    transforms = arch.transforms()
    # Shadowing converters compete for the same keys as the real ones (built from random tokens of theirs).
    for n in range(data.draw(st.integers(0, 2))):
        shadow = tuple(data.draw(st.lists(st.sampled_from(tokens), min_size=1, max_size=2, unique=True)))
        converter = WeightConverter([f".{t}." for t in shadow], f".shadow{n}.", [Concatenate(dim=0)])
        transforms.insert(data.draw(st.integers(0, len(transforms))), converter)

    plan = plan_load(checkpoint, transforms)
    counts = plan.reads()
    assert set(counts) <= set(checkpoint)
    assert all(n == 1 for n in counts.values()), f"matched twice: {[k for k, n in counts.items() if n > 1]}"
    outputs = plan.produced_keys()
    assert len(outputs) == len(set(outputs)) == len(plan.outputs), "two inputs produce one output"
    lines = plan.problem_lines()
    for key in set(checkpoint) - set(counts):
        group = group_of(key, arch)
        siblings = {k for k in checkpoint if group is not None and group_of(k, arch) == group} | {key}
        # Problems of converted groups currently name keys after renaming (see test_hostile_checkpoints'
        # test_plan_errors_name_the_checkpoints_own_keys); either name counts as reported here.
        names = siblings | {re.sub(r"^legacy\.", "model.", k) for k in siblings}
        assert any(name in line for name in names for line in lines), f"{key} dropped silently"

    # An output that looks undamaged (same key, same meta) is built from exactly the undamaged sources.
    full = plan_load(complete, arch.transforms())
    full_sources, damaged_sources = full.sources_of(), plan.sources_of()
    for key, meta in plan.outputs.items():
        if full.outputs.get(key) == meta:
            assert damaged_sources[key] == full_sources[key], key


# ----------------------------------------------------------------------------------- the real fusion converters


@st.composite
def llama_configs(draw) -> tuple[LlamaConfig, dict[str, bool]]:
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=heads * draw(st.sampled_from([2, 4])),  # transformers wants a multiple of the heads
        intermediate_size=draw(st.integers(4, 24)),
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=draw(st.sampled_from([2, 4, 6])),
        attention_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        tie_word_embeddings=False,
    )
    fusions = draw(st.sampled_from([{"qkv": True}, {"gate_up": True}, {"qkv": True, "gate_up": True}]))
    return config, fusions


def metas(model) -> dict[str, TensorMeta]:
    return {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


@given(llama_configs())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fusion_converters_map_random_llama_shapes_exactly_and_back(case):
    config, fusion_config = case
    unfused = build_empty_model(LlamaForCausalLM, config, torch.float32, [])
    fusions = prepare_fusions(unfused, config, resolve_fusion_config(config, fusion_config), [])
    stock = metas(unfused)
    fused = metas(build_empty_model(LlamaForCausalLM, config, torch.float32, [fusions.mapping]))
    assert fused != stock
    transforms = fusions.adjust_conversions([])
    plan = plan_load(stock, transforms)
    assert not plan.problem_lines()
    counts = plan.reads()
    assert set(counts) == set(stock) and set(counts.values()) == {1}
    assert plan.outputs == fused
    saved = plan_save(fused, transforms)
    assert not saved.problem_lines()
    assert saved.outputs == stock
