"""Collective save of a sharded model (FSDP2, DTensor, tensor parallel): every rank writes its own rows.

``modelpatch.save_pretrained(model, directory)``, called on every rank of a model whose parameters are ``DTensor``s,
writes the same files as the save of the same model unsharded, byte for byte, without gathering the model anywhere:

1. every rank plans the checkpoint layout from the full shapes alone (the load's recorded groups reversed, as an
   unsharded save plans it) and runs the same checks as an unsharded save;
2. rank 0 creates the files in a temporary sibling directory at their final sizes, with their headers
   (``checkpoint/writer.py``'s :func:`~modelpatch.checkpoint.writer.write_presized_checkpoint`), and tells every rank
   where each tensor's bytes lie (``broadcast_object_list``);
3. each rank writes the rows it holds, converted back: a tensor read unchanged is written as its rows; a row range of
   a fused ``q/k/v`` or ``gate/up`` weight is the matching row ranges of ``q``, ``k``, ``v``; rows of stacked experts
   are whole experts. A group whose reverse is not row by row (or a parameter sharded along another dim) is gathered
   on every rank (``DTensor.full_tensor``, one group at a time) and written by one rank. A replicated tensor is
   written by one rank;
4. every rank reports how its writes went (``all_gather_object``); rank 0 swaps the directory in only if all
   succeeded, atomically as every save, and tells the others.

Every rank must share the file system the directory is on (one machine, or a shared file system).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from ..checkpoint.writer import TensorPlaces, write_at, write_presized_checkpoint
from ..conversion.operations import Chunk, SplitModulelist, run_operations
from ..conversion.planner import ConversionGroup, ConversionPlan
from ..errors import SaveError
from ..state import model_record
from .distributed import Rows, local_part, local_rows, part_offsets
from .parallel import gather_state
from .save_contents import config_files, model_layout, saved_state

logger = logging.getLogger(__name__)


def _stand_in(tensor: torch.Tensor, parts: Mapping[str, tuple[int, ...]], key: str) -> torch.Tensor:
    """A meta tensor of ``tensor``'s full shape and dtype (a tensor-parallel part-sharded one: its parts' sum)."""
    shape = (sum(parts[key]), *tensor.shape[1:]) if key in parts else tuple(tensor.shape)
    return torch.empty(shape, dtype=tensor.dtype, device="meta")


def _splits_rows(group: ConversionGroup) -> bool:
    """Whether ``group`` (runtime -> checkpoint) splits one tensor along dim 0: rows of it are rows of the parts."""
    ops = group.operations
    return (
        len(group.sources) == 1
        and isinstance(group.sources[0], str)
        and len(ops) == 1
        and isinstance(ops[0], Chunk)
        and ops[0].sizes is not None
        and isinstance(group.source_shapes[0], tuple)
        and ops[0].dim % len(group.source_shapes[0]) == 0
    )


def _unstacks_rows(group: ConversionGroup) -> bool:
    """Whether ``group`` (runtime -> checkpoint) only splits along dims other than 0 and then unstacks dim 0 (stacked
    experts back to one tensor per expert): rows ``a:b`` of its sources are the entries ``a..b-1`` of its outputs."""
    *rest, last = group.operations
    if not isinstance(last, SplitModulelist) or not all(isinstance(s, str) for s in group.sources):
        return False
    if not all(isinstance(slot, tuple) for slot in group.targets):
        return False
    rank = len(group.source_shapes[0])  # type: ignore[arg-type]
    return last.dim % rank == 0 and all(isinstance(op, Chunk) and not op.indexed and op.dim % rank for op in rest)


class _Pieces:
    """Writes this rank's pieces of the checkpoint tensors into the pre-sized files; an error stops the writing but
    not the collectives, which every rank must still join in the same order."""

    def __init__(self, places: TensorPlaces, layout: Mapping[str, torch.Tensor]):
        self.places = places
        self.layout = layout
        self.fds: dict[Path, int] = {}
        self.error: str | None = None

    def put(self, key: str, row: int, tensor: torch.Tensor) -> None:
        """Write ``tensor``, rows ``row..`` of checkpoint tensor ``key``."""
        if self.error is not None:
            return
        meta = self.layout[key]
        try:
            if tensor.dtype != meta.dtype or tuple(tensor.shape[1:]) != tuple(meta.shape[1:]):
                raise SaveError(
                    f"{key}: rows of {tensor.dtype} {list(tensor.shape)} do not fit {meta.dtype} {list(meta.shape)}"
                )
            path, offset = self.places[key]
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_WRONLY)
            row_bytes = math.prod(meta.shape[1:]) * meta.element_size() if meta.ndim else 0
            write_at(self.fds[path], offset + row * row_bytes, tensor)
        except Exception as exc:  # whatever it is, this rank must go on to the collectives the others wait in
            self.fail(f"cannot write {key}: {exc}")

    def fail(self, message: str) -> None:
        """Note this rank's first failure; the save goes on through its collectives and is refused at the end."""
        if self.error is None:
            self.error = f"rank {dist.get_rank()}: {message}"

    def converted(self, group: ConversionGroup, convert: Callable[[], Any]) -> Any:
        """``convert()`` (local work of one rank: no collective), or None when it fails (the failure is noted)."""
        if self.error is not None:
            return None
        try:
            return convert()
        except Exception as exc:  # as in put: the other ranks must not be left waiting in a collective
            self.fail(f"cannot convert {group.target_keys()} back to {group.sources_summary()}: {exc}")
            return None

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                if self.error is None:
                    os.fsync(fd)
            except OSError as exc:
                self.error = f"rank {dist.get_rank()}: cannot sync its writes: {exc}"
            finally:
                os.close(fd)


