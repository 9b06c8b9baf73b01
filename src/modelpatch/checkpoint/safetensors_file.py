"""Header-validated, zero-copy reader for a single ``.safetensors`` file."""

from __future__ import annotations

import logging
import math
import mmap
import os
import stat
import struct
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from modelpatch.checkpoint.file_range import FileRange
from modelpatch.checkpoint.json_file import parse_json
from modelpatch.checkpoint.layout import MAX_HEADER_BYTES
from modelpatch.checkpoint.pages import register_mapping
from modelpatch.errors import CheckpointError

logger = logging.getLogger(__name__)


def _build_dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
    }
    optional = {
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
    }
    for name, attr in optional.items():
        dtype = getattr(torch, attr, None)
        if isinstance(dtype, torch.dtype):
            table[name] = dtype
    return table


SAFETENSORS_DTYPES: dict[str, torch.dtype] = _build_dtype_table()
"""Safetensors dtype strings this reader accepts, mapped to torch dtypes."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: dtype, shape and absolute byte range ``[start, end)`` inside ``path``.

    For tensors that do not come from a safetensors file, ``start`` and ``end`` are -1.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor data in bytes."""
        return self.numel * self.dtype.itemsize


def tensor_info(infos: Mapping[str, TensorInfo], key: str, holder: object) -> TensorInfo:
    """The :class:`TensorInfo` of tensor ``key`` among ``infos``, those of a file or a checkpoint (``holder``).

    Raises:
        CheckpointError: ``holder`` has no tensor ``key`` (naming both).
    """
    info = infos.get(key)
    if info is None:
        raise CheckpointError(f"{holder}: no tensor named {key!r}")
    return info


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ClosesOnExit:
    """``with obj:`` calls ``obj.close()`` on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class FileIdentity:
    """Which file, in which state: device and inode, size, modification and status-change times, link count.

    A file rewritten in place (same name, same inode) changes its status-change time (``st_ctime``), which no one can
    set back, even when its size and modification time are restored afterwards (``rsync --inplace -t``,
    ``touch -r``). A file replaced by a rename keeps the identity of the open descriptor, so it is not mistaken for
    a change: the rename (or deletion) changes only the old file's link count and with it its status-change time,
    so that time is compared only while the link count is the one recorded.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    links: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        return cls(
            status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_nlink
        )

    def check(self, path: Path, now: os.stat_result) -> None:
        """Raise :class:`CheckpointError` naming ``path`` if ``now`` is not the state this identity recorded."""
        current = FileIdentity.of(now)
        same_file = (self.device, self.inode, self.size, self.mtime_ns) == (
            current.device,
            current.inode,
            current.size,
            current.mtime_ns,
        )
        if same_file and (self.ctime_ns == current.ctime_ns or self.links != current.links):
            return
        if current.inode == self.inode and current.size < self.size:
            # Checked before each read: touching mapped pages a truncation removed kills the process (SIGBUS).
            raise CheckpointError(
                f"{path}: the file was truncated from {self.size} to {current.size} bytes since its header was read; "
                "its tensors can no longer be read (a read of the removed part would kill the process with SIGBUS). "
                "Nothing was read: load the checkpoint again once it is complete, and replace checkpoints with a new "
                "file or directory instead of rewriting them in place"
            )
        raise CheckpointError(
            f"{path}: the file changed while the checkpoint was being read (size {self.size} -> {current.size}, "
            f"mtime_ns {self.mtime_ns} -> {current.mtime_ns}, ctime_ns {self.ctime_ns} -> {current.ctime_ns}); "
            "something rewrote it in place (or changed its permissions or owner, which cannot be told apart). "
            "Nothing was returned: load it again once it is complete, and replace checkpoints with a new file or "
            "directory instead of rewriting them in place"
        )


