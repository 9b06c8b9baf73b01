"""The stages of a save and the hooks a mode takes part in them with, as a load's (``modes.py``) mirrored.

A save is the same stages whatever it is asked for — a whole checkpoint (``save.py``), a collective one written by
every rank of a sharded model (``save_sharded.py``), a stream of tensors (``state_dict.py``), the tensors handed to
stock ``save_pretrained`` or to torch's distributed checkpoint:

1. checks: a PEFT model or adapter layers refused (``save_contents.reject_wrapped``);
2. writer: the modes' :meth:`SaveMode.save_writer` — how the files are written (the last mode naming one wins;
   none: :class:`WholeFiles`), chosen before anything can be refused, so that every rank of a collective save
   refuses together;
3. plan (:func:`plan_model_save`, no tensor data): the modes' :meth:`SaveMode.plan_save` (a mode refuses here, before
   any byte is written; it stands in for the tensors it gives on the way out, with their full shapes, or hands over a
   serialisation of its own), then the save's own checks on those stand-ins (modules substituted since the build,
   tensors on the meta device that no mode reads back), tied parameters dropped, and the checkpoint layout: which
   runtime tensors become which original keys (:attr:`SavePlan.layout`);
4. per-tensor transform (:meth:`SavePlan.fetch`): each runtime tensor the writer reads goes through the modes'
   :meth:`SaveMode.save_tensor`, in load order, when its turn comes (a shard gathered, an offloaded weight read back
   from its file), then through its conversion group's exact reverse;
5. write: the writer's :meth:`SaveWriter.write` (whole files, written atomically; or each rank its rows into files
   pre-sized by rank 0), or the caller takes the tensors (a stream, stock ``save_pretrained``).

No stage asks which modes the model holds: a mode takes part only through its hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..checkpoint import write_checkpoint
from ..conversion.planner import ConversionPlan
from .distributed import Rows, current_rank
from .offload import meta_tensors, unreadable_meta_tensors
from .report import get_load_report
from .save_contents import (
    check_saveable,
    config_files,
    independent,
    model_layout,
    state_to_save,
)

logger = logging.getLogger(__name__)

#: How the tensors of a runtime key are spread over the ranks, when no mode says otherwise (entries compared by the
#: ranks of a collective save).
WHOLE = "whole on every rank"


class SaveMode:
    """The hooks of a save; a mode overrides those of the stages it takes part in (every default changes nothing).

    In the order a save calls them:

    1. :meth:`save_writer` — how the save's files are written (the last mode naming one wins);
    2. :meth:`plan_save` — the plan made, before any tensor data is read or any byte is written: refuse here;
    3. :meth:`save_tensor` — each runtime tensor on its way out, when the writer reads it (each mode is given the
       previous mode's tensor, in load order).

    The loader records the modes of a load on the model (its record's ``load_modes``); a save of the model, or of a
    copy of it, calls these hooks with the model being saved (``plan.model``): a mode must read what it needs there.
    """

    def save_writer(self, model: PreTrainedModel) -> SaveWriter | None:
        """How a save of ``model`` writes its files; None: this mode does not decide it."""
        return None

    def plan_save(self, plan: SavePlan) -> None:
        """Check and prepare this mode's part of the save: raise here, before anything is written. A mode that gives
        tensors' values on their way out (gathered, read back) says so with :meth:`SavePlan.stand_in`; one that
        writes the model its own way with :meth:`SavePlan.serialise`."""

    def save_tensor(self, plan: SavePlan, key: str, tensor: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        """Runtime tensor ``key`` (given the previous mode's ``tensor``) as the save writes it.

        ``rows``: the writer asks for this rank's rows only (those :meth:`SavePlan.stand_in` gave), which a mode
        holding the tensor sharded returns as its local part; None: the whole tensor (a collective, on every rank,
        for a sharded one).
        """
        return tensor


@dataclass(frozen=True)
class _Taken:
    """A runtime tensor a mode gives on the way out: its stand-in for the plan (full shape, dtype), the rows of it
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
    """

    model: PreTrainedModel
    modes: Sequence[SaveMode]
    writer: SaveWriter
    original_format: bool
    state: dict[str, Any]
    layout: ConversionPlan = field(default_factory=ConversionPlan)
    serialised: dict[str, torch.Tensor] | None = None
    metadata: dict[str, str] | None = None
    _taken: dict[str, _Taken] = field(default_factory=dict)

    def stand_in(self, key: str, full: torch.Tensor, *, rows: Rows | None = None, spread: str = WHOLE) -> None:
        """A mode gives runtime tensor ``key``'s values on the way out (:meth:`SaveMode.save_tensor`): ``full`` stands
        in for it in the plan (its full shape and dtype: a meta tensor will do); ``rows``: the rows of it this rank
        writes in a collective save (None: the whole tensor, gathered and written by one rank); ``spread``: how it is
        spread over the ranks, in words that are the same on every rank."""
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
        """What the plan sees of runtime tensor ``key``: a mode's stand-in, else the tensor itself."""
        taken = None if self.serialised is not None else self._taken.get(key)
        return self.written()[key] if taken is None else taken.full

    def stand_ins(self) -> dict[str, Any]:
        """The model's state as the plan sees it: each tensor a mode took (:meth:`stand_in`) as its stand-in."""
        return {key: self._taken[key].full if key in self._taken else tensor for key, tensor in self.state.items()}

    def unread(self) -> list[str]:
        """The model's tensors on the meta device that no mode reads back on the way out: they hold no values."""
        return [key for key in meta_tensors(self.state) if key not in self._taken]

    def rows(self, key: str) -> Rows | None:
        """The rows of runtime tensor ``key`` this rank writes in a collective save (None: the whole tensor, gathered,
        written by one rank); a tensor no mode took is whole on every rank: rank 0 writes it."""
        taken = self._taken.get(key)
        if taken is not None:
            return taken.rows
        tensor = self.written()[key]
        return None if tensor.ndim == 0 else Rows(0, tensor.shape[0], current_rank() == 0)

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

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the save writes, whole, each owning its storage (views of one fused parameter copied)."""
        with torch.no_grad():
            return independent(self.layout.run(self.fetch))

    def checkpoint_metas(self) -> dict[str, torch.Tensor]:
        """Each written tensor's full shape and dtype (meta tensors), by written key."""
        metas = {key: _meta(self.full(runtime)) for key, runtime in self.layout.direct.items()}
        for group in self.layout.groups:
            dtype = self.full(group.source_keys()[0]).dtype
            for key, meta in group.target_metas().items():
                metas[key] = torch.empty(meta.shape, dtype=dtype, device="meta")
        return metas

    def config_files(self) -> dict[str, bytes]:
        """``config.json`` (and ``generation_config.json``) as this save writes them."""
        return config_files(self.model, original_format=self.original_format)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")


def save_writer(model: PreTrainedModel, modes: Sequence[SaveMode]) -> SaveWriter:
    """The writer of a save of ``model``: the last of ``modes`` naming one, else :class:`WholeFiles`."""
    writer: SaveWriter = WholeFiles()
    for mode in modes:
        writer = mode.save_writer(model) or writer
    return writer


def plan_model_save(
    model: PreTrainedModel,
    modes: Sequence[SaveMode],
    *,
    original_format: bool,
    state_dict: Mapping[str, Any] | None = None,
    writer: SaveWriter | None = None,
) -> SavePlan:
    """Stage 3 of a save: the modes' :meth:`SaveMode.plan_save`, the save's checks, the checkpoint layout.

    ``state_dict`` defaults to ``model.state_dict()`` (Trainer passes its own). Reads no tensor data (a mode handing
    over its own serialisation, the quantizer's, makes it here).

    Raises:
        SaveError: A mode refused the save, a module was substituted since the build, or a tensor is on the meta
            device with nothing to read it from; every module or tensor at fault is named.
    """
    state = dict(state_dict if state_dict is not None else model.state_dict())
    plan = SavePlan(model, modes, writer or save_writer(model, modes), original_format, state)
    for mode in modes:
        mode.plan_save(plan)
    unread = plan.unread()
    if unread:
        raise unreadable_meta_tensors(model, unread)
    check_saveable(model, plan.stand_ins(), quantized=plan.serialised is not None)
    kept = state_to_save(model, plan.written(), get_load_report(model))
    if original_format and plan.serialised is None:
        plan.layout = model_layout(model, {key: plan.full(key) for key in kept})
    else:  # the runtime layout, or a mode's serialisation: as it is
        plan.layout = ConversionPlan(direct={key: key for key in kept})
    return plan


class SaveWriter:
    """Stage 5 of a save: how its files are written. Chosen by the modes (:meth:`SaveMode.save_writer`) before the
    plan is made; it makes the plan itself (``planned``), so that a refusal on one rank of a collective save is
    every rank's."""

    #: Whether each rank writes its own rows of the tensors (a mode's whole-model serialisation cannot be cut so).
    writes_rows: bool = False

    def write(self, directory: str | Path, planned: Callable[[], SavePlan], max_shard_size: int | str) -> list[Path]:
        """Write the save ``planned()`` plans into ``directory``; return the files written."""
        raise NotImplementedError


@dataclass(frozen=True)
class WholeFiles(SaveWriter):
    """Every tensor whole, in files written atomically (``checkpoint/writer.py``) by this process.

    ``writes``: whether this process writes them (every process reads the tensors: gathering may be collective);
    ``done``: called once the files are written, or not, on every process (another rank waits for the writer).
    """

    writes: bool = True
    done: Callable[[], None] | None = None

    def write(self, directory: str | Path, planned: Callable[[], SavePlan], max_shard_size: int | str) -> list[Path]:
        plan = planned()
        tensors = plan.tensors()
        if not self.writes:
            if self.done is not None:
                self.done()
            return []
        try:
            files = write_checkpoint(
                directory,
                tensors,
                extra_files=plan.config_files(),
                metadata=plan.metadata,
                max_shard_size=max_shard_size,
            )
        finally:
            if self.done is not None:
                self.done()
        layout = "checkpoint" if plan.original_format else "runtime"
        logger.info("Saved %d tensors to %s (%s layout)", len(tensors), directory, layout)
        return files
