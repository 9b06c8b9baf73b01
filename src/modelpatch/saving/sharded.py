"""Collective save of a sharded model (FSDP2, DTensor, tensor parallel): every rank writes its own rows.

The save's own mode for ``DTensor`` parameters (:class:`ShardedTensors`, the last of every save's modes) names this
module's writer (:class:`CollectiveWriter`) for a model that holds them; the stages are every save's
(``stages.py``). ``modelpatch.save_pretrained(model, directory)``, called on every rank of such a model, writes
the same files as the save of the same model unsharded, byte for byte, without gathering the model anywhere:

1. every rank plans the save from the full shapes alone (the tensors modes take: the load's recorded groups reversed,
   as an unsharded save plans it) and runs the same checks as an unsharded save (a PEFT model refused among them);
   the ranks then compare what they would write (every key, dtype, shape and source, the fusions, the config files:
   a digest, met in the process group's store before any collective, ``agreement.py``), and refuse together, before
   anything is touched, when a rank's checks failed, a rank runs another save (``model.save_pretrained``, or a save
   of a model not sharded on it) or never starts one (within ``MODELPATCH_SAVE_JOIN_TIMEOUT`` seconds, default 60),
   or the plans differ (ranks holding differently fused models would otherwise each write their own rows of another
   layout into the same files);
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

A rank whose local work fails goes on through the collectives the others wait in, and the save is refused on every
rank at the end. A rank that stops (interrupted, killed) breaks the process group instead: the others' next collective
fails (gloo: "Connection closed by peer", or the group's timeout), which they raise as a :class:`SaveError` saying so
and whether the previous checkpoint is intact — it is, unless rank 0 had already swapped the new one in.

Every rank must share the file system the directory is on (one machine, or a shared file system).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from ..checkpoint.writer import TensorPlaces, parse_size, write_at, write_presized_checkpoint
from ..conversion.operations import Chunk, SplitModulelist, run_operations
from ..conversion.planner import ConversionGroup
from ..errors import SaveError
from ..fusions.sharding import FusedParts
from ..modes.distributed import Rows, is_fully_sharded, local_rows
from ..state import stored_fusion_config
from .agreement import Report, meet
from .contents import config_files
from .plan import SaveMode, SavePlan, SaveWriter

logger = logging.getLogger(__name__)


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


class ShardedTensors(SaveMode):
    """The save's own mode for ``DTensor`` parameters (FSDP2's ``fully_shard``, tensor parallelism once loaded, a
    model sharded by hand), whatever loaded the model: the last of every save's modes.

    Such a model is written collectively (:class:`CollectiveWriter`); each ``DTensor`` is taken with its full shape
    and the rows this rank holds, and goes out as its local rows or, where the writer asks for it whole, gathered.
    """

    def save_writer(self, model: PreTrainedModel) -> SaveWriter | None:
        return CollectiveWriter(model) if is_fully_sharded(model) else None

    def plan_save(self, plan: SavePlan) -> None:
        for key, tensor in plan.state.items():
            if isinstance(tensor, DTensor):
                spread = f"{', '.join(map(str, tensor.placements))} over a mesh of {tuple(tensor.device_mesh.shape)}"
                full = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
                plan.take(key, full, rows=local_rows(tensor), spread=spread)

    def save_tensor(self, plan: SavePlan, key: str, tensor: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return tensor
        return tensor.to_local() if rows is not None else tensor.full_tensor()

    def save_group(self, plan: SavePlan, group: ConversionGroup) -> dict[str, torch.Tensor] | None:
        """A fused ``q/k/v`` or ``gate/up`` of FSDP2's ``Shard(0)`` (a group splitting one tensor by rows) gathered
        part by part: each part's rows come from the ranks holding them, so no rank gathers the fused tensor whole
        (a collective: every rank of the mesh runs it). None for any other group."""
        source = group.source_keys()[0]
        tensor = plan.written()[source]
        rows = plan.rows(source)
        if not (_splits_rows(group) and isinstance(tensor, DTensor) and rows is not None):
            return None
        shards = [dim for dim, placement in enumerate(tensor.placements) if placement.is_shard()]
        if len(shards) != 1:
            return None
        local = plan.fetch(source, rows)
        parts = group.operations[0].sizes  # type: ignore[attr-defined]  # a Chunk with sizes: _splits_rows
        outputs, start = {}, 0
        for key, size in zip(group.target_keys(), parts, strict=True):
            outputs[key] = _gathered_rows(tensor, shards[0], local, rows, start, start + size)
            start += size
        return outputs


def _gathered_rows(tensor: DTensor, dim: int, local: torch.Tensor, rows: Rows, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``tensor`` (sharded by rows along mesh dimension ``dim``, replicated along the others;
    this rank holds ``local``, its ``rows``), on every rank: each rank holding some of them broadcasts them over
    that mesh dimension's group (a collective of every rank of the mesh), so only these rows move.

    Which rows each rank holds follows from the full size alone: ``Shard(0)`` splits as ``torch.chunk`` does (blocks
    of ``ceil(rows / ranks)``, the last ones shorter or empty)."""
    mesh = tensor.device_mesh
    group, ranks, mine = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    total = tensor.shape[0]
    block = -(-total // ranks)
    if rows.start != min(mine * block, total):
        raise SaveError(f"rows {rows.start}:{rows.stop} of a tensor of {total} rows are not torch.chunk's block {mine}")
    pieces = []
    for index in range(ranks):
        first, last = max(start, index * block), min(stop, (index + 1) * block, total)
        if first >= last:
            continue
        if index == mine:
            piece = local[first - rows.start : last - rows.start].contiguous()
        else:
            piece = torch.empty((last - first, *local.shape[1:]), dtype=local.dtype, device=local.device)
        dist.broadcast(piece, src=dist.get_global_rank(group, index), group=group)
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class ShardedState:
    """A sharded model's save plan, the checkpoint layout it is written in, and each rank's part of it."""

    def __init__(self, save: SavePlan):
        self.save = save
        self.plan = save.layout
        self.layout: dict[str, torch.Tensor] = save.checkpoint_metas()

    def _shape(self, key: str) -> str:
        meta = self.layout[key]
        return f"{str(meta.dtype).removeprefix('torch.')} {list(meta.shape)}"

    def entries(self) -> list[tuple[str, str]]:
        """What this rank writes, in the order :meth:`write` writes it (the order of its collectives): each checkpoint
        tensor's dtype and shape (its bytes' places follow from them) and where it comes from. Ranks holding the same
        model, built the same way, give the same list."""
        entries = [
            (ckpt, f"{self._shape(ckpt)}, {runtime} as it is ({self.save.spread(runtime)})")
            for ckpt, runtime in self.plan.direct.items()
        ]
        for group in self.plan.groups:
            sources = group.source_keys()
            # One description per group, shared by its targets (pickled once); past the few keys it names, a digest
            # covers every source key.
            named = group.sources_summary()
            if len(sources) > 3:
                digest = hashlib.sha256(json.dumps(sources).encode()).hexdigest()[:16]
                named += f" ({len(sources)} keys, digest {digest})"
            spreads = "; ".join(sorted({self.save.spread(key) for key in sources}))
            how = f"converted from {named} ({spreads}) by {list(group.operations)}"
            entries.extend((key, f"{self._shape(key)}, {how}") for key in group.target_keys())
        return entries

    def rows(self, key: str) -> Rows | None:
        return self.save.rows(key)

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` on every rank (a collective for a sharded one)."""
        return self.save.fetch(key)

    def local(self, key: str, rows: Rows) -> torch.Tensor:
        """This rank's ``rows`` of tensor ``key``."""
        return self.save.fetch(key, rows)

    def write(self, pieces: _Pieces) -> None:
        """Write this rank's pieces of every checkpoint tensor (every rank calls it: gathering is collective)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for index, (ckpt, runtime) in enumerate(self.plan.direct.items()):
                rows = self.rows(runtime)
                if rows is not None:
                    if rows.writes:
                        pieces.put(ckpt, rows.start, self.local(runtime, rows))
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
                        local = self.local(sources[0], rows)
                        parts = FusedParts(tuple(group.operations[0].sizes))  # type: ignore[attr-defined]
                        for held in parts.held(rows.start, rows.stop):
                            pieces.put(group.target_keys()[held.part], held.start, local[held.shard])
                    continue
                if rows is not None and _unstacks_rows(group):
                    if rows.writes:
                        outputs = pieces.converted(
                            group,
                            partial(
                                run_operations,
                                list(group.operations),
                                [self.local(key, rows) for key in sources],
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


class CollectiveWriter(SaveWriter):
    """Every rank writes its own rows of the checkpoint into files pre-sized by rank 0 (the module docstring)."""

    writes_rows = True

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def write(self, directory: str | Path, planned: Callable[[], SavePlan], max_shard_size: int | str) -> list[Path]:
        """Save collectively: call it on every rank.

        The files are those an unsharded save of the same model writes, byte for byte; no rank holds more than its
        shards and one gathered group.

        Returns:
            The files written (on every rank).

        Raises:
            SaveError: What an unsharded save refuses (on every rank, before anything is written: a rank whose own
                checks failed raises its own error), ranks that would write different checkpoints (the same message
                on every rank, naming the ranks and the first difference), a quantized model, a rank that could not
                write its part (the previous checkpoint is left in place, on every rank), or a rank that stopped
                during the save (the message says whether rank 0 may have swapped the new checkpoint in already;
                either is whole).
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise SaveError(
                f"{type(self.model).__name__} holds DTensor parameters but no process group is initialised: a sharded "
                "model is saved by every rank of its process group (torch.distributed.init_process_group)."
            )
        directory = Path(directory).absolute()
        entries: list[tuple[str, str]] = []
        failure: Exception | None = None
        try:
            plan = planned()
            sharded = ShardedState(plan)
            extra_files = config_files(plan.model, original_format=plan.original_format)
            entries = _save_entries(plan, sharded, extra_files, directory, max_shard_size)
        except Exception as exc:  # refused on every rank together: the others must not go on to collectives alone
            failure = exc
        agree(directory, COLLECTIVE_SAVE, entries, failure)
        written = _write_collectively(directory, sharded, extra_files, max_shard_size)
        layout = "checkpoint" if plan.original_format else "runtime"
        logger.info("Saved %d tensors to %s collectively (%s layout)", len(sharded.layout), directory, layout)
        return written


def _save_entries(
    plan: SavePlan,
    sharded: ShardedState,
    extra_files: Mapping[str, bytes],
    directory: Path,
    max_shard_size: int | str,
) -> list[tuple[str, str]]:
    """Everything that decides the bytes this rank writes, entry by entry (what the ranks compare before saving)."""
    fusions = stored_fusion_config(plan.model.config)
    files = [
        (name, f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}")
        for name, data in sorted(extra_files.items())
    ]
    return [
        ("fusions", "none" if fusions is None else json.dumps(fusions, sort_keys=True)),
        ("layout", "original" if plan.original_format else "runtime"),
        ("directory", str(directory)),
        ("max_shard_size", f"{parse_size(max_shard_size, context=directory)} bytes"),
        *files,
        *sharded.entries(),
    ]


# What a rank that saw a collective of the save fail can say of the directory, by how far the save had gone.
_INTACT = "Nothing was replaced: the previous checkpoint in {directory}, if any, is intact."
_SWAPPED_OR_NOT = (
    "Every rank had written its part: {directory} holds either the previous checkpoint or the new one, whole (rank 0 "
    "swaps it in atomically, and may have done so before it stopped)."
)
_SAVED = "The new checkpoint was already swapped in: {directory} holds it, whole."


def _collective(call: Callable[[], Any], directory: Path, outcome: str) -> Any:
    """``call()`` (a collective of the save), its failure raised as a :class:`SaveError` saying what it means.

    A collective fails when a peer rank stops (interrupted, killed, crashed: gloo says "Connection closed by peer")
    or does not reach it within the process group's timeout; a rank whose own work failed still joins them all
    (:class:`_Pieces`), so a failed collective means a rank stopped. ``outcome`` says what that leaves in
    ``directory`` at this point of the save.
    """
    try:
        return call()
    except RuntimeError as exc:  # gloo's and NCCL's errors (DistBackendError is a RuntimeError)
        raise SaveError(
            f"Cannot save to {directory}: a peer rank failed or was interrupted during the collective save (rank "
            f"{dist.get_rank()} saw its collective fail: {exc}). " + outcome.format(directory=directory)
        ) from exc


def _gather_all(value: Any, directory: Path, outcome: str) -> list[Any]:
    """Every rank's ``value``, in rank order (``all_gather_object`` on the default group)."""
    values: list[Any] = [None] * dist.get_world_size()
    _collective(partial(dist.all_gather_object, values, value), directory, outcome)
    return values


COLLECTIVE_SAVE = "modelpatch.save_pretrained (each rank writes its rows)"
STOCK_SAVE = "model.save_pretrained (the shards gathered on every rank, stock transformers writes)"


def agree(directory: Path, save: str, entries: list[tuple[str, str]], failure: Exception | None) -> None:
    """Go on only if every rank runs the same ``save`` into ``directory``, planned it (``failure`` None) and planned
    the same ``entries``; else raise on every rank, before anything is touched: ``failure`` on a rank that had one,
    a :class:`SaveError` naming the failed ranks and their reasons, the ranks running another save, or the ranks whose
    plans differ (the same message on every rank) on the others.

    The ranks meet in the process group's store, not in a collective (``agreement.py``): a rank that refused, or
    runs another save, is known at once; one that never starts the save, within ``agreement.join_timeout()``.
    """
    digest = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    refused = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports = meet(directory, Report(save, str(directory), digest=digest, refused=refused))
    if failure is not None:
        raise failure
    failed = [f"rank {rank}: {report.refused}" for rank, report in enumerate(reports) if report.refused is not None]
    if failed:
        raise SaveError(
            f"Cannot save to {directory}; nothing was replaced: another rank refused it. " + "; ".join(failed)
        )
    calls = [(report.save, report.directory) for report in reports]
    if len(set(calls)) > 1:
        raise SaveError(
            f"Cannot save to {directory}; nothing was replaced: the ranks called different saves (a sharded model is "
            "saved by every rank calling the same save of the same directory): "
            + "; ".join(f"rank {rank}: {save} into {where}" for rank, (save, where) in enumerate(calls))
        )
    digests = [report.digest for report in reports]
    if len(set(digests)) == 1:
        return
    # Only now the whole plans: the first difference between rank 0's and each other one.
    plans = _gather_all(entries, directory, _INTACT)
    differing: dict[str, list[int]] = {}
    for rank, rank_digest in enumerate(digests):
        if rank_digest != digests[0]:
            differing.setdefault(rank_digest, []).append(rank)
    differences = [
        f"{_ranks(ranks)} differ{'s' if len(ranks) == 1 else ''} from rank 0 in "
        + _first_difference(plans[0], plans[ranks[0]], ranks[0])
        for ranks in differing.values()
    ]
    raise SaveError(
        f"Cannot save to {directory}; nothing was replaced: the ranks would write different checkpoints (a collective "
        "save needs the same model, built with the same fusions, and the same arguments on every rank): "
        + "; ".join(differences)
    )


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _first_difference(ours: Sequence[tuple[str, str]], theirs: Sequence[tuple[str, str]], rank: int) -> str:
    """The first entry of rank 0's plan ``ours`` that rank ``rank``'s plan ``theirs`` lacks or gives otherwise."""
    mine, other = dict(ours), dict(theirs)
    for name, value in ours:
        if other.get(name) != value:
            return f"{name}: rank 0: {value}; rank {rank}: {other.get(name, 'not written')}"
    for name, value in theirs:
        if name not in mine:
            return f"{name}: rank 0: not written; rank {rank}: {value}"
    # The same entries in another order: the ranks would gather (collectives) in another order.
    first = next((index for index, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a[0] != b[0]), 0)
    return f"the order of the writes: rank 0 writes {ours[first][0]} where rank {rank} writes {theirs[first][0]}"


def _write_collectively(
    directory: Path, sharded: ShardedState, extra_files: Mapping[str, bytes], max_shard_size: int | str
) -> list[Path]:
    """Rank 0 writes the files' frames and swaps them in; every rank writes its pieces in between."""

    def broadcast(outcome: str, message: Any = None) -> Any:
        box = [message]
        _collective(partial(dist.broadcast_object_list, box, src=0), directory, outcome)
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
        # Rank 0 swaps only once it has every rank's report: a rank that cannot gather them knows it has not.
        errors = _gather_all(pieces.error, directory, _INTACT)
        failed = [error for error in errors if error is not None]
        return f"Cannot save to {directory}; nothing was replaced: " + "; ".join(failed) if failed else None

    if dist.get_rank() != 0:
        # Rank 0 says where to write (or why not), then, whatever happened, how the save ended.
        kind, content = broadcast(_INTACT)
        if kind == "abort":
            raise SaveError(content)
        write_pieces(content)
        kind, content = broadcast(_SWAPPED_OR_NOT)
        if kind == "abort":
            raise SaveError(content)
        return [Path(name) for name in content]

    # What the directory holds if rank 0 stops now, while the other ranks wait in a broadcast from rank 0 (to learn
    # where to write, or how the save ended) and must be told why; None while they are in the writes' collectives,
    # where a broadcast would not meet theirs (they learn it from their next collective failing).
    stage: str | None = _INTACT

    def fill(places: TensorPlaces) -> None:
        nonlocal stage
        stage = None  # already: once the broadcast has begun, the others may be past its first collective
        broadcast(_INTACT, ("write", places))
        failed = write_pieces(places)
        stage = _INTACT if failed is not None else _SWAPPED_OR_NOT
        if failed is not None:
            raise SaveError(failed)

    try:
        files = write_presized_checkpoint(
            directory, sharded.layout, fill, extra_files=extra_files, max_shard_size=max_shard_size
        )
    except BaseException as exc:
        if stage is not None:
            _abort(directory, exc, stage.format(directory=directory))
        raise
    broadcast(_SAVED, ("done", [str(file) for file in files]))
    return files


def _abort(directory: Path, exc: BaseException, outcome: str) -> None:
    """Rank 0: tell the other ranks, waiting in a broadcast, why the save stopped (``exc``) and what ``directory``
    holds (``outcome``)."""
    if isinstance(exc, SaveError):  # it says what was replaced
        message = str(exc)
    elif isinstance(exc, Exception):
        message = f"Rank 0 could not save to {directory}: {str(exc).rstrip('.')}. {outcome}"
    else:  # KeyboardInterrupt, SystemExit
        message = (
            f"Cannot save to {directory}: rank 0 was interrupted ({type(exc).__name__}) during the collective save. "
            + outcome
        )
    try:
        dist.broadcast_object_list([("abort", message)], src=0)
    except RuntimeError as failure:  # the others are gone too: rank 0's own error is the one to raise
        logger.warning("Could not tell the other ranks why the save to %s stopped: %s", directory, failure)
