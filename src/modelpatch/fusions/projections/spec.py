"""The ``qkv`` and ``gate_up`` fusions: sibling Linear layers that read the same input become one
:class:`~.modules.FusedLinear` (the two families differ only in which children they fuse; both build the modules of
:mod:`.modules`).

* ``qkv``: ``q_proj``/``k_proj``/``v_proj`` (BERT's ``query``/``key``/``value``, T5's ``q``/``k``/``v``) -> one
  ``qkv_proj`` (``qkv``) Linear. Sized from the actual projections, so grouped-query attention (fewer key/value heads)
  fuses correctly. The attention's own forward runs unchanged, each projection's name calling its rows of the fused
  Linear, so a cross-attention whose key/value read another input of the same size computes what stock computes too.
* ``gate_up``: ``gate_proj``/``up_proj`` of gated MLPs (Llama, Mistral, Qwen2, Qwen2Moe's shared expert) -> one
  ``gate_up_proj`` Linear; also the other names of the two input projections of a gated MLP: ``w1``/``w3`` ->
  ``w13``, T5's gated ``wi_0``/``wi_1`` -> ``wi``. The MLP's own forward runs unchanged (each name calls its rows).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import cast

from torch import nn
from transformers import PretrainedConfig

from ...conversion.operations import Concatenate
from ...conversion.transforms import WeightConverter, WeightTransform
from ...errors import TensorParallelError
from ..generated import make_class
from ..hooks import hooked
from ..sharding import FusedParts, TensorParallelLayout, TensorParallelShard
from ..spec import ModuleFusionSpec, ModulesToFuse
from .modules import FusedLinear, ProjectionSlice, fuse_linears
from .smoothing import fold_smoothing_mappings

# Attributes a module's forward may read from a projection (what a slice provides besides being called).
_SLICE_ATTRIBUTES = ("weight", "bias", "in_features", "out_features")

# Modules that transformers rebuilds at run time, outside any load: a fused module there would be replaced by a
# stock one (with other state keys) at the first forward that rebuilds it. ``module.qualname`` -> why.
REBUILT_AT_RUN_TIME = {
    f"transformers.models.{model}.modeling_{model}.{prefix}{kind}": (
        f"{prefix}Attention.set_attention_type rebuilds its self-attention at run time (at the first forward on a "
        "sequence too short for block-sparse attention), which would drop the fused projection"
    )
    for model, prefix in (("big_bird", "BigBird"), ("bigbird_pegasus", "BigBirdPegasus"))
    for kind in ("SelfAttention", "BlockSparseAttention")
}


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache  # one read of a class's source per process, not one per instance
def _forward_misuse(cls: type, names: tuple[str, ...]) -> str | None:
    """How ``cls.forward`` uses one of ``names`` otherwise than a slice stands in for it (calling it, reading its
    weight, bias or sizes), or None. A forward whose source cannot be read is not known."""
    try:
        source = inspect.getsource(cast(type[nn.Module], cls).forward)
    except (OSError, TypeError):
        return f"the source of {cls.__qualname__}.forward is not available to check how it uses {'/'.join(names)}"
    for name in names:
        pattern = rf"self\.{name}\b(?!\s*\()(?!\.(?:{'|'.join(_SLICE_ATTRIBUTES)})\b)"
        if (found := re.search(pattern, source)) is not None or re.search(rf"self\.{name}\.\w+\s*=[^=]", source):
            use = found.group(0) if found else f"self.{name}.<attribute> = ..."
            return f"{cls.__qualname__}.forward uses {use!r} otherwise than calling it"
    return None


def _projection_mismatch(module: nn.Module, names: Sequence[str], fused_name: str) -> str | None:
    """Why ``module``'s children ``names`` cannot become one fused Linear ``fused_name``, or None when they can."""
    linears = [getattr(module, name) for name in names]
    for name, linear in zip(names, linears, strict=True):
        if type(linear) is not nn.Linear:
            return f"its {name} is a {type(linear).__qualname__}, not an nn.Linear"
        state = [n for n, _ in (*linear.named_parameters(), *linear.named_buffers()) if n not in ("weight", "bias")]
        if state or linear._modules:
            return f"its {name} holds {', '.join(state or list(linear._modules))} besides its weight and bias"
        if hooked(linear):
            return f"its {name} has hooks"
    first = linears[0]
    for name, linear in zip(names[1:], linears[1:], strict=True):
        if linear.in_features != first.in_features:
            return f"{names[0]} reads {first.in_features} features and {name} {linear.in_features}"
        if (linear.bias is None) != (first.bias is None):
            which = name if linear.bias is None else names[0]
            return f"{which} has no bias while the others have one: one fused Linear cannot hold that"
        if linear.weight.dtype != first.weight.dtype:
            return f"{names[0]} is {first.weight.dtype} and {name} {linear.weight.dtype}"
    if fused_name in module._modules or fused_name in module._parameters or fused_name in module.__dict__:
        return f"it already has an attribute {fused_name!r}"
    if (rebuilt := REBUILT_AT_RUN_TIME.get(_class_path(type(module)))) is not None:
        return rebuilt
    # A class object hashes by identity (mypy reads nn.Module's instance __hash__ annotation instead).
    return _forward_misuse(cast(type, type(module)), tuple(names))


