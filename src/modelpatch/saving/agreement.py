"""How the ranks of a collective save meet before its first collective, with a wait of their own.

A collective of the process group waits for a rank that never comes until the group's timeout (gloo's 30 minutes,
NCCL's 10), then fails without saying which rank or why; and ranks entering different collectives (one rank in
``modelpatch.save_pretrained``, another in ``model.save_pretrained``, which gathers instead) abort the process. So every
rank of a save of a sharded model first posts, in the process group's key-value store, a report: which save it runs,
into which directory, and whether its own checks passed (with what it would write) or why it refuses. Each then waits
for every other rank's report, for :func:`join_timeout` seconds at most, polling the store (never a collective):

* all reports in: every rank has the same list and decides the same way (``sharded.py``: go on, or refuse naming the
  ranks and their reasons);
* a rank missing at the deadline: the waiting ranks refuse, naming it and, where it said so, what it did instead (a
  save of a model that is not sharded on it, alone). The one decision each save makes in the store (``compare_set``,
  atomic: every rank reads the same) then names the missing ranks, and a rank reaching that save later takes part in
  the next one instead, rather than going on into collectives the others left.

A rank saving a model that is not sharded on it (a lone save, which writes the whole checkpoint itself) while other
ranks wait in a collective save into the same directory refuses and says so in their save, so they refuse at once.

Each process counts the collective saves it took part in, failed or not, and keys its reports by that count; with
the saves given up without a rank skipped by it, the ranks stay in step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from ..errors import SaveError

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_VARIABLE = "MODELPATCH_SAVE_JOIN_TIMEOUT"
"""The environment variable setting :func:`join_timeout` (seconds)."""

DEFAULT_JOIN_TIMEOUT = 60.0
"""How long a rank of a collective save waits for the others to start it, by default (seconds): the skew between
ranks reaching a save (rank 0 logging or evaluating first), not the save's own duration."""

_PREFIX = "modelpatch/save"
_POLL_SECONDS = 0.02
_saves = 0  # the collective saves this process took part in: the key of the next one's reports


@dataclass(frozen=True)
class Report:
    """What one rank posts for a collective save: which save it runs (``save``), where, and what it would write
    (``digest``) or why it refuses (``refused``)."""

    save: str
    directory: str
    digest: str = ""
    refused: str | None = None


def join_timeout() -> float:
    """How long a rank waits for the others to start a collective save: :data:`JOIN_TIMEOUT_VARIABLE`, else
    :data:`DEFAULT_JOIN_TIMEOUT` (seconds).

    Raises:
        SaveError: The variable is set to something else than a positive number.
    """
    text = os.environ.get(JOIN_TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_JOIN_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SaveError(f"{JOIN_TIMEOUT_VARIABLE}={text!r}: must be a positive number of seconds")
    return value


def in_process_group() -> bool:
    """Whether this process is one of several ranks of an initialised default process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _store() -> dist.Store:
    # torch has no public accessor of the default group's store: the torch door reads it.
    from .._torch import default_store

    return default_store()


def _key(save: int, what: str) -> str:
    return f"{_PREFIX}/{save}/{what}"


def meet(directory: Path, report: Report) -> list[Report]:
    """Post this rank's ``report`` and return every rank's, in rank order, once all are in.

    A save the other ranks gave up on before this rank reached it (they timed out waiting for it) is not this
    rank's: it takes part in the next one (the others' next save).

    Raises:
        SaveError: A rank posted none within :func:`join_timeout` (named, with what it said it did instead). Nothing
            was written by this rank.
    """
    global _saves
    timeout = join_timeout()  # refused before anything is posted, on every rank alike
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    save = _saves
    while True:
        decided = _key(save, "decision")
        if store.check([decided]) and rank in json.loads(store.get(decided)).get("missing", ()):
            logger.info("Collective save %d was given up without rank %d: it takes part in the next one", save, rank)
            save += 1
            continue
        _saves = save + 1
        keys = [_key(save, str(peer)) for peer in range(world)]
        store.set(keys[rank], json.dumps(asdict(report)))
        store.set(_waiting(directory), json.dumps({"save": save, "rank": rank}))  # until the save is decided
        deadline = time.monotonic() + timeout
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        missing = [peer for peer in range(world) if not store.check([keys[peer]])]
        proposal = {"go": True} if not missing else {"missing": missing, "by": rank}
        decision = json.loads(store.compare_set(decided, "", json.dumps(proposal)))
        if decision.get("go"):
            return [Report(**json.loads(store.get(key))) for key in keys]
        if rank not in decision["missing"]:
            break
        # Given up on just as this rank posted: the next save is this rank's.
        save += 1
    missing = decision["missing"]
    raise SaveError(
        f"Cannot save to {directory}: {_ranks(missing)} did not start the collective save within {timeout:g} s "
        f"({JOIN_TIMEOUT_VARIABLE}): a sharded model is saved by every rank of its process group, each calling "
        f"the same save. {' '.join(_whereabouts(store, missing, directory))}Nothing was replaced by rank {rank}."
    )


def _whereabouts(store: dist.Store, ranks: Sequence[int], directory: Path) -> list[str]:
    """What each of ``ranks`` said it did instead of a collective save into ``directory`` (:func:`lone_save`)."""
    said = []
    for rank in ranks:
        key = f"{_PREFIX}/lone/{rank}"
        if store.check([key]) and json.loads(store.get(key)).get("directory") == str(directory):
            said.append(
                f"Rank {rank} saved its model alone (it holds no sharded parameters there), writing the whole "
                f"checkpoint into {directory} itself: the directory holds what rank {rank} wrote, if it finished."
            )
        else:
            said.append(f"Rank {rank} never called it (or is still busy elsewhere).")
    return [sentence + " " for sentence in said]


def lone_save(directory: Path, what: str) -> None:
    """Before a save of a model that is not sharded on this rank, written by this rank alone (``what``): refuse it
    where another rank waits in a collective save into the same ``directory``, telling that save why (its ranks then
    refuse at once); else note it, for a collective save into ``directory`` to say what this rank did.

    Raises:
        SaveError: Another rank waits in a collective save into ``directory``.
    """
    if not in_process_group():
        return
    global _saves
    store, rank = _store(), dist.get_rank()
    directory = Path(directory).absolute()
    waiting = json.loads(store.get(_waiting(directory))) if store.check([_waiting(directory)]) else None
    if waiting is not None and not store.check([_key(waiting["save"], "decision")]):
        refused = f"its model holds no sharded parameters: it called {what}, a save by this rank alone"
        store.set(_key(waiting["save"], str(rank)), json.dumps(asdict(Report(what, str(directory), refused=refused))))
        _saves = max(_saves, waiting["save"] + 1)  # that save counts as this rank's: the next ones stay in step
        raise SaveError(
            f"Cannot save to {directory}: rank {waiting['rank']} is saving a sharded model into it collectively, and "
            f"this rank's (rank {rank}) model holds no sharded parameters: a collective save needs the same sharded "
            "model on every rank. Nothing was replaced by this rank."
        )
    store.set(f"{_PREFIX}/lone/{rank}", json.dumps({"directory": str(directory)}))


def _waiting(directory: Path) -> str:
    """The key naming the collective save into ``directory`` ranks last waited in (decided once its decision is)."""
    return f"{_PREFIX}/waiting/{hashlib.sha256(str(directory).encode()).hexdigest()[:32]}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
