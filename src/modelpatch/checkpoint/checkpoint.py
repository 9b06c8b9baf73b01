"""A checkpoint directory: one safetensors file, a sharded safetensors index, or (opt-in) a pickle checkpoint."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from modelpatch.errors import CheckpointError

try:
    import fcntl
except ImportError:  # not POSIX: no locks; a version removed while it is being opened is opened again
    fcntl = None  # type: ignore[assignment]

from .file_range import FileRange
from .layout import (
    PICKLE_INDEX,
    PICKLE_SINGLE,
    SAFE_INDEX,
    SAFE_SINGLE,
    open_entry_file,
    read_weight_map,
    symlink_escape,
)
from .safetensors_file import ClosesOnExit, FileIdentity, SafetensorsFile, TensorInfo, tensor_info

logger = logging.getLogger(__name__)

__all__ = ["PICKLE_INDEX", "PICKLE_SINGLE", "SAFE_INDEX", "SAFE_SINGLE", "Checkpoint", "read_weight_map"]


class PickleFile(ClosesOnExit):
    """The tensors of one pickle checkpoint file, loaded with ``torch.load(weights_only=True, mmap=True)``.

    Pickle files are read by path (torch maps them itself), so their identity is that of the path.
    """

    def __init__(self, path: Path, state: dict[str, torch.Tensor], identity: FileIdentity) -> None:
        self.path = path
        self.identity = identity
        self.tensors = {key: TensorInfo(key, t.dtype, tuple(t.shape), path, -1, -1) for key, t in state.items()}
        self._state = state

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key`` (a view of torch's memory map of the file)."""
        self.check_unchanged()
        return self._state[key]

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointError` naming the file if it was rewritten since it was loaded."""
        try:
            now = os.stat(self.path)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot check the file: {exc}") from exc
        self.identity.check(self.path, now)

    def close(self) -> None:
        self._state = {}


_Source = SafetensorsFile | PickleFile

_OPEN_ATTEMPTS = 3

_Read = TypeVar("_Read")


class _Directory:
    """Reads the files of one checkpoint directory through one open descriptor of it.

    Every file then comes from the same directory, even if a save replaces the directory at this path while the
    checkpoint is being opened: a checkpoint never mixes files of two versions. And that directory keeps its files
    until they are all open: it holds a shared lock on the checkpoint's entry file (``layout.ENTRY_FILES``) meanwhile,
    and a save removes the version it swapped out only under an exclusive one (``writer.py``). The checkpoint is
    opened whole from the version whose index it read, however many saves come meanwhile. Only a version removed
    before the lock was taken is gone (:meth:`removed`): it is opened again where the path now leads.
    """

    def __init__(self, path: Path, allow_external_symlinks: bool = False) -> None:
        self.path = path
        self.allow_external_symlinks = allow_external_symlinks
        self.fd: int | None = None
        self._held: int | None = None
        if os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            self._held = self._hold(self.fd)
        elif not path.is_dir():
            raise NotADirectoryError(path)

    def _hold(self, fd: int) -> int | None:
        """A descriptor of the entry file holding the shared lock (released when it is closed), or None."""
        if fcntl is None:
            return None
        entry = open_entry_file(fd)
        if entry is not None:
            try:
                fcntl.flock(entry, fcntl.LOCK_SH)
            except OSError as exc:  # a file system without flock: a removed version is opened again, a few times
                logger.debug("%s: cannot lock it while it is opened (%s)", self.path, exc)
        return entry

    @classmethod
    def at(cls, path: Path, allow_external_symlinks: bool) -> _Directory:
        """Open ``path``, refused as not a local directory where it is none."""
        try:
            return cls(path, allow_external_symlinks)
        except OSError:
            raise CheckpointError(
                f"{path}: not a local directory (checkpoints are only read from local directories, never a hub)"
            ) from None

    def stale(self) -> bool:
        """Whether a save replaced the version opened: removed before it was locked, or ``path`` names another."""
        return self.removed() or self.replaced()

    def removed(self) -> bool:
        """Whether the directory opened was removed before it was locked (a save replaced it meanwhile)."""
        return self.fd is not None and os.fstat(self.fd).st_nlink == 0

    def is_file(self, name: str) -> bool:
        try:
            if self.fd is None:
                return (self.path / name).is_file()
            return stat.S_ISREG(os.stat(name, dir_fd=self.fd).st_mode)
        except (OSError, ValueError):
            return False

    def escape(self, name: str) -> Path | None:
        """Where ``name`` leads if symlinks take it outside the places this checkpoint may read
        (:func:`~modelpatch.checkpoint.layout.symlink_escape`), unless ``allow_external_symlinks``; else None."""
        return None if self.allow_external_symlinks else symlink_escape(self.path, name)

    def open(self, name: str) -> int:
        """A read-only descriptor of ``name`` (never blocks on a FIFO)."""
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
        return os.open(self.path / name, flags) if self.fd is None else os.open(name, flags, dir_fd=self.fd)

    def replaced(self) -> bool:
        """Whether ``path`` now names another directory than the one opened."""
        if self.fd is None:
            return False
        try:
            opened, current = os.fstat(self.fd), os.stat(self.path)
        except OSError:
            return False
        return (opened.st_dev, opened.st_ino) != (current.st_dev, current.st_ino)

    def close(self) -> None:
        for fd in (self._held, self.fd):
            if fd is not None:
                os.close(fd)
        self._held = self.fd = None


class Checkpoint(ClosesOnExit):
    """Read-only view of the tensors of a local checkpoint directory.

    Safetensors tensors are zero-copy views of memory-mapped files; pickle tensors are loaded with
    ``torch.load(weights_only=True, mmap=True)``. Each file's identity (device, inode, size, modification and
    status-change times) is recorded when its header is read; a file rewritten in place afterwards is refused when its
    tensors are read and by :meth:`check_unchanged`.
    """

    def __init__(
        self,
        directory: Path,
        infos: dict[str, TensorInfo],
        sources: dict[Path, _Source],
        is_sharded: bool,
    ) -> None:
        self.directory = directory
        self.is_sharded = is_sharded
        self._infos = infos
        self._sources = sources
        self._files = sorted(sources)

    @classmethod
    def open(
        cls, directory: str | Path, *, allow_pickle: bool = False, allow_external_symlinks: bool = False
    ) -> Checkpoint:
        """Open the checkpoint in local ``directory``; pickle checkpoints need ``allow_pickle=True``.

        Symlinked files are followed inside ``directory`` and, for a huggingface_hub cache snapshot, into its
        repository's ``blobs/``; ``allow_external_symlinks=True`` follows them anywhere.
        """
        checkpoint, _ = cls.open_with(
            directory, lambda: None, allow_pickle=allow_pickle, allow_external_symlinks=allow_external_symlinks
        )
        return checkpoint

    @classmethod
    def open_with(
        cls,
        directory: str | Path,
        read: Callable[[], _Read],
        *,
        allow_pickle: bool = False,
        allow_external_symlinks: bool = False,
    ) -> tuple[Checkpoint, _Read]:
        """Open the checkpoint in local ``directory`` as :meth:`open` does, with what ``read()`` reads of the same
        saved version: ``read`` reads the other files of ``directory`` by path (its ``config.json``), and returns
        what it made of them.

        ``read`` runs while the version it reads is held open; if a save swapped another version in meanwhile, it
        runs again on that one, the first still held (so the save that replaced it, which removes it only once
        released, and every later save to the directory, which waits for that one, cannot replace the second
        version meanwhile). The checkpoint is then opened from the version ``read`` read, whole.

        Raises:
            CheckpointError: as :meth:`open`; or saves not taking turns replaced the directory at every try.
        """
        directory = Path(directory)
        handle, previous = _Directory.at(directory, allow_external_symlinks), None
        try:
            for attempt in range(_OPEN_ATTEMPTS):
                try:
                    result = read()
                    if not handle.stale():
                        return cls._open(directory, handle, allow_pickle), result
                except CheckpointError:
                    # A save swapped a new checkpoint in and removed the one being opened: open the new one.
                    if attempt + 1 == _OPEN_ATTEMPTS or not handle.stale():
                        raise
                finally:
                    if previous is not None:
                        previous.close()
                        previous = None
                logger.info("%s was replaced while it was being opened; opening it again", directory)
                previous, handle = handle, _Directory.at(directory, allow_external_symlinks)
            raise CheckpointError(
                f"{directory}: saves replaced it {_OPEN_ATTEMPTS} times while it was being opened (saves that do "
                "not take turns, or a file system without flock): load it again once the saves are done"
            )
        finally:
            for held in (previous, handle):
                if held is not None:
                    held.close()

    @classmethod
    def _open(cls, directory: Path, handle: _Directory, allow_pickle: bool) -> Checkpoint:
        if handle.is_file(SAFE_INDEX):
            _check_symlinks(directory, handle, SAFE_INDEX)
            try:
                checkpoint = cls._open_index(directory, handle, SAFE_INDEX, _load_safetensors)
            except CheckpointError as exc:
                if handle.is_file(SAFE_SINGLE):
                    raise CheckpointError(
                        f"{exc}. {directory} also holds {SAFE_SINGLE}: {_TWO_VERSIONS}, the index most likely the "
                        "stale one here"
                    ) from exc
                raise
            if handle.is_file(SAFE_SINGLE) and directory / SAFE_SINGLE not in checkpoint._sources:
                try:
                    checkpoint._check_one_version(handle)
                except BaseException:
                    checkpoint.close()
                    raise
            return checkpoint
        if handle.is_file(SAFE_SINGLE):
            _check_symlinks(directory, handle, SAFE_SINGLE)
            source: _Source = _load_safetensors(handle, SAFE_SINGLE)
            return cls(directory, dict(source.tensors), {source.path: source}, is_sharded=False)

        pickle_name = next((name for name in (PICKLE_INDEX, PICKLE_SINGLE) if handle.is_file(name)), None)
        if pickle_name is None:
            raise CheckpointError(
                f"{directory}: no checkpoint found (looked for {SAFE_INDEX}, {SAFE_SINGLE}, "
                f"{PICKLE_INDEX}, {PICKLE_SINGLE})"
            )
        pickle_path = directory / pickle_name
        if not allow_pickle:
            raise CheckpointError(
                f"{pickle_path}: pickle checkpoints are refused unless allow_pickle=True (--allow-pickle on the "
                "modelpatch command line); they are then loaded with torch.load(weights_only=True). Prefer safetensors."
            )
        _check_symlinks(directory, handle, pickle_name)
        if pickle_name == PICKLE_INDEX:
            return cls._open_index(directory, handle, PICKLE_INDEX, _load_pickle)
        source = _load_pickle(handle, PICKLE_SINGLE)
        return cls(directory, dict(source.tensors), {pickle_path: source}, is_sharded=False)

    @classmethod
    def _open_index(
        cls,
        directory: Path,
        handle: _Directory,
        index_name: str,
        load: Callable[[_Directory, str], _Source],
    ) -> Checkpoint:
        index_path = directory / index_name
        weight_map = _read_weight_map(handle, index_name)
        logger.debug("%s: read; opening its %d shard(s)", index_path, len(set(weight_map.values())))
        shard_paths = {
            name: _confined_shard(directory, handle, index_path, name) for name in sorted(set(weight_map.values()))
        }

        infos: dict[str, TensorInfo] = {}
        sources: dict[Path, _Source] = {}
        for name, path in shard_paths.items():
            source = load(handle, name)
            sources[path] = source
            for key, info in source.tensors.items():
                if key in infos:
                    raise CheckpointError(
                        f"{index_path}: key {key!r} is stored in both {infos[key].path.name} and {name}"
                    )
                infos[key] = info

        for key, name in weight_map.items():
            found = infos.get(key)
            if found is None or found.path != shard_paths[name]:
                raise CheckpointError(
                    f"{index_path}: key {key!r} is mapped to {name} but that shard has no such tensor"
                )
        unmapped = sorted(set(infos) - set(weight_map))
        if unmapped:
            logger.warning(
                "%s: %d tensor(s) present in shard headers but missing from weight_map, included anyway: %s",
                index_path,
                len(unmapped),
                ", ".join(unmapped[:10]) + (", ..." if len(unmapped) > 10 else ""),
            )
        return cls(directory, infos, sources, is_sharded=True)

    def _check_one_version(self, handle: _Directory) -> None:
        """Refuse a ``model.safetensors`` beside the index this checkpoint was opened from (and not one of its
        shards) when it holds other tensors: two versions, of which stock transformers would load the single file."""
        _check_symlinks(self.directory, handle, SAFE_SINGLE)
        logger.info("%s holds %s and %s: comparing them", self.directory, SAFE_INDEX, SAFE_SINGLE)
        with _load_safetensors(handle, SAFE_SINGLE) as single:
            if {key: (i.dtype, i.shape) for key, i in single.tensors.items()} != {
                key: (i.dtype, i.shape) for key, i in self._infos.items()
            }:
                differs = "their tensors' names, dtypes or shapes differ"
            else:
                differs = next(
                    (
                        f"tensor {key!r} differs"
                        for key in self.keys()
                        if not _same_bytes(self.tensor(key), single.tensor(key))
                    ),
                    "",
                )
        if differs:
            raise CheckpointError(
                f"{self.directory} holds two checkpoints of different versions: {SAFE_INDEX} (and its "
                f"{len(self._sources)} shard(s)) and {SAFE_SINGLE} ({differs}): {_TWO_VERSIONS}"
            )
        logger.debug("%s: %s holds the tensors of %s", self.directory, SAFE_SINGLE, SAFE_INDEX)

    def keys(self) -> list[str]:
        """All tensor keys, sorted."""
        return sorted(self._infos)

    def info(self, key: str) -> TensorInfo:
        """Location, dtype and shape of tensor ``key``."""
        return tensor_info(self._infos, key, self.directory)

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key``; a zero-copy memory-mapped view for safetensors files."""
        info = self.info(key)
        source = self._sources.get(info.path)
        if source is None:
            raise CheckpointError(f"{info.path}: checkpoint is closed (reading {key!r})")
        return source.tensor(key)

    def joined(self, keys: Sequence[str]) -> torch.Tensor | None:
        """Tensors ``keys`` as one flat view of their file, their bytes back to back (their concatenation along dim 0)
        without a copy, when they share a dtype and lie one right after another in one safetensors file in that
        order (:meth:`SafetensorsFile.joined`); None when they do not."""
        paths = {self.info(key).path for key in keys}
        if len(paths) != 1:
            return None
        (path,) = paths
        source = self._sources.get(path)
        if source is None:
            raise CheckpointError(f"{path}: checkpoint is closed (reading {keys[0]!r})")
        return source.joined(keys) if isinstance(source, SafetensorsFile) else None

    def file_range(self, key: str) -> FileRange | None:
        """Where tensor ``key``'s bytes lie in its safetensors file (None for a pickle checkpoint's tensors)."""
        info = self.info(key)
        source = self._sources.get(info.path)
        if source is None:
            raise CheckpointError(f"{info.path}: checkpoint is closed (reading {key!r})")
        return source.file_range(key) if isinstance(source, SafetensorsFile) else None

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointError` naming the first file that was rewritten in place since it was opened.

        Call it once every tensor has been read: data read from a file rewritten meanwhile may mix two versions.
        """
        for path in self.files:
            source = self._sources.get(path)
            if source is None:
                raise CheckpointError(f"{path}: checkpoint is closed")
            source.check_unchanged()

    def hand_over(self, paths: Iterable[Path]) -> dict[Path, SafetensorsFile]:
        """Give the open safetensors files ``paths`` to the caller, who reads them after this checkpoint is closed.

        A disk offload reads weights in place long after the load: through the very files whose headers were
        validated, so every later read is still checked against the identity recorded then. This checkpoint no
        longer reads or closes them (they close when the caller drops them).
        """
        taken: dict[Path, SafetensorsFile] = {}
        for path in paths:
            source = self._sources.get(path)
            if not isinstance(source, SafetensorsFile):
                raise CheckpointError(f"{path}: not an open safetensors file of the checkpoint in {self.directory}")
            taken[path] = source
        for path in taken:
            del self._sources[path]
        return taken

    @property
    def files(self) -> list[Path]:
        """The tensor files of this checkpoint, sorted."""
        return list(self._files)

    @property
    def total_bytes(self) -> int:
        """Sum of the data sizes of all tensors."""
        return sum(info.nbytes for info in self._infos.values())

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of the first safetensors file ({} for pickle checkpoints)."""
        for path in self.files:
            source = self._sources.get(path)
            if isinstance(source, SafetensorsFile):
                return source.metadata
        return {}

    def close(self) -> None:
        """Release open files; tensors already returned stay valid."""
        for source in self._sources.values():
            source.close()
        self._sources = {}

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.directory)!r}, {len(self._infos)} tensors, sharded={self.is_sharded})"


