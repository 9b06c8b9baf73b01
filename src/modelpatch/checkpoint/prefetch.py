"""Reading a checkpoint's files into the page cache on background threads, ahead of the code that touches them.

A load maps the safetensors files and hands out views of them: their bytes are read from disk only when first
touched, by the conversions of the load and then by the first forward pass, one page fault at a time (each a small
synchronous read). On a cold page cache that costs several times what reading the same bytes in large sequential
reads costs. A :class:`Prefetch` reads the files' byte ranges in the order given (the order the load and the forward
need them: natural key order, layer 2 before layer 10) in large chunks on a daemon thread, so that the faults find
the pages already cached while the main thread goes on.

Started late (once a load has opened its checkpoint) it gains nothing measurable: the only work left to overlap is
the load itself, a fraction of a second. Started first thing in ``from_pretrained`` by modelpatch's Auto classes
(:func:`prefetching_directory`), before torch and transformers' modeling code are imported, it overlaps the reads
with seconds of imports: the load that follows adopts it (:func:`prefetching`) instead of starting its own.
docs/benchmarks.md has the figures. This module imports nothing heavy for that reason (no torch).

It is a hint, and never more: the thread reads with ``preadv`` into one small buffer it overwrites (the copy is the
point: see :class:`_Sink`), through its own duplicates of the file descriptors (closing the checkpoint leaves it
reading a file that is still open, never another file given the same descriptor number); it skips chunks whose pages
are all resident already (a warm cache costs one ``mincore`` per chunk), reads every byte at most once and at most
half the memory available, and stops on the first error, which is logged at DEBUG level and never raised, when
the load fails, and when the interpreter exits (:func:`_stop_all`: a read the user's program no longer waits for
must not keep the process busy while it shuts down). ``MODELPATCH_PREFETCH``: unset (or ``auto``), the Auto
classes' early prefetch only; ``1`` every load prefetches; ``0`` none does.
"""

from __future__ import annotations

import atexit
import collections
import contextvars
import ctypes
import logging
import mmap
import os
import re
import stat
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .file_range import FileRange
from .json_file import parse_json
from .layout import MAX_HEADER_BYTES, SAFE_INDEX, SAFE_SINGLE, read_weight_map, symlink_escape

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

logger = logging.getLogger(__name__)

ENV_VAR = "MODELPATCH_PREFETCH"
# Large enough for sequential throughput and few trips through the GIL (see _PIECES), small enough that the order
# is kept and a stop is quick (one chunk: well under a second at disk speed).
CHUNK_BYTES = 64 * 2**20
# How long a failing load waits for the chunk being read to end: a hung file system must not hold the error back
# (the thread stops by itself after that chunk, reading through its own descriptors).
STOP_WAIT_SECONDS = 10.0
# One reader: a second one competed with the forward's own page faults for the disk, and with the main thread's
# imports for the two CPUs measured (docs/benchmarks.md).
THREADS = 1

_DIGITS = re.compile(r"(\d+)")


def _memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_budget() -> int | None:
    """How many bytes one prefetch reads at most: half the memory available. A checkpoint larger than that would
    have the prefetch evict pages the load is still to use (or other programs' pages) for pages read too early."""
    available = _memory_available()
    return None if available is None else available // 2


Mode = Literal["auto", "on", "off"]


def prefetch_mode() -> Mode:
    """What ``MODELPATCH_PREFETCH`` asks for: ``"on"`` (1/true/yes/on: every load prefetches), ``"off"``
    (0/false/no/off: none does) or ``"auto"`` (unset, empty or ``auto``: the early prefetch of the Auto classes only,
    the one measured to help; any other value is logged as a warning and read as ``auto``)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    if value not in ("", "auto"):
        logger.warning("%s=%r is none of 1, 0, auto: read as auto", ENV_VAR, value)
    return "auto"


def _natural(key: str) -> list[object]:
    # "layers.2" before "layers.10": the order modules run in, which the files' (sorted) key order is not.
    return [int(part) if part.isdigit() else part for part in _DIGITS.split(key)]


def checkpoint_ranges(checkpoint: Checkpoint) -> list[FileRange]:
    """The byte ranges of ``checkpoint``'s safetensors tensors, in natural key order (layer 2 before layer 10): the
    order of a model's layers, known from the headers alone. Tensors of pickle files have none."""
    ranges = ((key, checkpoint.file_range(key)) for key in checkpoint.keys())
    return _natural_order([(key, r) for key, r in ranges if r is not None])


