"""Reading a checkpoint's files into the page cache on background threads, ahead of the code that touches them.

A load maps the safetensors files and hands out views of them: their bytes are read from disk only when first
touched, by the conversions of the load and then by the first forward pass, one page fault at a time (each a small
synchronous read). On a cold page cache that costs several times what reading the same bytes in large sequential
reads costs. A :class:`Prefetch` reads the files' byte ranges in the order given (the order the load and the forward
need them) in large chunks on daemon threads, so that the faults find the pages already cached while the main thread
goes on building the model and running it.

It is a hint, and never more: the threads read with ``sendfile`` to ``/dev/null`` (the kernel reads the pages into the
page cache and copies them nowhere; a small buffer where it cannot), through their own duplicates of the file
descriptors (closing the checkpoint leaves them reading a file that is still open, never another file given the same
descriptor number); they skip chunks whose pages are all resident already (a warm cache costs one ``mincore`` per
chunk), read every byte at most once and at most half the memory available, and stop on the first error, which is
logged at DEBUG level and never raised. Opt-in: ``MODELPATCH_PREFETCH=1`` turns it on.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import mmap
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from .checkpoint import Checkpoint
from .file_range import FileRange

logger = logging.getLogger(__name__)

ENV_VAR = "MODELPATCH_PREFETCH"
# Large enough for sequential throughput, small enough that order is kept and a stop is quick.
CHUNK_BYTES = 8 * 2**20
# One reader: a second one competed with the forward's own page faults for the disk (measured, docs/benchmarks.md).
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


def prefetch_enabled() -> bool:
    """Whether loads prefetch their checkpoint: only when ``MODELPATCH_PREFETCH`` is 1/true/yes/on. Off by default:
    measured on a virtual disk with 8 MiB read-ahead, it did not shorten a cold load + first forward (see
    docs/benchmarks.md)."""
    return os.environ.get(ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


def _natural(key: str) -> list[object]:
    # "layers.2" before "layers.10": the order modules run in, which the files' (sorted) key order is not.
    return [int(part) if part.isdigit() else part for part in _DIGITS.split(key)]


def checkpoint_ranges(checkpoint: Checkpoint) -> list[FileRange]:
    """The byte ranges of ``checkpoint``'s safetensors tensors, in natural key order (layer 2 before layer 10): the
    order of a model's layers, known from the headers alone. Tensors of pickle files have none."""
    ranges = (checkpoint.file_range(key) for key in sorted(checkpoint.keys(), key=_natural))
    return [r for r in ranges if r is not None and r.length > 0]


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
            self.size = os.fstat(self.fd).st_size
        except OSError:
            os.close(self.fd)
            raise
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


# sendfile() fails with these where the kernel cannot splice from the file to /dev/null: read() is used instead.
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ESPIPE}


class _Sink:
    """Where a thread's reads go. ``sendfile`` to ``/dev/null`` makes the kernel read the pages into the page cache
    without copying them anywhere (no buffer in this process: nothing added to its memory); where it cannot,
    ``preadv`` into a small buffer, allocated on first use."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.null: int | None = os.open(os.devnull, os.O_WRONLY) if hasattr(os, "sendfile") else None
        self.buffer: memoryview | None = None

    def read(self, fd: int, start: int, length: int) -> None:
        end = start + length
        while start < end and self.null is not None:
            try:
                done = os.sendfile(self.null, fd, start, end - start)
            except OSError as exc:
                if exc.errno not in _NO_SENDFILE:
                    raise
                self.close()
                break
            if done == 0:  # the end of the file
                return
            start += done
        while start < end:
            if self.buffer is None:
                self.buffer = memoryview(bytearray(min(self.chunk_bytes, 2**20)))
            done = os.preadv(fd, [self.buffer[: end - start]], start)
            if done == 0:
                return
            start += done

    def close(self) -> None:
        if self.null is not None:
            os.close(self.null)
            self.null = None


def _read(file: _File, start: int, length: int, sink: _Sink) -> None:
    """Read bytes ``[start, start + length)`` of ``file`` into the page cache."""
    sink.read(file.fd, start, length)


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
        """Start prefetching ``ranges``; None when prefetching is turned off or could not start (logged)."""
        if not prefetch_enabled() or not ranges:
            return None
        try:
            prefetch = cls(ranges, threads, chunk_bytes)
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
        self._stopped.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: until done) for the threads to end."""
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(timeout)

    def alive(self) -> bool:
        """Whether a thread is still reading."""
        return any(thread.is_alive() for thread in self._threads)


@contextmanager
def prefetching(checkpoint: Checkpoint, enabled: bool = True) -> Iterator[Prefetch | None]:
    """Prefetch ``checkpoint``'s tensors (when ``enabled`` and not turned off) during the block, and after it: the
    threads go on past a block that succeeds (the first forward reads what they read), and stop with one that fails.
    """
    prefetch = None
    if enabled and prefetch_enabled():
        try:
            ranges = checkpoint_ranges(checkpoint)
        except Exception as exc:  # the load reports a file it cannot read; the hint just does not start
            logger.debug("checkpoint prefetch not started: %s", exc)
        else:
            prefetch = Prefetch.start(ranges)
    try:
        yield prefetch
    except BaseException:
        if prefetch is not None:
            prefetch.stop()
        raise
