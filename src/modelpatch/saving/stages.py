"""The stages of a save, as a load's (``loading/load.py``, ``modes/base.py``) mirrored; the hooks a mode takes part
in them with, and the plan they fill, are ``plan.py``'s.

A save is the same stages whatever it is asked for — a whole checkpoint (``save.py``), a collective one written by
every rank of a sharded model (``sharded.py``), a stream of tensors (``boundary/state_dict.py``), the tensors handed to
stock ``save_pretrained`` or to torch's distributed checkpoint:

1. checks: a PEFT model or adapter layers refused (``contents.reject_wrapped``);
2. writer: the modes' :meth:`SaveMode.save_writer` — how the files are written (the last mode naming one wins;
   none: :class:`WholeFiles`), chosen before anything can be refused, so that every rank of a collective save
   refuses together;
3. plan (:func:`plan_model_save`, no tensor data): the modes' :meth:`SaveMode.plan_save` (a mode refuses here, before
   any byte is written; it takes the tensors it gives on the way out, with their full shapes, or hands over a
   serialisation of its own), then the save's own checks on the state so planned (modules substituted since the build,
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from ..checkpoint import write_checkpoint
from ..conversion.planner import ConversionPlan
from ..loading.record import get_load_report
from ..modes.distributed import current_rank
from ..modes.offload import meta_tensors, unreadable_meta_tensors
from ..state import stored_fusion_config
from .agreement import lone_save
from .compressed import refuse_runtime_layout
from .contents import check_saveable, config_files, model_layout, state_to_save
from .plan import SaveMode, SavePlan, SaveWriter

logger = logging.getLogger(__name__)


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
    plan = SavePlan(model, modes, writer or save_writer(model, modes), original_format, state, rank=current_rank())
    for mode in modes:
        mode.plan_save(plan)
    unread = [key for key in meta_tensors(state) if not plan.taken(key)]  # no mode reads them back: no values
    if unread:
        raise unreadable_meta_tensors(model, unread)
    check_saveable(model, plan.planned_state(), quantized=plan.serialised is not None)
    if not original_format:
        refuse_runtime_layout(model, fused=stored_fusion_config(model.config) is not None)
    kept = state_to_save(model, plan.written(), get_load_report(model))
    if original_format and plan.serialised is None:
        plan.layout = model_layout(model, {key: plan.full(key) for key in kept})
    else:  # the runtime layout, or a mode's serialisation: as it is
        plan.layout = ConversionPlan(direct={key: key for key in kept})
    return plan


@dataclass(frozen=True)
class WholeFiles(SaveWriter):
    """Every tensor whole, in files written atomically (``checkpoint/writer.py``) by this process.

    ``writes``: whether this process writes them (every process reads the tensors: gathering may be collective);
    ``done``: called once the files are written, or not, on every process (another rank waits for the writer).
    """

    writes: bool = True
    done: Callable[[], None] | None = None

    def write(self, directory: str | Path, planned: Callable[[], SavePlan], max_shard_size: int | str) -> list[Path]:
        if self.done is None:  # written by this process alone: refused where other ranks save into it collectively
            lone_save(Path(directory), "modelpatch.save_pretrained")
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
                extra_files=config_files(plan.model, original_format=plan.original_format),
                metadata=plan.metadata,
                max_shard_size=max_shard_size,
            )
        finally:
            if self.done is not None:
                self.done()
        layout = "checkpoint" if plan.original_format else "runtime"
        logger.info("Saved %d tensors to %s (%s layout)", len(tensors), directory, layout)
        return files