def _natural_order(ranges: list[tuple[str, FileRange]]) -> list[FileRange]:
    """The non-empty ranges of ``(key, range)`` pairs, sorted by :func:`_natural` key."""
    return [r for _, r in sorted(ranges, key=lambda item: _natural(item[0])) if r.length > 0]


def _find_mincore() -> tuple[Callable[..., int], Callable[..., int], Callable[..., int]] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, munmap, mincore = libc.mmap, libc.munmap, libc.mincore
    except (OSError, AttributeError):
        return None
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mmap_.restype = ctypes.c_void_p
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    munmap.restype = ctypes.c_int
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    return mmap_, munmap, mincore


_MINCORE = _find_mincore()
_MAP_FAILED = ctypes.c_void_p(-1).value


class _File:
    """One file the prefetch reads: a duplicate of the checkpoint's descriptor, and a shared read-only mapping of it
    used only to ask which pages are resident (it is never touched, so it reads nothing and counts for nothing)."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)
        self.address: int | None = None
        try:
            status = os.fstat(self.fd)
        except OSError:
            os.close(self.fd)
            raise
        self.size = status.st_size
        self.identity = (status.st_dev, status.st_ino)
        if _MINCORE is not None and self.size > 0:
            address = _MINCORE[0](None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, self.fd, 0)
            self.address = None if address in (None, _MAP_FAILED) else address

    def resident_pages(self, start: int, length: int) -> int:
        """How many pages of bytes ``[start, start + length)`` are in the page cache (0 when unknown)."""
        if self.address is None or _MINCORE is None:
            return 0
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(start + length, self.size)
        pages = -(-(end - first) // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        if _MINCORE[2](self.address + first, end - first, vector) != 0:
            return 0
        return pages - vector.raw.count(0)

    def resident(self, start: int, length: int) -> bool:
        """Whether every page of bytes ``[start, start + length)`` is in the page cache (False when unknown)."""
        end = min(start + length, self.size)
        pages = -(-(end - start // mmap.PAGESIZE * mmap.PAGESIZE) // mmap.PAGESIZE)
        return pages > 0 and self.resident_pages(start, length) == pages

    def close(self) -> None:
        if self.address is not None and _MINCORE is not None:
            _MINCORE[1](self.address, self.size)
            self.address = None
        os.close(self.fd)


def resident_fraction(path: str | os.PathLike[str]) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore``; 0.0 where it cannot be asked, 1.0 for an
    empty file). Reads nothing of the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        file = _File(fd)
    finally:
        os.close(fd)
    try:
        if file.size == 0:
            return 1.0
        resident = file.resident_pages(0, file.size)
        return resident / -(-file.size // mmap.PAGESIZE)
    finally:
        file.close()


# One read system call fills this many buffer-sized pieces (the same small buffer, listed again and again): the
# thread takes the GIL back once per call, not once per buffer. While the main thread runs Python code (imports), a
# thread that wants the GIL back can wait up to the switch interval (5 ms) for it: a call per 1 MiB could cap the
# reads near 200 MiB/s.
_PIECES = 64


class _Sink:
    """Where a thread's reads go: a small buffer, allocated on first use and overwritten by every read.

    The bytes are copied, on purpose: the copy is the CPU's first touch of each page, and on a virtual machine whose
    free memory goes back to the host (virtio-balloon free page reporting) that first touch is what costs (the host
    backs the page then): about as much as the disk read, measured (docs/benchmarks.md). Paid here, on the
    background thread; with ``sendfile`` to ``/dev/null`` (no copy) it landed in the first forward instead. On bare
    metal the copy is a memcpy of the checkpoint on an idle core.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.piece_bytes = max(mmap.PAGESIZE, min(chunk_bytes, 2**20))
        self.buffer: memoryview | None = None

    def read(self, fd: int, start: int, length: int) -> None:
        end = start + length
        if self.buffer is None:
            self.buffer = memoryview(bytearray(self.piece_bytes))
        while start < end:
            pieces, rest = divmod(min(end - start, self.piece_bytes * _PIECES), self.piece_bytes)
            views = [self.buffer] * pieces + ([self.buffer[:rest]] if rest else [])
            done = os.preadv(fd, views, start)
            if done == 0:  # the end of the file
                return
            start += done

    def close(self) -> None:
        self.buffer = None


