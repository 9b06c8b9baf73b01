"""What a save plans and the hooks a mode takes part in a save with: the save's side of ``modes/base.py``.

:class:`SaveMode` holds the save hooks every load mode has (``LoadMode`` subclasses it); :class:`SavePlan` is what
they see and fill; :class:`SaveWriter` is how a save's files are written. The stages that call them are in
``stages.py``. This module imports none of the package's loading modules, so that ``modes/base.py`` can build on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..conversion.planner import ConversionGroup, ConversionPlan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: How the tensors of a runtime key are spread over the ranks, when no mode says otherwise (entries compared by the
#: ranks of a collective save).
WHOLE = "whole on every rank"


@dataclass(frozen=True)
class Rows:
    """The rows ``start:stop`` (of dim 0) of a tensor that this rank holds; ``writes``: whether this rank is the one
    that writes them in a save (of a replicated tensor, only the first rank of each replicating mesh dimension)."""

    start: int
    stop: int
    writes: bool


class SaveMode:
    """The hooks of a save; a mode overrides those of the stages it takes part in (every default changes nothing).

    In the order a save calls them:

    1. :meth:`save_writer` — how the save's files are written (the last mode naming one wins);
    2. :meth:`plan_save` — the plan made, before any tensor data is read or any byte is written: refuse here;
    3. :meth:`save_tensor` — each runtime tensor on its way out, when the writer reads it (each mode is given the
       previous mode's tensor, in load order);
    4. :meth:`save_group` — a conversion group's written tensors, where a mode computes them otherwise than from its
       sources fetched whole (the first mode answering wins).

    The loader records the modes of a load on the model (its record's ``load_modes``); a save of the model, or of a
    copy of it, calls these hooks with the model being saved (``plan.model``): a mode must read what it needs there.
    """

    def save_writer(self, model: PreTrainedModel) -> SaveWriter | None:
        """How a save of ``model`` writes its files; None: this mode does not decide it."""
        return None

    def plan_save(self, plan: SavePlan) -> None:
        """Check and prepare this mode's part of the save: raise here, before anything is written. A mode that gives
        tensors' values on their way out (gathered, read back) takes them with :meth:`SavePlan.take`; one that
        writes the model its own way with :meth:`SavePlan.serialise`."""

    def save_tensor(self, plan: SavePlan, key: str, tensor: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        """Runtime tensor ``key`` (given the previous mode's ``tensor``) as the save writes it.

        ``rows``: the writer asks for this rank's rows only (those :meth:`SavePlan.take` gave), which a mode
        holding the tensor sharded returns as its local part; None: the whole tensor (a collective, on every rank,
        for a sharded one).
        """
        return tensor

    def save_group(self, plan: SavePlan, group: ConversionGroup) -> dict[str, torch.Tensor] | None:
        """The tensors ``group`` (runtime -> checkpoint) writes, whole, computed by this mode (a sharded model's rows
        gathered target by target); None: the group is run on its sources fetched whole (:meth:`save_tensor`)."""
        return None


@dataclass(frozen=True)
class _Taken:
    """A runtime tensor a mode gives on the way out: what the plan sees of it (full shape, dtype), the rows of it
    this rank writes (None: not row by row: the whole tensor, written by one rank) and how it is spread, in words."""

    full: torch.Tensor
    rows: Rows | None
    spread: str


@dataclass
class SavePlan:
    """What a save of ``model`` writes, decided before any tensor data is read.

    Attributes:
        model: The model saved.
        modes: The modes whose hooks the save calls (its record's load modes, then the save's own).
        writer: How the files are written (the modes' :meth:`SaveMode.save_writer`).
        original_format: The checkpoint's layout (True) or the runtime layout.
        state: The model's runtime tensors as it holds them.
        layout: Which runtime tensors become which written keys: direct keys and groups run backwards.
        serialised: A mode's own serialisation of the model, written as it is in place of ``state`` (a quantizer's
            flattened tensors), else None.
        metadata: The safetensors metadata written with the tensors (a quantizer's), else None.
        rank: This process's rank (0 outside ``torch.distributed``).
    """

    model: PreTrainedModel
    modes: Sequence[SaveMode]
    writer: SaveWriter
    original_format: bool
    state: dict[str, Any]
    layout: ConversionPlan = field(default_factory=ConversionPlan)
    serialised: dict[str, torch.Tensor] | None = None
    metadata: dict[str, str] | None = None
    rank: int = 0
    _taken: dict[str, _Taken] = field(default_factory=dict)

    def take(self, key: str, full: torch.Tensor, *, rows: Rows | None = None, spread: str = WHOLE) -> None:
        """A mode takes runtime tensor ``key``: it gives its values on the way out (:meth:`SaveMode.save_tensor`),
        and the plan sees ``full`` in its place (its full shape and dtype: a meta tensor will do); ``rows``: the rows
        of it this rank writes in a collective save (None: the whole tensor, gathered and written by one rank);
        ``spread``: how it is spread over the ranks, in words that are the same on every rank."""
        self._taken[key] = _Taken(full, rows, spread)

    def serialise(self, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
        """A mode writes the model its own way (a quantizer's serialisation): ``tensors`` are written as they are,
        in the runtime layout, in place of the model's state (which the save still checks), with ``metadata``."""
        self.serialised = dict(tensors)
        self.metadata = metadata

    def written(self) -> dict[str, Any]:
        """The tensors the save reads from, by runtime key: a mode's serialisation, else the model's state."""
        return self.state if self.serialised is None else self.serialised

    def full(self, key: str) -> torch.Tensor:
        """What the plan sees of runtime tensor ``key``: what a mode took it as, else the tensor itself."""
        taken = None if self.serialised is not None else self._taken.get(key)
        return self.written()[key] if taken is None else taken.full

    def planned_state(self) -> dict[str, Any]:
        """The model's state as the plan sees it: each tensor a mode took (:meth:`take`) as what it took it as."""
        return {key: self._taken[key].full if key in self._taken else tensor for key, tensor in self.state.items()}

    def taken(self, key: str) -> bool:
        """Whether a mode gives runtime tensor ``key``'s values on the way out (:meth:`take`)."""
        return key in self._taken

    def rows(self, key: str) -> Rows | None:
        """The rows of runtime tensor ``key`` this rank writes in a collective save (None: the whole tensor, gathered,
        written by one rank); a tensor no mode took is whole on every rank: rank 0 writes it."""
        taken = self._taken.get(key)
        if taken is not None:
            return taken.rows
        tensor = self.written()[key]
        return None if tensor.ndim == 0 else Rows(0, tensor.shape[0], self.rank == 0)

    def spread(self, key: str) -> str:
        """How runtime tensor ``key`` is spread over the ranks, in words."""
        taken = self._taken.get(key)
        return WHOLE if taken is None else taken.spread

    def fetch(self, key: str, rows: Rows | None = None) -> torch.Tensor:
        """Runtime tensor ``key`` through the modes' :meth:`SaveMode.save_tensor`: whole (a collective for a sharded
        one: every rank must fetch it), or this rank's ``rows`` of it."""
        tensor = self.written()[key]
        for mode in self.modes:
            tensor = mode.save_tensor(self, key, tensor, rows)
        return tensor.detach()

    def group_tensors(self, group: ConversionGroup) -> dict[str, torch.Tensor]:
        """The tensors ``group`` writes, whole: as a mode computes them (:meth:`SaveMode.save_group`), else run on its
        sources fetched whole."""
        with torch.no_grad():
            for mode in self.modes:
                if (outputs := mode.save_group(self, group)) is not None:
                    return outputs
            return group.run(self.fetch)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the save writes, whole, each owning its storage (views of one fused parameter copied)."""
        with torch.no_grad():
            tensors = {key: self.fetch(runtime) for key, runtime in self.layout.direct.items()}
            for group in self.layout.groups:
                tensors.update(self.group_tensors(group))
            return independent(tensors)

    def checkpoint_metas(self) -> dict[str, torch.Tensor]:
        """Each written tensor's full shape and dtype (meta tensors), by written key."""
        metas = {key: _meta(self.full(runtime)) for key, runtime in self.layout.direct.items()}
        for group in self.layout.groups:
            dtype = self.full(group.source_keys()[0]).dtype
            for key, meta in group.target_metas().items():
                metas[key] = torch.empty(meta.shape, dtype=dtype, device="meta")
        return metas


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")


class SaveWriter:
    """Stage 5 of a save: how its files are written. Chosen by the modes (:meth:`SaveMode.save_writer`) before the
    plan is made; it makes the plan itself (``planned``), so that a refusal on one rank of a collective save is
    every rank's."""

    #: Whether each rank writes its own rows of the tensors (a mode's whole-model serialisation cannot be cut so).
    writes_rows: bool = False

    def write(self, directory: str | Path, planned: Callable[[], SavePlan], max_shard_size: int | str) -> list[Path]:
        """Write the save ``planned()`` plans into ``directory``; return the files written."""
        raise NotImplementedError


def independent(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors safe to serialise: each owns its storage (converted parts may be views of one fused parameter)."""
    owners: dict[int, str] = {}
    result = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr()
        if storage in owners or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        owners.setdefault(storage, key)
        result[key] = tensor.contiguous()
    return result