class ShardedState:
    """A sharded model's state, the checkpoint layout it is written in, and each rank's part of it."""

    def __init__(self, model: PreTrainedModel, state: Mapping[str, torch.Tensor], *, original_format: bool):
        self.model = model
        record = model_record(model)
        self.parts: dict[str, tuple[int, ...]] = dict((record and record.tensor_parallel_parts) or {})
        stand_ins = {key: _stand_in(tensor, self.parts, key) for key, tensor in state.items()}
        self.state = saved_state(model, state, full=stand_ins)
        stand_ins = {key: stand_ins[key] for key in self.state}
        if original_format:
            self.plan = model_layout(model, stand_ins)
        else:
            self.plan = ConversionPlan(direct={key: key for key in self.state})
        self.layout: dict[str, torch.Tensor] = {ckpt: stand_ins[runtime] for ckpt, runtime in self.plan.direct.items()}
        for group in self.plan.groups:
            dtype = stand_ins[group.source_keys()[0]].dtype
            for key, meta in group.target_metas().items():
                self.layout[key] = torch.empty(meta.shape, dtype=dtype, device="meta")

    def rows(self, key: str) -> Rows | None:
        return None if key in self.parts else local_rows(self.state[key])

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` on every rank (a collective for a sharded one)."""
        tensor = self.state[key]
        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
        if key in self.parts:
            return gather_state(self.model, {key: tensor})[key]
        return tensor

    def write(self, pieces: _Pieces) -> None:
        """Write this rank's pieces of every checkpoint tensor (every rank calls it: gathering is collective)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for index, (ckpt, runtime) in enumerate(self.plan.direct.items()):
                rows = self.rows(runtime)
                if rows is not None:
                    if rows.writes:
                        pieces.put(ckpt, rows.start, local_part(self.state[runtime]))
                    continue
                full = self.full(runtime)
                if index % world == rank:
                    pieces.put(ckpt, 0, full)
            for index, group in enumerate(self.plan.groups):
                sources = group.source_keys()
                rows_of = {self.rows(key) for key in sources}
                rows = rows_of.pop() if len(rows_of) == 1 else None
                if rows is not None and _splits_rows(group):
                    if rows.writes:
                        local = local_part(self.state[sources[0]])
                        sizes = group.operations[0].sizes  # type: ignore[attr-defined]
                        for key, offset, size in zip(group.target_keys(), part_offsets(sizes), sizes, strict=True):
                            window = rows.window(offset, size)
                            if window is not None:
                                start = offset + window[0] - rows.start
                                pieces.put(key, window[0], local[start : start + window[1] - window[0]])
                    continue
                if rows is not None and _unstacks_rows(group):
                    if rows.writes:
                        outputs = pieces.converted(
                            group,
                            partial(
                                run_operations,
                                list(group.operations),
                                [local_part(self.state[key]) for key in sources],
                            ),
                        )
                        for keys, entries in zip(group.targets, outputs or (), strict=False):
                            for position, tensor in enumerate(entries):
                                pieces.put(keys[rows.start + position], 0, tensor)  # type: ignore[index]
                    continue
                # Not row by row: the group's sources gathered on every rank, converted and written by one.
                fulls = {key: self.full(key) for key in sources}
                if index % world == rank:
                    converted = pieces.converted(group, partial(group.run, fulls.__getitem__))
                    for key, tensor in (converted or {}).items():
                        pieces.put(key, 0, tensor)
                del fulls


def save_sharded(
    model: PreTrainedModel, path: str | Path, *, save_original_format: bool, max_shard_size: int | str
) -> list[Path]:
    """Save a sharded ``model`` (``DTensor`` parameters: FSDP2, tensor parallelism) collectively: call it on every rank.

    What :func:`modelpatch.save_pretrained` does for such a model (see the module docstring): the files are those an
    unsharded save of the same model writes, byte for byte; no rank holds more than its shards and one gathered group.

    Returns:
        The files written (on every rank).

    Raises:
        SaveError: What an unsharded save refuses (on every rank, before anything is written), a quantized model, or
            a rank that could not write its part (the previous checkpoint is left in place, on every rank).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise SaveError(
            f"{type(model).__name__} holds DTensor parameters but no process group is initialised: a sharded model "
            "is saved by every rank of its process group (torch.distributed.init_process_group)."
        )
    record = model_record(model)
    if record is not None and record.quantization is not None:
        raise SaveError(f"{type(model).__name__} is quantized: modelpatch does not save quantized sharded models.")
    sharded = ShardedState(model, model.state_dict(), original_format=save_original_format)
    extra_files = config_files(model, original_format=save_original_format)
    written = _write_collectively(Path(path), sharded, extra_files, max_shard_size)
    layout = "checkpoint" if save_original_format else "runtime"
    logger.info("Saved %d tensors to %s collectively (%s layout)", len(sharded.layout), path, layout)
    return written


def _write_collectively(
    directory: Path, sharded: ShardedState, extra_files: Mapping[str, bytes], max_shard_size: int | str
) -> list[Path]:
    """Rank 0 writes the files' frames and swaps them in; every rank writes its pieces in between."""

    def broadcast(message: Any = None) -> Any:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def write_pieces(places: TensorPlaces) -> str | None:
        """Every rank's writes; what failed on any rank (every rank learns it), else None."""
        pieces = _Pieces(places, sharded.layout)
        try:
            sharded.write(pieces)
        except Exception as exc:  # a failed collective: the others failed in it too, or they learn it below
            pieces.fail(str(exc))
        finally:
            pieces.close()
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, pieces.error)
        failed = [error for error in errors if error is not None]
        return f"Cannot save to {directory}; nothing was replaced: " + "; ".join(failed) if failed else None

    if dist.get_rank() != 0:
        # Rank 0 says where to write (or why not), then, whatever happened, how the save ended.
        kind, content = broadcast()
        if kind == "abort":
            raise SaveError(content)
        write_pieces(content)
        kind, content = broadcast()
        if kind == "abort":
            raise SaveError(content)
        return [Path(name) for name in content]

    def fill(places: TensorPlaces) -> None:
        broadcast(("write", places))
        failed = write_pieces(places)
        if failed is not None:
            raise SaveError(failed)

    try:
        files = write_presized_checkpoint(
            directory, sharded.layout, fill, extra_files=extra_files, max_shard_size=max_shard_size
        )
    except BaseException as exc:
        message = str(exc) if isinstance(exc, SaveError) else f"Rank 0 could not save to {directory}: {exc}"
        broadcast(("abort", message))  # before the pieces were asked for, or after them: the others wait for it
        raise
    broadcast(("done", [str(file) for file in files]))
    return files