def _read(file: _File, start: int, length: int, sink: _Sink) -> None:
    """Read bytes ``[start, start + length)`` of ``file`` into the page cache."""
    sink.read(file.fd, start, length)


# Every prefetch whose threads were started, until they end: stopped at interpreter exit (see _stop_all).
_live: weakref.WeakSet[Prefetch] = weakref.WeakSet()


def _stop_all() -> None:
    """Stop every prefetch still reading, without waiting: registered with :mod:`atexit` at import.

    A daemon thread is not joined at exit, but it goes on reading (its system calls do not need the interpreter)
    while the interpreter shuts down, taking a CPU and the disk from that shutdown (about a second of garbage
    collection for a process that imported torch and transformers), and from whatever else the machine runs. Set
    here, before the shutdown starts, the stop ends the thread after the chunk being read; the process does not wait
    for it (``exit`` ends a read in progress)."""
    for prefetch in list(_live):
        prefetch._stopped.set()


atexit.register(_stop_all)


class Prefetch:
    """Background reads of file byte ranges into the page cache, in the order given (see the module docstring).

    Build it with :meth:`start`; the threads end on their own once every chunk is read, or at the first error, or
    after :meth:`stop`. ``error`` holds the error that ended a thread early, if any.
    """

    def __init__(self, ranges: Sequence[FileRange], threads: int = THREADS, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._chunk_bytes = chunk_bytes
        self.error: BaseException | None = None
        self.read_bytes = 0
        self._budget = read_budget()
        self._reserved = 0  # bytes read or being read, against the budget
        self._files: dict[int, _File] = {}
        try:
            self._chunks = collections.deque(self._split(self._merged(ranges)))
        except BaseException:
            self._close_files()
            raise
        self.planned_bytes = sum(length for _, _, length in self._chunks)
        # (device, inode) of each file read: which files these are, whatever path or descriptor named them.
        self.files = frozenset(file.identity for file in self._files.values())
        self._running = min(threads, len(self._chunks))
        self._threads = [
            threading.Thread(target=self._run, name=f"modelpatch-prefetch-{i}", daemon=True)
            for i in range(self._running)
        ]
        if not self._threads:
            self._close_files()

    @classmethod
    def start(
        cls, ranges: Sequence[FileRange], threads: int = THREADS, chunk_bytes: int = CHUNK_BYTES
    ) -> Prefetch | None:
        """Start prefetching ``ranges``; None when there is nothing to read or it could not start (logged)."""
        if not ranges:
            return None
        try:
            prefetch = cls(ranges, threads, chunk_bytes)
            _live.add(prefetch)
            started = 0
            try:
                for thread in prefetch._threads:
                    thread.start()
                    started += 1
            finally:
                if started < len(prefetch._threads):  # the ones not started will never close the files
                    prefetch._stopped.set()
                    prefetch._finished(len(prefetch._threads) - started)
        except Exception as exc:  # a hint that cannot start is no reason to fail a load
            logger.debug("checkpoint prefetch not started: %s", exc)
            return None
        logger.debug("checkpoint prefetch started: %d bytes of %d file(s)", prefetch.planned_bytes, len(prefetch.files))
        return prefetch

    def _merged(self, ranges: Sequence[FileRange]) -> Iterator[tuple[_File, int, int]]:
        """Each range as (file, start, length), a range following the previous one in the same file merged into it."""
        current: list = []
        for r in ranges:
            file = self._files.get(r.fd)
            if file is None:
                file = self._files[r.fd] = _File(r.fd)
            if current and current[0] is file and current[1] + current[2] == r.start:
                current[2] += r.length
                continue
            if current:
                yield current[0], current[1], current[2]
            current = [file, r.start, r.length]
        if current:
            yield current[0], current[1], current[2]

    def _split(self, ranges: Iterator[tuple[_File, int, int]]) -> Iterator[tuple[_File, int, int]]:
        for file, start, length in ranges:
            end = start + length
            while start < end:
                step = min(self._chunk_bytes, end - start)
                yield file, start, step
                start += step

    def _run(self) -> None:
        sink: _Sink | None = None
        try:
            sink = _Sink(self._chunk_bytes)
            while not self._stopped.is_set():
                try:
                    file, start, length = self._chunks.popleft()
                except IndexError:
                    break
                if file.resident(start, length):
                    continue
                with self._lock:
                    if self._budget is not None and self._reserved + length > self._budget:
                        break
                    self._reserved += length
                _read(file, start, length, sink)
                with self._lock:
                    self.read_bytes += length
        except Exception as exc:
            self.error = exc
            self._stopped.set()  # the other threads stop too: a failing file fails for them as well
            logger.debug("checkpoint prefetch stopped: %s", exc)
        finally:
            if sink is not None:
                sink.close()
            self._finished(1)

    def _finished(self, threads: int) -> None:
        with self._lock:
            self._running -= threads
            last = self._running == 0
        if last:
            _live.discard(self)
            self._close_files()

    def _close_files(self) -> None:
        for file in self._files.values():
            try:
                file.close()
            except OSError as exc:
                logger.debug("checkpoint prefetch: closing %d: %s", file.fd, exc)
        self._files = {}

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the chunks being read now, and wait up to ``timeout`` seconds for the threads to end."""
        if self.alive() and not self._stopped.is_set():
            logger.debug("checkpoint prefetch stopped after %d of %d bytes", self.read_bytes, self.planned_bytes)
        self._stopped.set()
        self.join(timeout)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called or an error ended the reads."""
        return self._stopped.is_set()

    def reads(self, paths: Sequence[str | os.PathLike[str]]) -> bool:
        """Whether this prefetch reads exactly the files ``paths`` (the same files, by device and inode)."""
        try:
            return {(status.st_dev, status.st_ino) for status in map(os.stat, paths)} == self.files
        except OSError:
            return False

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: until done) for the threads to end."""
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(timeout)

    def alive(self) -> bool:
        """Whether a thread is still reading."""
        return any(thread.is_alive() for thread in self._threads)


def _safetensors_ranges(path: Path, fd: int) -> list[tuple[str, FileRange]]:
    """The (key, byte range) of each tensor in safetensors file ``path`` open as ``fd``, read from its header alone
    (no torch: see the module docstring). Checked only as far as a hint needs (ranges clipped to the file): the
    load validates the header itself."""
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise ValueError(f"{path}: too short for a safetensors header")
    (header_length,) = struct.unpack("<Q", prefix)
    if header_length > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{path}: header length {header_length} out of bounds")
    header = parse_json(path, os.pread(fd, header_length, 8))
    data = 8 + header_length
    ranges = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = (min(data + offset, size) for offset in entry["data_offsets"])
        ranges.append((key, FileRange(path, fd, begin, max(end - begin, 0))))
    return ranges


def safetensors_files(directory: Path, allow_external_symlinks: bool = False) -> list[Path]:
    """The safetensors files a load of checkpoint ``directory`` reads: the shards its index names (a name that
    would leave the directory is skipped: the load refuses it), or ``model.safetensors``; none for a pickle one.

    Raises:
        ValueError: the index or one of those files is a symlink leading outside the places the load may read
            (:func:`~modelpatch.checkpoint.layout.symlink_escape`; the load refuses it), unless
            ``allow_external_symlinks``: nothing outside the checkpoint is read, not even its index.
    """

    def confined(name: str) -> Path:
        target = None if allow_external_symlinks else symlink_escape(directory, name)
        if target is not None:
            raise ValueError(f"{directory / name}: resolves through a symlink to {target}, outside the checkpoint")
        return directory / name

    if (directory / SAFE_INDEX).is_file():
        names = sorted(set(read_weight_map(confined(SAFE_INDEX)).values()))
        return [confined(name) for name in names if not Path(name).is_absolute() and ".." not in Path(name).parts]
    return [confined(SAFE_SINGLE)] if (directory / SAFE_SINGLE).is_file() else []


def directory_prefetch(directory: Path, *, allow_external_symlinks: bool = False) -> Prefetch | None:
    """Start prefetching the tensors of local checkpoint ``directory``, in natural key order across its files, from
    the files' headers alone (no torch); None when it has no safetensors file or one cannot be read, or is one the
    load refuses as a symlink leading outside it (``allow_external_symlinks`` as the load's; logged at DEBUG level:
    the load reports it)."""
    try:
        with ExitStack() as opened:
            ranges: list[tuple[str, FileRange]] = []
            for path in safetensors_files(directory, allow_external_symlinks):
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block
                opened.callback(os.close, fd)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"{path}: not a regular file")
                ranges += _safetensors_ranges(path, fd)
            return Prefetch.start(_natural_order(ranges))  # it reads duplicates of the descriptors closed here
    except Exception as exc:
        logger.debug("checkpoint prefetch not started for %s: %s", directory, exc)
        return None


# The prefetch started by prefetching_directory() for the load running in this context (thread), which that load's
# prefetching() adopts.
_started: contextvars.ContextVar[Prefetch | None] = contextvars.ContextVar("modelpatch_prefetch", default=None)


@contextmanager
def _stopped_on_failure(prefetch: Prefetch | None) -> Iterator[None]:
    """Stop ``prefetch`` when the block fails; it goes on past a block that succeeds."""
    try:
        yield
    except BaseException:
        if prefetch is not None:
            prefetch.stop(STOP_WAIT_SECONDS)
        raise


@contextmanager
def prefetching_directory(
    directory: Path | None, *, allow_external_symlinks: bool = False
) -> Iterator[Prefetch | None]:
    """Prefetch local checkpoint ``directory`` (None: nothing to prefetch) during the block, and after it unless it
    fails. Meant to start before anything heavy is imported; a load in the block adopts it (:func:`prefetching`).
    Off only with ``MODELPATCH_PREFETCH=0``. ``allow_external_symlinks``: the load's (files that symlinks take
    outside the checkpoint are read only with it)."""
    prefetch = None
    if directory is not None and prefetch_mode() != "off":
        prefetch = directory_prefetch(directory, allow_external_symlinks=allow_external_symlinks)
    token = _started.set(prefetch)
    try:
        with _stopped_on_failure(prefetch):
            yield prefetch
    finally:
        _started.reset(token)


@contextmanager
def prefetching(checkpoint: Checkpoint, enabled: bool = True) -> Iterator[Prefetch | None]:
    """Prefetch ``checkpoint``'s tensors during the block, and after it: the threads go on past a block that succeeds
    (the first forward reads what they read), and stop with one that fails.

    A prefetch :func:`prefetching_directory` started for this load is adopted when it reads the checkpoint's files
    (and stopped when it does not, or when ``enabled`` is False: a placement that reads part of the files). Otherwise
    one is started only when ``enabled`` and ``MODELPATCH_PREFETCH=1``: started this late, it was not measured to
    help.
    """
    prefetch = _started.get()
    if prefetch is not None:
        _started.set(None)  # adopted once: a nested load starts its own
        if not enabled or not prefetch.reads(checkpoint.files):
            logger.debug("checkpoint prefetch stopped: it reads other files than the load, or the load reads a part")
            prefetch.stop(STOP_WAIT_SECONDS)
            prefetch = None
    if prefetch is None and enabled and prefetch_mode() == "on":
        try:
            ranges = checkpoint_ranges(checkpoint)
        except Exception as exc:  # the load reports a file it cannot read; the hint just does not start
            logger.debug("checkpoint prefetch not started: %s", exc)
        else:
            prefetch = Prefetch.start(ranges)
    with _stopped_on_failure(prefetch):
        yield prefetch