class SafetensorsFile(ClosesOnExit):
    """A validated safetensors header plus lazy, zero-copy access to the tensor data.

    Tensors are views of a private (copy-on-write) memory map: writing to them never modifies the file.
    """

    def __init__(
        self, path: Path, metadata: dict[str, str], tensors: dict[str, TensorInfo], fd: int, identity: FileIdentity
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self.identity = identity
        self._mmap: mmap.mmap | None = None
        # The descriptor the header was read from: the data is mapped from that same file later, even if ``path``
        # has been replaced meanwhile (a save swapping in a new checkpoint). It stays open until close() so that
        # check_unchanged() can compare that very file with the state its header was validated in.
        self._fd: int | None = fd
        self._release_fd: weakref.finalize | None = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: str | Path) -> SafetensorsFile:
        """Read and validate the header of ``path``; no tensor data is read."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read safetensors file: {exc}") from exc
        return cls.from_fd(path, fd)

    @classmethod
    def from_fd(cls, path: Path, fd: int) -> SafetensorsFile:
        """Like :meth:`open`, reading the already opened descriptor ``fd`` of ``path``, which the result owns.

        ``fd`` is closed on error, and otherwise by :meth:`close` (or when the object is garbage collected).
        """
        try:
            try:
                status = os.fstat(fd)
                if not stat.S_ISREG(status.st_mode):
                    raise CheckpointError(f"{path}: not a regular file")
                file_size = status.st_size
                with os.fdopen(fd, "rb", closefd=False) as f:
                    prefix = f.read(8)
                    if len(prefix) < 8:
                        raise CheckpointError(
                            f"{path}: file is {file_size} bytes, too short for a safetensors header (needs at least 8)"
                        )
                    (header_len,) = struct.unpack("<Q", prefix)
                    if header_len > MAX_HEADER_BYTES:
                        raise CheckpointError(
                            f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"
                        )
                    if 8 + header_len > file_size:
                        raise CheckpointError(
                            f"{path}: header length {header_len} runs past the end of the {file_size}-byte file"
                        )
                    raw_header = f.read(header_len)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read safetensors file: {exc}") from exc
            data_start = 8 + header_len
            metadata, tensors = _parse_header(path, raw_header, data_start, file_size - data_start)
        except BaseException:
            os.close(fd)
            raise
        logger.debug("opened %s: %d tensors", path, len(tensors))
        return cls(path, metadata, tensors, fd, FileIdentity.of(status))

    def _info(self, key: str) -> TensorInfo:
        return tensor_info(self.tensors, key, self.path)

    def tensor(self, key: str) -> torch.Tensor:
        """Return tensor ``key`` as a writable view of the memory-mapped file (no copy)."""
        info = self._info(key)
        if info.numel == 0:
            # torch.frombuffer refuses count=0, and there is no data to share anyway.
            return torch.empty(info.shape, dtype=info.dtype)
        return self._view(info.start, info.end, info.dtype, key).reshape(info.shape)

    def joined(self, keys: Sequence[str]) -> torch.Tensor | None:
        """Tensors ``keys`` as one flat (1-D) writable view of the memory-mapped file, when they share a dtype and lie
        one right after another in the file in that order: their bytes back to back, i.e. their concatenation along
        dim 0, with no copy. None when they do not."""
        infos = [self._info(key) for key in keys]
        if not infos or any(
            info.dtype != infos[0].dtype or info.start != before.end
            for before, info in zip(infos, infos[1:], strict=False)
        ):
            return None
        if infos[-1].end == infos[0].start:
            return None
        return self._view(infos[0].start, infos[-1].end, infos[0].dtype, keys[-1])

    def _view(self, start: int, end: int, dtype: torch.dtype, key: str) -> torch.Tensor:
        """Bytes ``[start, end)`` of the file as a flat view of ``dtype`` (``key``: the last tensor, for messages)."""
        # Before handing out a view: data rewritten since the header was validated would be read as if it matched
        # that header (and touching pages a truncation removed kills the process with SIGBUS).
        self.check_unchanged()
        mm = self._mapping()
        if end > len(mm):
            raise CheckpointError(
                f"{self.path}: tensor {key!r} ends at byte {end} but the file is now {len(mm)} bytes "
                "(was it truncated after opening?)"
            )
        # frombuffer keeps a reference to `mm`, so the mapping lives as long as any tensor viewing it.
        return torch.frombuffer(mm, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start)

    def map_tensor(self, key: str) -> torch.Tensor:
        """Return tensor ``key`` as a view of a private mapping of its own pages, for tensors read again and again.

        A disk offload reads its weights at every forward and drops them after: unlike :meth:`tensor`'s views of the
        one mapping of the whole file, nothing of the file stays mapped or resident once the returned tensor is
        dropped. The file is compared with its recorded identity first, as for :meth:`tensor`.
        """
        info = self._info(key)
        if info.numel == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        self.check_unchanged()
        assert self._fd is not None  # check_unchanged() raised otherwise
        start = info.start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY  # mappings start on a page
        try:
            mapping = mmap.mmap(self._fd, info.end - start, offset=start, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: cannot memory-map tensor {key!r}: {exc}") from exc
        # Not registered with checkpoint.pages: nothing releases these pages (they go with the mapping), and a disk
        # offload maps its weights anew at every forward.
        # frombuffer keeps a reference to the mapping, which is unmapped when the last view of it is gone.
        flat = torch.frombuffer(mapping, dtype=info.dtype, count=info.numel, offset=info.start - start)
        return flat.reshape(info.shape)

    def file_range(self, key: str) -> FileRange:
        """Where tensor ``key``'s bytes lie in the file, to copy them file to file (valid until :meth:`close`).

        The file is compared with its recorded identity first, as for :meth:`tensor`; a copy made from it must still
        be followed by :meth:`check_unchanged`, as any read.
        """
        info = self._info(key)
        self.check_unchanged()
        assert self._fd is not None  # check_unchanged() raised otherwise
        return FileRange(self.path, self._fd, info.start, info.nbytes)

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointError` naming the file if it was rewritten in place since its header was read.

        Compares the open file (not the path, which a save may have pointed at a new file meanwhile) with the
        identity recorded when the header was validated.
        """
        if self._fd is None:
            raise CheckpointError(f"{self.path}: file is closed")
        try:
            now = os.fstat(self._fd)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot check the file: {exc}") from exc
        self.identity.check(self.path, now)

    def _mapping(self) -> mmap.mmap:
        if self._fd is None:
            raise CheckpointError(f"{self.path}: file is closed")
        if self._mmap is None:
            try:
                self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{self.path}: cannot memory-map file: {exc}") from exc
            register_mapping(self._mmap)
        return self._mmap

    def close(self) -> None:
        """Close the file and release this object's reference to the memory map.

        The map is never closed explicitly: ``torch.frombuffer`` holds a plain reference rather than a
        buffer export, so ``mmap.close()`` would succeed and leave handed-out tensors dangling (segfault).
        Dropping the reference unmaps immediately once no tensor views it.
        """
        self._mmap = None
        if self._release_fd is not None:
            self._release_fd()
            self._release_fd = None
            self._fd = None

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.tensors)} tensors)"


