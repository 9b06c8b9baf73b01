"""The files of a checkpoint directory, named and read without torch: the layouts' file names, a shard index's
``weight_map``, the bound on a safetensors header, the file a load reads first, and where symlinks may lead its
files.

Kept apart from :mod:`~modelpatch.checkpoint.checkpoint` (which maps tensors, and so imports torch) for the code that
must run before torch is imported: the checkpoint prefetch starts at the top of ``from_pretrained``, while torch and
transformers are still being imported.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from modelpatch.errors import CheckpointError

from .json_file import MAX_INDEX_BYTES, read_json

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"

ENTRY_FILES = (SAFE_INDEX, SAFE_SINGLE, PICKLE_INDEX, PICKLE_SINGLE)
"""The files a load of a checkpoint directory looks for, in the order it does: the first the directory holds is the
checkpoint's entry file. A load holds a shared ``flock`` on it while it opens the checkpoint, and a save removes a
version it replaced only under an exclusive one (``writer.py``): the lock is on this file, not on the directory,
whose own ``flock`` is a save's lock on its parent (a save into ``out/checkpoint-500`` must not stall loads of
``out``)."""

MAX_HEADER_BYTES = 100_000_000
"""Upper bound on a safetensors file's JSON header length; the safetensors reference implementation uses the same."""


def read_weight_map(index_path: Path, fd: int | None = None) -> dict[str, str]:
    """The ``weight_map`` of shard index ``index_path`` (read from ``fd``, which is then closed, when given), read
    with the bounds of :func:`~modelpatch.checkpoint.json_file.read_json` before it is parsed.

    Raises:
        CheckpointError: naming the index, when it is too large, nests too deeply, is not JSON or has no
            ``weight_map`` of tensor key to shard file name.
    """
    index = read_json(index_path, MAX_INDEX_BYTES, fd)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index_path}: 'weight_map' must be a JSON object of tensor key to shard file name")
    return weight_map


def symlink_escape(directory: Path, name: str) -> Path | None:
    """Where file ``name`` of checkpoint ``directory`` leads if symlinks take it outside the places a load of it may
    read, else None.

    A symlink may lead anywhere inside the directory and, in a huggingface_hub cache snapshot
    (``models--org--name/snapshots/<commit>/``, whose files are links to ``../../blobs/<hash>``), into that
    repository's ``blobs/``. Anything else would make the checkpoint's content depend on files its directory does not
    hold: the load refuses it unless ``allow_external_symlinks`` says the caller vouches for such links, and the
    prefetch reads nothing of it.

    The repository is the one the path names where it names one, before any link is followed: a snapshot folder that
    is itself a link into another repository does not make that one's blobs readable.
    """
    target = (directory / name).resolve()
    root = directory.resolve()
    blobs = _repository_blobs(Path(os.path.abspath(directory))) or _repository_blobs(root)
    roots = [root] if blobs is None else [root, blobs.resolve()]
    return None if any(target.is_relative_to(allowed) for allowed in roots) else target


def _repository_blobs(folder: Path) -> Path | None:
    """The ``blobs/`` of the huggingface_hub cache repository ``folder`` is a snapshot (or lies in one) of, or None."""
    for inside in (folder, *folder.parents):
        if inside.parent.name == "snapshots" and inside.parent.parent.name.startswith("models--"):
            return inside.parent.parent / "blobs"
    return None


def open_entry_file(directory_fd: int) -> int | None:
    """A read-only descriptor of the entry file (:data:`ENTRY_FILES`) of the checkpoint directory open as
    ``directory_fd`` (the first it holds as a regular file, as the load looks for them), or None where it holds
    none."""
    for name in ENTRY_FILES:
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0), dir_fd=directory_fd)  # never block on a FIFO
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
        os.close(fd)  # as the load does, it looks for the next one
    return None