def _key_space_pattern(paths: Sequence[str]) -> str:
    """A capture group matching exactly ``paths`` (module paths) at the start of a key: the one group a converter's
    target may capture (it holds no nested group)."""
    return "^(" + "|".join(re.escape(path) for path in sorted(paths, key=lambda p: (-len(p), p))) + ")"


class FusedProjectionsSpec(ModuleFusionSpec):
    """Fuse groups of sibling Linear layers that share their input.

    The fused class decides per instance (``per_instance``): an instance whose projections cannot be fused (another
    input size, a bias on some only, extra state, a forward that uses them otherwise than calling them) stays an
    instance of the original class.

    Attributes:
        groups: ``(child names, fused name)`` alternatives, in order of preference; a module is a candidate when it
            has one group's children, and fusable when they are plain ``nn.Linear`` with the same input size, bias
            presence and dtype, holding nothing else, and its forward only calls them (or reads their weight, bias
            and sizes).
        prefix: Prefix of generated class names (``"QKVFused"``).
        apart_from_rows: Rows of input from which, on an accelerator in eager mode, each part is computed on its own
            (``ProjectionSlice``): set by families whose parts are read elementwise; None: always one product.
    """

    groups: Sequence[tuple[tuple[str, ...], str]] = ()
    prefix = "Fused"
    apart_from_rows: int | None = None
    per_instance = True
    reads_runtime_names = True

    def runtime_key_parts(self) -> Sequence[tuple[tuple[str, ...], str]]:
        return self.groups

    def _candidate_groups(self, module: nn.Module) -> list[tuple[tuple[str, ...], str]]:
        return [g for g in self.groups if all(name in module._modules for name in g[0])]

    def _group_of(self, module: nn.Module) -> tuple[tuple[str, ...], str] | None:
        return next((g for g in self._candidate_groups(module) if _projection_mismatch(module, *g) is None), None)

    def is_candidate(self, module: nn.Module) -> bool:
        return bool(self._candidate_groups(module))

    def is_fusable(self, module: nn.Module) -> bool:
        return self._group_of(module) is not None

    def unfusable_reason(self, module: nn.Module) -> str | None:
        candidates = self._candidate_groups(module)
        if not candidates:
            names = " or ".join("/".join(names) for names, _ in self.groups)
            return f"it has no {names} children"
        reasons = [_projection_mismatch(module, *group) for group in candidates]
        return None if None in reasons else "; ".join(r for r in reasons if r)

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        spec = self

        def __init__(self, *args, **kwargs):
            original_cls.__init__(self, *args, **kwargs)
            group = spec._group_of(self)
            if group is None:
                # Decided per instance, by the very test discovery ran on the unfused build: this instance stays what
                # it is, an instance of the original class.
                self.__class__ = original_cls
                return
            fuse_linears(self, *group, apart_from_rows=spec.apart_from_rows)
            fold_smoothing_mappings()

        return make_class(self.prefix, original_cls, {"__init__": __init__}, spec=self)

    def make_transforms(self, config: PretrainedConfig, modules: Mapping[str, nn.Module]) -> list[WeightTransform]:
        """One converter per layout (child names, fused name, part sizes), scoped to the exact paths of the modules
        of that layout: ``<path>.q_proj`` / ``k_proj`` / ``v_proj`` -> ``<path>.qkv_proj``. Two towers (or layers) of
        one model with other sizes get a converter each, so neither's tensors are cut to the other's sizes."""
        layouts: dict[tuple[tuple[str, ...], str, tuple[int, ...]], list[str]] = defaultdict(list)
        spellings = modules if isinstance(modules, ModulesToFuse) else ModulesToFuse(modules)
        taken = set(modules)
        for module_name, module in modules.items():
            names, fused_name = self._group_of(module)  # type: ignore[misc]
            sizes = tuple(getattr(module, n).out_features for n in names)
            # Another spelling of the name in a checkpoint, unless it is some other module's own name.
            layouts[(names, fused_name, sizes)] += [
                n for n in spellings.key_space_names(module_name) if n == module_name or n not in taken
            ]
        transforms: list[WeightTransform] = []
        for (names, fused_name, sizes), paths in sorted(layouts.items(), key=lambda item: sorted(item[1])[0]):
            scope = _key_space_pattern(paths)
            transforms.append(
                WeightConverter(
                    [rf"^\1\.{re.escape(name)}(?=\.(?:weight|bias)$)" for name in names],
                    rf"{scope}\.{fused_name}",
                    [Concatenate(dim=0, sizes=sizes)],
                )
            )
        return transforms

    def tensor_parallel_layout(
        self, module: nn.Module, rules: Mapping[str, str], ranks: int
    ) -> TensorParallelLayout | None:
        """A fused projection whose parts the plan shards colwise (``q_proj``, ``k_proj``, ``v_proj``) is sharded
        colwise *part by part*: rank ``r`` holds ``[q_r; k_r; v_r]``, so that each rank's slices take whole heads of
        each part (one block split would not, when the parts differ in size: grouped-query attention). A plan that
        names the fused projection itself keeps that rule; parts it does not shard leave the projection whole."""
        replaces: set[str] = set()
        shards: dict[str, TensorParallelShard] = {}
        for fused_name, fused in module.named_children():
            if not isinstance(fused, FusedLinear):
                continue
            parts = [name for name, _ in _slices_of(module, fused_name)]
            styles = {name: rules[name] for name in parts if name in rules}
            replaces.update(styles)
            if not styles or fused_name in rules:
                continue
            if len(styles) < len(parts) or any(style != "colwise" for style in styles.values()):
                raise TensorParallelError(
                    f"the TP plan shards the parts of {fused_name} as {styles}; modelpatch shards a fused projection "
                    f"only when every part is 'colwise'. Load without this fusion, or pass a tp_plan that sets "
                    f"{fused_name!r} itself."
                )
            shards[fused_name] = TensorParallelShard("colwise", parts=FusedParts(fused.part_sizes))
        return TensorParallelLayout(frozenset(replaces), shards) if replaces else None

    def finish_tensor_parallel(self, module: nn.Module, layout: TensorParallelLayout, ranks: int) -> None:
        """Point the projection slices at their parts' local sizes: the fused output of a rank holds its block of
        each part."""
        for fused_name, shard in layout.shards.items():
            if shard.parts is None:
                continue
            local = shard.parts.local_sizes(ranks)
            for _, part in _slices_of(module, fused_name):
                part.part_sizes = local
                part.out_features = local[part.index]


