"""How the tensors of fused modules are spread over processes: what a fusion family declares
(:meth:`~modelpatch.fusions.spec.ModuleFusionSpec.tensor_parallel_layout` returns a :class:`TensorParallelLayout`),
and the row arithmetic of a tensor fused from parts along dim 0 (:class:`FusedParts`) that tensor parallelism, the
FSDP2 sharded load and the collective save share.

This is data only: the modes (``modes/``) and the collective save (``saving/``) apply it; fusions import none of
the pipelines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FusedParts", "HeldRows", "TensorParallelLayout", "TensorParallelShard"]


@dataclass(frozen=True)
class HeldRows:
    """Rows ``start:stop`` of part ``part`` of a fused tensor, which starts at row ``offset`` of the fused tensor;
    a shard holds them from its row ``at`` on."""

    part: int
    start: int
    stop: int
    offset: int
    at: int

    @property
    def rows(self) -> slice:
        """These rows, within their part."""
        return slice(self.start, self.stop)

    @property
    def fused(self) -> slice:
        """These rows, within the fused tensor."""
        return slice(self.offset + self.start, self.offset + self.stop)

    @property
    def shard(self) -> slice:
        """These rows, within the shard holding them."""
        return slice(self.at, self.at + self.stop - self.start)


@dataclass(frozen=True)
class FusedParts:
    """A tensor made of parts concatenated along dim 0 (a fused ``q/k/v`` or ``gate/up`` weight), of row counts
    ``sizes``: which rows of which part a shard of it holds."""

    sizes: tuple[int, ...]

    def offsets(self) -> list[int]:
        """Where each part starts in the fused tensor."""
        offsets, start = [], 0
        for size in self.sizes:
            offsets.append(start)
            start += size
        return offsets

    def held(self, start: int, stop: int) -> list[HeldRows]:
        """The parts' rows within rows ``start:stop`` of the fused tensor (a row-sharded shard: FSDP2's ``Shard(0)``),
        in order; parts the range misses are left out."""
        held = []
        for part, (offset, size) in enumerate(zip(self.offsets(), self.sizes, strict=True)):
            first, last = max(start, offset), min(stop, offset + size)
            if first < last:
                held.append(HeldRows(part, first - offset, last - offset, offset, first - start))
        return held

    def divides(self, ranks: int) -> bool:
        """Whether every part splits evenly over ``ranks`` (what sharding part by part needs)."""
        return all(size % ranks == 0 for size in self.sizes)

    def local_sizes(self, ranks: int) -> tuple[int, ...]:
        """Each part's rows on one rank when sharded part by part over ``ranks``."""
        return tuple(size // ranks for size in self.sizes)

    def by_part(self, rank: int, ranks: int) -> list[HeldRows]:
        """The rows ``rank`` holds when the tensor is sharded part by part over ``ranks`` (tensor parallelism's
        colwise split of a fused projection): its ``rank``-th block of every part, the blocks concatenated in part
        order (``[q_r; k_r; v_r]``), so each rank's slices take whole heads of each part."""
        held, at = [], 0
        for part, (offset, local) in enumerate(zip(self.offsets(), self.local_sizes(ranks), strict=True)):
            held.append(HeldRows(part, rank * local, (rank + 1) * local, offset, at))
            at += local
        return held


@dataclass(frozen=True)
class TensorParallelShard:
    """How one Linear-like module of a fused module splits over tensor-parallel ranks.

    Attributes:
        split: ``"colwise"``: its output rows (weight rows, bias) split over the ranks, its input whole on each;
            ``"rowwise"``: its input columns split, each rank's partial output summed over the ranks.
        parts: For ``"colwise"``, the parts its rows are fused from: each part's rows split over the ranks, then
            concatenated (:meth:`FusedParts.by_part`), so a rank's output holds its block of every part. None: the
            rows split as one block.
        local: The module computes on its local shard alone and a module above it combines the ranks' results (the
            experts of a MoE block, whose block sums its experts' outputs over the ranks): only its weight is
            sharded, and it gets no communication of its own.
    """

    split: Literal["colwise", "rowwise"]
    parts: FusedParts | None = None
    local: bool = False

    def __post_init__(self) -> None:
        if self.split not in ("colwise", "rowwise"):
            raise ValueError(f"split must be 'colwise' or 'rowwise', got {self.split!r}.")
        if self.parts is not None and self.split != "colwise":
            raise ValueError(f"only a colwise split goes part by part, got parts with {self.split!r}.")

    def problems(self, name: str, module: nn.Module, joined: Mapping[str, tuple[int, tuple[int, ...]]]) -> list[str]:
        """What of this shard does not fit ``module`` (named ``name``), the module of the fused one it names.

        ``joined``: the parameters of ``module`` (by attribute name) that a conversion concatenated from several
        parts, each with the dim it joined them along and the parts' sizes there. A split along that dim must keep
        each rank's rows within the parts: by parts whose boundaries include the joined ones (one block would give
        a rank the rows of one part and none of another).
        """
        parameters = dict(module.named_parameters(recurse=False))
        if not parameters or (self.local and "weight" not in parameters):
            held = "no weight" if parameters else "no parameter of its own"
            return [f"{name} is a {type(module).__name__} holding {held}: it cannot be split {self.split}"]
        problems = []
        for attribute, parameter in parameters.items():
            rows = parameter.shape[0] if parameter.ndim else 0
            if self.parts is not None and rows != sum(self.parts.sizes):
                problems.append(
                    f"{name}.{attribute} has {rows} rows, and the parts {list(self.parts.sizes)} declared for them "
                    f"tile {sum(self.parts.sizes)}"
                )
                continue
            if attribute not in joined:
                continue
            dim, sizes = joined[attribute]
            if self.parts is not None:
                split_dim: int | None = 0  # sharded part by part along its rows
            elif self.split == "colwise":
                split_dim = max(parameter.ndim - 2, 0)  # a weight's output rows, a bias' entries
            else:
                split_dim = parameter.ndim - 1 if parameter.ndim > 1 else None  # input columns; a bias stays whole
            declared = set(self.parts.offsets()[1:]) if self.parts is not None else set()
            if dim == split_dim and not set(FusedParts(sizes).offsets()[1:]) <= declared:
                how = f"by the parts {list(self.parts.sizes)}" if self.parts is not None else "as one block"
                fix = f" (parts=FusedParts({tuple(sizes)}))" if self.split == "colwise" else ""
                problems.append(
                    f"{name}.{attribute} is joined from parts of {list(sizes)} along dim {dim}, which a {self.split} "
                    f"split {how} cuts across: its ranks would not hold the same rows of every part; declare the "
                    f"parts{fix}"
                )
        return problems


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a fused module is sharded under tensor parallelism, in place of the model's own plan for the modules it
    replaced.

    Attributes:
        replaces: The rules of the model's TP plan (names relative to the fused module, ``""`` for itself) that this
            layout stands in for: they are dropped. Rules not named here stay as they are.
        shards: Module name relative to the fused module (``*`` for any index, as TP plans name layers) -> how it
            splits. A module of the fused one named in no rule (left or added) is replicated: every rank holds it
            whole.
    """

    replaces: frozenset[str] = frozenset()
    shards: Mapping[str, TensorParallelShard] = field(default_factory=dict)