_TWO_VERSIONS = (
    "one was left beside the other by an earlier save of the other layout (stock save_pretrained leaves it); stock "
    f"transformers would load {SAFE_SINGLE}, modelpatch {SAFE_INDEX}. Remove the stale one (a modelpatch save over "
    "the directory leaves one version)"
)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaNs included)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _load_safetensors(handle: _Directory, name: str) -> SafetensorsFile:
    path = handle.path / name
    try:
        fd = handle.open(name)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file: {exc}") from exc
    return SafetensorsFile.from_fd(path, fd)


def _load_pickle(handle: _Directory, name: str) -> PickleFile:
    path = handle.path / name
    try:
        identity = FileIdentity.of(os.stat(path))
        # weights_only=True restricts unpickling to tensors and plain containers: no arbitrary code runs.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: refused or unreadable pickle checkpoint: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a state dict, got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{path}: entry {key!r} is not a tensor ({type(value).__name__}); expected a flat state dict"
            )
    source = PickleFile(path, state, identity)
    source.check_unchanged()  # rewritten while torch.load was reading it
    return source


def _read_weight_map(handle: _Directory, index_name: str) -> dict[str, str]:
    index_path = handle.path / index_name
    try:
        fd = handle.open(index_name)
    except OSError as exc:
        raise CheckpointError(f"{index_path}: cannot read it: {exc}") from exc
    return read_weight_map(index_path, fd)


def _confined_shard(directory: Path, handle: _Directory, index_path: Path, name: str) -> Path:
    """Resolve shard ``name`` and make sure it stays inside ``directory`` (no absolute or ``..`` name, no symlink
    escape)."""
    relative = Path(name)
    if not name or relative.is_absolute() or ".." in relative.parts or "\0" in name:
        raise CheckpointError(
            f"{index_path}: shard name {name!r} must be a relative path inside the directory (no '..' part, no NUL)"
        )
    path = directory / relative
    _check_symlinks(directory, handle, name, f"{index_path}: shard {name!r}")
    if not handle.is_file(name):
        raise CheckpointError(f"{index_path}: shard {name!r} does not exist in {directory}")
    return path


def _check_symlinks(directory: Path, handle: _Directory, name: str, what: str | None = None) -> None:
    """Refuse ``name`` (described as ``what``) when symlinks take it where this checkpoint may not read."""
    target = handle.escape(name)
    if target is not None:
        raise CheckpointError(
            f"{what or directory / name}: resolves through a symlink to {target}, outside {directory} (symlink "
            "escape). Copy the file into the checkpoint directory, or pass allow_external_symlinks=True if you trust "
            "the link."
        )