def _slices_of(owner: nn.Module, fused_name: str) -> list[tuple[str, ProjectionSlice]]:
    """``owner``'s projection slices of its fused layer ``fused_name``, in part order, with their names."""
    found = [
        (name, child)
        for name, child in owner.named_children()
        if isinstance(child, ProjectionSlice) and child.fused_name == fused_name
    ]
    return sorted(found, key=lambda item: item[1].index)


class QKVFusionSpec(FusedProjectionsSpec):
    """``qkv``: an attention module's query, key and value projections as one Linear."""

    groups = (
        (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
        (("query", "key", "value"), "qkv"),
        (("q", "k", "v"), "qkv"),
    )
    prefix = "QKVFused"


class GateUpFusionSpec(FusedProjectionsSpec):
    """``gate_up``: a gated MLP's gate and up projections as one Linear."""

    groups = (
        (("gate_proj", "up_proj"), "gate_up_proj"),
        (("w1", "w3"), "w13"),
        (("wi_0", "wi_1"), "wi"),
    )
    # Not "GateUpFused": compressed-tensors reads a class name with "Gate" before anything but a lowercase letter as an
    # MoE router (its pattern Gate(?![a-z])), and so put every fused MLP into a quantized checkpoint's ignore list.
    prefix = "InputProjFused"
    # act(gate) * up reads the parts elementwise: measured on an H200 (bf16, Llama-3-8B MLP), the one product with
    # strided parts won at 1 and 16 rows and lost from 512 rows on (0.987x at 512, 0.87x at 2048): see ProjectionSlice.
    apart_from_rows = 256