def _parse_header(
    path: Path, raw_header: bytes, data_start: int, data_len: int
) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    header = parse_json(path, raw_header, unique_keys=True)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")

    raw_metadata = header.pop("__metadata__", {})
    if not isinstance(raw_metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw_metadata.items()
    ):
        raise CheckpointError(f"{path}: __metadata__ must be a JSON object of string to string")

    tensors: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        tensors[key] = _parse_entry(path, key, entry, data_start, data_len)
    _check_layout(path, tensors, data_start, data_len)
    return dict(raw_metadata), tensors


def _parse_entry(path: Path, key: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {key!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry must be a JSON object")
    dtype_name = entry.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype_name!r} (supported: {', '.join(SAFETENSORS_DTYPES)})")
    dtype = SAFETENSORS_DTYPES[dtype_name]
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{where}: data_offsets must be two integers 0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    if end > data_len:
        raise CheckpointError(
            f"{where}: data ends at byte {end} of the data section but only {data_len} bytes are present "
            "(truncated file?)"
        )
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: {dtype_name} {shape} needs {expected} bytes but data_offsets span {end - begin}"
        )
    return TensorInfo(key, dtype, tuple(shape), path, data_start + begin, data_start + end)


def _check_layout(path: Path, tensors: dict[str, TensorInfo], data_start: int, data_len: int) -> None:
    """The tensors' bytes follow one another from the start of the data section to the end of the file.

    As the safetensors format requires (its own reader refuses anything else): bytes no tensor owns are unexplained
    content, and two tensors reading the same bytes alias each other.
    """
    spans = sorted((info.start, info.end, key) for key, info in tensors.items() if info.end > info.start)
    position, previous = data_start, None
    for start, end, key in spans:
        if start < position:
            raise CheckpointError(f"{path}: byte ranges of tensors {previous!r} and {key!r} overlap")
        if start > position:
            after = f"after tensor {previous!r}" if previous is not None else "at the start of the data"
            raise CheckpointError(
                f"{path}: {start - position} byte(s) {after} belong to no tensor (tensor {key!r} starts at data "
                f"offset {start - data_start}); a safetensors file stores its tensors back to back. The file is not "
                "one a safetensors writer produced: get the checkpoint again"
            )
        position, previous = end, key
    if position != data_start + data_len:
        raise CheckpointError(
            f"{path}: {data_start + data_len - position} byte(s) at the end of the file belong to no tensor; a "
            "safetensors file ends with its last tensor. The file is not one a safetensors writer produced: get the "
            "checkpoint again"
        )
