"""Atomic writer of safetensors checkpoint directories (single file or sharded with an index)."""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import logging
import os
import re
import secrets
import shutil
import stat
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # not POSIX: saves into one parent directory are not serialised
    fcntl = None  # type: ignore[assignment]

import torch
from safetensors.torch import save, save_file

from modelpatch.checkpoint.checkpoint import SAFE_INDEX, SAFE_SINGLE
from modelpatch.checkpoint.file_range import FileRange
from modelpatch.checkpoint.layout import ENTRY_FILES, PICKLE_INDEX, open_entry_file, read_weight_map
from modelpatch.errors import CheckpointError, CheckpointPermissionError

logger = logging.getLogger(__name__)

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SHARD_RE = re.compile(r"^(model-\d{5}-of-\d{5}\.safetensors|pytorch_model-\d{5}-of-\d{5}\.bin)$")


def parse_size(size: int | str, *, context: Path) -> int:
    """Parse ``50GB`` / ``500MB`` / ``10KB`` (decimal), ``1GiB`` (binary) or a plain int into bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE_RE.match(size) if isinstance(size, str) else None
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _SIZE_UNITS:
            raise CheckpointError(
                f"{context}: cannot parse max_shard_size {size!r} (use e.g. '5GB', '500MB' or an int)"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise CheckpointError(f"{context}: max_shard_size must be positive, got {size!r}")
    return value


def write_checkpoint(
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    extra_files: Mapping[str, bytes] = {},
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str = "50GB",
) -> list[Path]:
    """Atomically (re)write ``directory`` with ``tensors`` as safetensors plus ``extra_files``.

    Everything is written to a temporary sibling and swapped in with renames (an atomic exchange where the
    platform has one, so ``directory`` always holds a complete checkpoint); files of an existing ``directory``
    that this writer does not produce (tokenizer files, ...) are carried over. Saves into one parent directory
    hold an exclusive lock on it, so concurrent saves to the same target run one after the other and the
    clean-up of a killed save never touches a live one's files.
    Returns the paths written (tensor files, index, extra files) inside ``directory``.

    Raises:
        CheckpointPermissionError: ``directory`` (or a directory inside it) or its parent is not writable by this
            user according to its permission bits, also when running as root. Nothing is written.
        CheckpointError: Invalid arguments, or a file-system error (named) while writing; the previous
            checkpoint is untouched and no temporary directory is left behind.
    """

    def save_shard(path: Path, shown: Path, keys: list[str], file_metadata: dict[str, str]) -> None:
        # Converted one shard at a time so that at most one shard's worth of CPU copies exists.
        prepared: dict[str, torch.Tensor] = {}
        for key in keys:
            try:
                prepared[key] = tensors[key].detach().to("cpu").contiguous()
            except Exception as exc:
                raise CheckpointError(f"{shown}: cannot move tensor {key!r} to CPU: {exc}") from exc
        try:
            save_file(prepared, str(path), metadata=file_metadata)
            _fsync_file(path)
        except Exception as exc:
            raise CheckpointError(f"{shown}: cannot write safetensors file: {exc}") from exc

    return _write(directory, tensors, save_shard, extra_files, metadata, max_shard_size)


Streamed = torch.Tensor | Sequence[FileRange]
"""A streamed tensor's data: the tensor, or where its bytes (row-major, little-endian) lie in open files, one range
after the other, which the writer copies file to file (the producer vouches for shape and dtype)."""

TensorStream = Callable[[list[str]], Iterator[tuple[str, Streamed]]]
"""``produce(keys)``: yields ``(key, data)`` for each of ``keys``, in that order, each computed when its turn comes;
one is written before the next is asked for, so the producer may release it then."""


def stream_checkpoint(
    directory: str | Path,
    layout: Mapping[str, torch.Tensor],
    produce: TensorStream,
    *,
    extra_files: Mapping[str, bytes] = {},
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str = "50GB",
    written: Callable[[int], object] | None = None,
) -> list[Path]:
    """Like :func:`write_checkpoint`, computing each tensor only when the file it belongs to reaches it.

    ``layout`` gives every key's shape and dtype (meta tensors): shards, headers and index are planned from it first,
    then each shard's tensors are asked of ``produce`` in file order and written one after the other, so memory holds
    one tensor at a time, never a shard; a tensor given as file ranges is copied file to file. The files are byte for
    byte what :func:`write_checkpoint` writes for the same tensors (safetensors' own header, in safetensors' own
    order; safetensors itself writes a metadata dict of several entries in no fixed order). ``written(nbytes)`` is
    called after each tensor. Atomic as :func:`write_checkpoint`: a failure, or a tensor that differs from its planned
    shape or dtype, leaves the previous checkpoint in place.
    """

    def stream_shard(path: Path, shown: Path, keys: list[str], file_metadata: dict[str, str]) -> None:
        order, header = _safetensors_header(keys, layout, file_metadata)
        try:
            with path.open("wb") as f:
                f.write(header)
                produced = produce(order)
                flushed = 0
                for expected in order:
                    key, tensor = next(produced, (None, None))
                    _check_streamed(shown, expected, key, tensor, layout[expected])
                    assert tensor is not None  # _check_streamed refused a stream that ran out
                    if isinstance(tensor, torch.Tensor):
                        _write_tensor(f, tensor)
                    else:
                        f.flush()
                        for part in tensor:
                            part.copy_to(f.fileno())
                        f.seek(0, os.SEEK_END)  # the copies moved the file's position under the buffered writer
                    if f.tell() - flushed >= _WRITEBACK_BYTES:
                        # The disk writes what is done while the next tensors are computed, instead of all of it
                        # at the fsync below.
                        f.flush()
                        _start_writeback(f.fileno(), flushed, f.tell() - flushed)
                        flushed = f.tell()
                    if written is not None:
                        written(_nbytes(tensor))
                if next(produced, None) is not None:
                    raise CheckpointError(f"{shown}: the tensor stream yields more tensors than the {len(order)} asked")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise CheckpointError(f"{shown}: cannot write safetensors file: {exc}") from exc

    _require_little_endian(directory, "streamed writes")
    return _write(directory, layout, stream_shard, extra_files, metadata, max_shard_size)


def _require_little_endian(directory: str | Path, what: str) -> None:
    if sys.byteorder != "little":  # safetensors stores little-endian data; raw tensor bytes would be wrong
        raise CheckpointError(f"{directory}: {what} need a little-endian machine")


TensorPlaces = dict[str, tuple[Path, int]]
"""Checkpoint key -> the file (in the temporary directory being written) and the byte offset its data starts at."""


def write_presized_checkpoint(
    directory: str | Path,
    layout: Mapping[str, torch.Tensor],
    fill: Callable[[TensorPlaces], object],
    *,
    extra_files: Mapping[str, bytes] = {},
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str = "50GB",
) -> list[Path]:
    """Like :func:`stream_checkpoint`, with the tensors' bytes written by ``fill`` wherever they are computed.

    ``layout`` gives every key's shape and dtype (meta tensors). Every file is first created at its final size with
    its header (safetensors' own, as :func:`stream_checkpoint` writes it), then ``fill(places)`` writes each tensor's
    bytes (row-major, little-endian) at ``places[key]`` — from this process or from others sharing the file system
    (the ranks of a collective save, each writing the rows it holds) — and syncs what it wrote; only then are the
    files swapped in, atomically as :func:`write_checkpoint`. An exception from ``fill`` leaves the previous
    checkpoint in place.
    """
    places: TensorPlaces = {}

    def presize(path: Path, shown: Path, keys: list[str], file_metadata: dict[str, str]) -> None:
        order, header = _safetensors_header(keys, layout, file_metadata)
        offset = len(header)
        for key in order:
            places[key] = (path, offset)
            offset += layout[key].numel() * layout[key].element_size()
        try:
            with path.open("wb") as f:
                f.write(header)
                f.truncate(offset)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise CheckpointError(f"{shown}: cannot write safetensors file: {exc}") from exc

    _require_little_endian(directory, "pre-sized writes")
    return _write(directory, layout, presize, extra_files, metadata, max_shard_size, before_swap=lambda: fill(places))


def write_at(fd: int, offset: int, tensor: torch.Tensor) -> None:
    """Write the bytes of ``tensor`` (row-major, the machine's little-endian layout) into ``fd`` at ``offset``."""
    data = _tensor_bytes(tensor)
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


ShardWriter = Callable[[Path, Path, list[str], dict[str, str]], None]
"""``write(path, shown, keys, metadata)``: write the tensors ``keys`` as one safetensors file at ``path`` (a
temporary one; ``shown`` is the name to put in errors)."""


def _write(
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor],
    write_shard: ShardWriter,
    extra_files: Mapping[str, bytes],
    metadata: Mapping[str, str] | None,
    max_shard_size: int | str,
    before_swap: Callable[[], object] | None = None,
) -> list[Path]:
    """Plan the shards of ``tensors`` (real or meta) and write them with ``write_shard``, atomically (``before_swap``
    runs once every file was written, before the directory is synced and swapped in)."""
    directory = Path(directory).absolute()
    if directory.is_symlink():
        raise CheckpointError(f"{directory}: is a symlink; refusing to replace it (pass the real directory)")
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: exists and is not a directory")
    limit = parse_size(max_shard_size, context=directory)
    file_metadata = {"format": "pt", **(metadata or {})}
    _validate_inputs(directory, tensors, extra_files, file_metadata)
    shards = _plan_shards(sorted(tensors), tensors, limit)

    with _named_os_errors(directory):
        _create_parent(directory)
        with _parent_lock(directory):
            _require(directory.parent, _R | _W | _X, f"saving {directory} writes a new version next to it")
            _recover_stale_siblings(directory)
            _check_replaceable(directory)
            tmp = directory.parent / f".{directory.name}.modelpatch-tmp-{secrets.token_hex(8)}"
            tmp.mkdir()
            try:
                written = _write_contents(tmp, directory, tensors, shards, extra_files, file_metadata, write_shard)
                if before_swap is not None:
                    before_swap()
                if directory.exists():
                    _carry_over_user_files(directory, tmp, produced=set(written) | set(extra_files))
                _fsync_dir(tmp)
                _swap_in(tmp, directory)
            except BaseException:
                _remove_leftover(directory, tmp)
                raise
    logger.info("wrote %d tensors to %s (%d tensor file(s))", len(tensors), directory, len(shards))
    return [directory / name for name in written]


def _safetensors_order(keys: list[str], layout: Mapping[str, torch.Tensor]) -> tuple[list[str], dict[torch.dtype, str]]:
    """The order safetensors stores ``keys`` in, and its name of each dtype, learnt from safetensors itself.

    safetensors sorts by dtype (its own ranking of them) and then by name; one one-element tensor per dtype, written
    by safetensors, gives the ranking and the names without restating them here.
    """
    dtypes = sorted({layout[key].dtype for key in keys}, key=str)
    probe = save({str(i): torch.zeros(1, dtype=dtype) for i, dtype in enumerate(dtypes)})
    (length,) = struct.unpack("<Q", probe[:8])
    header = json.loads(probe[8 : 8 + length])
    header.pop("__metadata__", None)
    ranked = sorted(header, key=lambda name: header[name]["data_offsets"])
    rank = {dtypes[int(name)]: position for position, name in enumerate(ranked)}
    names = {dtypes[int(name)]: header[name]["dtype"] for name in ranked}
    return sorted(keys, key=lambda key: (rank[layout[key].dtype], key)), names


def _safetensors_header(
    keys: list[str], layout: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> tuple[list[str], bytes]:
    """The file order of ``keys`` and the header bytes (length prefix included) safetensors writes for them."""
    order, names = _safetensors_order(keys, layout)
    entries: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for key in order:
        meta = layout[key]
        size = meta.numel() * meta.element_size()
        entries[key] = {"dtype": names[meta.dtype], "shape": list(meta.shape), "data_offsets": [offset, offset + size]}
        offset += size
    # safetensors' JSON: compact, UTF-8 as is, padded with spaces to a multiple of 8 bytes.
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return order, struct.pack("<Q", len(text)) + text


def _nbytes(data: Streamed) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return sum(part.length for part in data)


def _check_streamed(shown: Path, expected: str, key: str | None, tensor: Streamed | None, meta: torch.Tensor) -> None:
    """Refuse a streamed tensor that is not the one the header announced (its bytes would be read as another)."""
    if key is None or tensor is None:
        raise CheckpointError(f"{shown}: the tensor stream ended before {expected!r}")
    if key != expected:
        raise CheckpointError(f"{shown}: the tensor stream gave {key!r} where {expected!r} was due")
    if not isinstance(tensor, torch.Tensor):
        if _nbytes(tensor) != meta.numel() * meta.element_size():
            raise CheckpointError(
                f"{shown}: tensor {key!r} is given as {_nbytes(tensor)} bytes of files, planned as {meta.dtype} "
                f"{list(meta.shape)} ({meta.numel() * meta.element_size()} bytes)"
            )
        return
    if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
        raise CheckpointError(
            f"{shown}: tensor {key!r} is {tensor.dtype} {list(tensor.shape)}, "
            f"planned as {meta.dtype} {list(meta.shape)}"
        )


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Write the bytes of ``tensor`` (row-major, the machine's little-endian layout) to ``f``."""
    f.write(_tensor_bytes(tensor))


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` (row-major, the machine's little-endian layout)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


@contextmanager
def _named_os_errors(directory: Path) -> Iterator[None]:
    """Report a file-system failure of the save (a rename, a directory creation) as a ``CheckpointError``."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot save: {exc}") from exc


_R, _W, _X = 4, 2, 1


def _permits(path: Path, status: os.stat_result, wanted: int) -> bool:
    """Whether the permission bits of ``path`` grant ``wanted`` (``_R | _W | _X``) to this process's user.

    Read from the owner, group or other bits as the kernel does for an unprivileged user, on purpose: root passes
    every ``os.access`` check, yet a directory made read-only says that it must not change, whoever saves.
    """
    if not hasattr(os, "geteuid"):  # not POSIX: no owner and group bits to read
        return not wanted & _W or os.access(path, os.W_OK)
    if status.st_uid == os.geteuid():
        bits = status.st_mode >> 6
    elif status.st_gid == os.getegid() or status.st_gid in os.getgroups():
        bits = status.st_mode >> 3
    else:
        bits = status.st_mode
    return bits & wanted == wanted


def _require(path: Path, wanted: int, why: str, elsewhere: str = "save somewhere else") -> None:
    """Raise :class:`CheckpointPermissionError` naming ``path`` unless its permissions grant ``wanted``."""
    status = os.stat(path)
    if not _permits(path, status, wanted):
        raise CheckpointPermissionError(
            f"{path}: {why}, but its permissions ({stat.filemode(status.st_mode)}) do not allow it. Make it "
            f"writable (chmod u+rwx) or {elsewhere}."
        )


def require_writable_directory(directory: Path, why: str, elsewhere: str) -> None:
    """Refuse, naming it, a ``directory`` that files cannot be written into: it is not a directory, lies below a
    file, or its permissions (or, where it does not exist yet, those of its nearest existing parent, where it would be
    created) forbid it. Checked before anything is written; ``why`` says what will write there, ``elsewhere`` what
    to do instead.

    Raises:
        CheckpointError: naming ``directory`` (a :class:`CheckpointPermissionError` for permissions).
    """
    existing = next(p for p in (directory, *directory.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        where = "is not a directory" if existing == directory else f"lies below {existing}, which is not a directory"
        raise CheckpointError(f"{directory}: {why}, but it {where}. Remove that file or {elsewhere}.")
    _require(existing, _W | _X, f"{why}{'' if existing == directory else f' (creating {directory})'}", elsewhere)


def _create_parent(directory: Path) -> None:
    """Create ``directory``'s missing parents, refusing where the nearest existing one is not writable."""
    existing = next(p for p in directory.parents if p.exists())
    if not existing.is_dir():
        raise CheckpointError(f"{existing}: not a directory, so {directory} cannot be created in it")
    if existing != directory.parent:
        _require(existing, _W | _X, f"saving {directory} creates directories in it")
        directory.parent.mkdir(parents=True, exist_ok=True)


def _check_replaceable(directory: Path) -> None:
    """Refuse a save over ``directory`` when the permissions of it or of any directory inside it forbid changing it.

    The new version is swapped in, and the previous version is then read (user files are carried over) and
    deleted: every directory of it must be readable, writable and searchable. Checked before anything is written,
    so a refused save leaves nothing behind.
    """
    if not directory.exists():
        return

    def refuse(error: OSError) -> None:
        raise CheckpointPermissionError(f"{error.filename}: cannot read it to replace {directory}: {error}")

    for root, _, _ in os.walk(directory, onerror=refuse):  # never follows symlinks
        _require(Path(root), _R | _W | _X, f"saving over {directory} replaces this directory")


def _remove_tree(path: Path) -> None:
    """Delete ``path``, a temporary or previous version this writer made, even where a directory in it is read-only.

    Such a directory (a user folder carried over with its mode, or made read-only after a killed save) stops
    ``rmtree`` for users other than root; the directories are ours, so they are made writable first.
    """
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except PermissionError:
        pass
    for root, dirs, _ in os.walk(path):
        for name in [root, *(os.path.join(root, d) for d in dirs)]:
            if not os.path.islink(name):
                os.chmod(name, stat.S_IMODE(os.lstat(name).st_mode) | stat.S_IRWXU)
    shutil.rmtree(path)


@contextmanager
def _locked_for_removal(directory: Path, path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the entry file of ``path`` (``layout.ENTRY_FILES``), a version of ``directory``
    about to be removed, taken once the loads opening it have opened all its files (each holds a shared lock on it
    meanwhile, ``checkpoint.py``): a load that read the index of a version never finds its shards removed under it."""
    entry = None
    if fcntl is not None:
        try:
            folder = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # nothing there (removed already), or not a directory: nothing is opening it
            folder = None
        if folder is not None:
            try:
                entry = open_entry_file(folder)
            finally:
                os.close(folder)
    try:
        if entry is not None:
            try:
                fcntl.flock(entry, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.debug("%s: waiting for the loads opening %s before removing it", directory, path)
                fcntl.flock(entry, fcntl.LOCK_EX)
            except OSError as exc:  # a file system without flock
                logger.debug("%s: cannot lock %s before removing it (%s)", directory, path, exc)
        yield
    finally:
        if entry is not None:
            os.close(entry)


def _remove_leftover(directory: Path, path: Path) -> None:
    """Remove ``path`` without hiding the error being handled; a failure is logged, and the next save retries.

    Removed under :func:`_locked_for_removal`: a load may be opening it (a previous version, swapped out)."""
    try:
        with _locked_for_removal(directory, path):
            _remove_tree(path)
    except OSError as exc:
        logger.warning("%s: could not remove %s (the next save to it removes it): %s", directory, path, exc)


def _validate_inputs(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    extra_files: Mapping[str, bytes],
    metadata: Mapping[str, str],
) -> None:
    for key, value in tensors.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{directory}: entry {key!r} must map a str key to a torch.Tensor")
    for meta_key, meta_value in metadata.items():
        if not isinstance(meta_key, str) or not isinstance(meta_value, str):
            raise CheckpointError(f"{directory}: metadata entry {meta_key!r} must map str to str")
    for name, content in extra_files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or os.sep in name
            or (os.altsep is not None and os.altsep in name)
        ):
            raise CheckpointError(f"{directory}: extra file name {name!r} must be a plain file name")
        if name == SAFE_INDEX or name.endswith(".safetensors"):
            raise CheckpointError(f"{directory}: extra file {name!r} would clash with the tensor files")
        if not isinstance(content, bytes):
            raise CheckpointError(f"{directory}: content of extra file {name!r} must be bytes")
    _check_no_shared_memory(directory, tensors)  # meta tensors (a stream's layout) have no memory to share


def _check_no_shared_memory(directory: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Reject tensors whose memory overlaps (tied weights); disjoint slices of one storage are fine.

    Compares each tensor's [first, last] byte span, so interleaved views (e.g. ``w[:, :n]`` and
    ``w[:, n:]``) count as overlapping; callers can ``.clone()`` those.
    """
    spans: list[tuple[torch.device, int, int, int, str]] = []
    for key, t in tensors.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        base = t.untyped_storage().data_ptr()
        first = int(t.storage_offset()) * t.element_size()
        extent = (
            sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
        ) * t.element_size()
        spans.append((t.device, base, first, first + extent, key))
    spans.sort(key=lambda s: (str(s[0]), s[1], s[2], s[3]))
    for prev, cur in pairwise(spans):
        if prev[0] == cur[0] and prev[1] == cur[1] and cur[2] < prev[3]:
            raise CheckpointError(
                f"{directory}: tensors {prev[4]!r} and {cur[4]!r} share memory (tied weights?); "
                "pass each tensor only once, or .clone() views of one weight"
            )


def _plan_shards(keys: list[str], tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Greedy, in key order: a new shard starts when the next tensor would push the current one past ``limit``."""
    shards: list[list[str]] = [[]]
    current = 0
    for key in keys:
        size = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and current + size > limit:
            shards.append([])
            current = 0
        shards[-1].append(key)
        current += size
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_contents(
    tmp: Path,
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    shards: list[list[str]],
    extra_files: Mapping[str, bytes],
    metadata: dict[str, str],
    write_shard: ShardWriter,
) -> list[str]:
    names = _shard_names(len(shards))
    for name, keys in zip(names, shards, strict=True):
        write_shard(tmp / name, directory / name, keys, metadata)
    written = list(names)

    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {key: name for name, keys in zip(names, shards, strict=True) for key in keys},
        }
        content = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
        _write_bytes(tmp / SAFE_INDEX, content, directory / SAFE_INDEX)
        written.append(SAFE_INDEX)
    for name, content in extra_files.items():
        _write_bytes(tmp / name, content, directory / name)
        written.append(name)
    return written


def _carry_over_user_files(directory: Path, tmp: Path, produced: set[str]) -> None:
    """Copy into ``tmp`` everything in the old ``directory`` that is not one of this writer's file names.

    The previous version's weights are dropped (replaced), in either layout and in either format (an older stock
    save's ``pytorch_model.bin``); any other file, e.g. ``tokenizer.json`` or an ``adapter_model.safetensors``, is
    kept.
    """
    for entry in directory.iterdir():
        name = entry.name
        if name in produced or name in ENTRY_FILES or _SHARD_RE.match(name):
            continue
        target = tmp / name
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, target, symlinks=True)
            else:
                shutil.copy2(entry, target, follow_symlinks=False)
        except (OSError, shutil.Error) as exc:
            raise CheckpointError(f"{entry}: cannot keep this file of the previous checkpoint: {exc}") from exc
        logger.debug("kept %s from the previous %s", name, directory)


FileVersions = dict[str, tuple[int, int, int, int]]
"""Entry file name (``layout.ENTRY_FILES``) -> its identity (inode, size, modification and status-change times)."""


def entry_files(directory: str | Path) -> FileVersions:
    """The entry files ``directory`` holds now, each with its identity (what :func:`remove_replaced_versions` compares
    with after a save that writes in place)."""
    found: FileVersions = {}
    for name in ENTRY_FILES:
        try:
            status = os.lstat(Path(directory) / name)
        except OSError:
            continue
        if stat.S_ISREG(status.st_mode):
            found[name] = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
    return found


def remove_replaced_versions(directory: str | Path, before: FileVersions) -> list[Path]:
    """After a save that wrote ``directory`` in place (stock ``save_pretrained``), remove the previous version it left
    beside the new one: every entry file of ``before`` (:func:`entry_files`, taken before the save) the save did not
    rewrite, once it wrote one, and the shards a left index names that the new version does not hold.

    Stock transformers removes the previous shards it would not overwrite, never a previous ``model.safetensors`` or
    index: one left beside the other layout is a second checkpoint, which stock (reading the single file first) or
    modelpatch (the index first) would load. Returns the files removed.
    """
    directory = Path(directory)
    now = entry_files(directory)
    written = {name for name, identity in now.items() if before.get(name) != identity}
    if not written:
        return []
    kept: set[str] = set(written)
    for name in written & {SAFE_INDEX, PICKLE_INDEX}:
        kept.update(read_weight_map(directory / name).values())
    left = [name for name in now if name not in written]
    doomed = set(left)
    for name in left:
        if name in (SAFE_INDEX, PICKLE_INDEX):
            try:
                doomed.update(shard for shard in read_weight_map(directory / name).values() if _SHARD_RE.match(shard))
            except CheckpointError as exc:  # unreadable: its shards cannot be told, the index itself goes
                logger.warning("%s: keeping the shards %s names, unreadable: %s", directory, name, exc)
    removed = []
    for name in sorted(doomed - kept):
        path = directory / name
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise CheckpointError(
                f"{path}: left by an earlier save beside the new checkpoint {sorted(written)}, and cannot be removed: "
                f"{exc}. Remove it: a load would read one or the other."
            ) from exc
        logger.info("%s: removed %s, left by an earlier save beside the new %s", directory, name, sorted(written))
        removed.append(path)
    return removed


def _swap_in(tmp: Path, directory: Path) -> None:
    if not directory.exists():
        os.rename(tmp, directory)
        _fsync_dir(directory.parent)
        return
    if _exchange(tmp, directory):
        # ``directory`` went from the previous checkpoint to the new one in one step; ``tmp`` now holds the previous
        # one (a kill before it is removed leaves a temp sibling, which the next save drops).
        _fsync_dir(directory.parent)
        _remove_leftover(directory, tmp)
        return
    # No atomic exchange: two renames. A kill between them leaves the previous checkpoint in the ``-old-`` sibling,
    # which the next save restores.
    old = directory.parent / f".{directory.name}.modelpatch-old-{secrets.token_hex(8)}"
    os.rename(directory, old)
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(old, directory)
        raise
    _fsync_dir(directory.parent)
    _remove_leftover(directory, old)  # the new checkpoint is already in place


def _recover_stale_siblings(directory: Path) -> None:
    """Clean up after a save that was killed: drop temp dirs, restore or drop previous versions."""
    parent, name = directory.parent, directory.name
    # Safe: every save to this parent holds its lock, so these are leftovers of dead saves, never a live one's.
    for tmp in parent.glob(f".{glob.escape(name)}.modelpatch-tmp-*"):
        logger.warning("%s: removing leftover temporary directory %s", directory, tmp)
        _remove_leftover(directory, tmp)
    olds = sorted(parent.glob(f".{glob.escape(name)}.modelpatch-old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not directory.exists():
        # Killed between the two renames of a swap: the newest previous version is the checkpoint.
        restored = olds.pop()
        logger.warning("%s: missing; restoring previous version from %s", directory, restored)
        os.rename(restored, directory)
    for old in olds:
        logger.warning("%s: removing leftover previous version %s", directory, old)
        _remove_leftover(directory, old)


def _linux_libc_function(name: str, argtypes: list[type]):
    """The C library's ``name`` (returning an int, setting errno), or None off Linux or where the C library lacks it
    (glibc < 2.28 has no ``renameat2``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_WRITEBACK_BYTES = 64 * 2**20
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = _linux_libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing ``length`` bytes of ``fd`` from ``offset`` to disk, without waiting.

    Only a head start: where it is unavailable or fails, the fsync that ends every file writes (and checks) it all.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = _linux_libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the directory entries ``a`` and ``b`` (Linux ``RENAME_EXCHANGE``); False where unsupported."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # kernel or file system lacks it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


@contextmanager
def _parent_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory``'s parent (released by the kernel if the process dies)."""
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(directory.parent, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # an unreadable parent, or a file system without flock: proceed unserialised
            logger.debug(
                "%s: cannot lock %s (%s); concurrent saves are not serialised", directory, directory.parent, exc
            )
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _write_bytes(path: Path, content: bytes, shown: Path) -> None:
    try:
        with path.open("wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise CheckpointError(f"{shown}: cannot write file: {exc}") from exc


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
