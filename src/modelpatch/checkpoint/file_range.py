"""A byte range of an open checkpoint file, copied into another file without passing through this process.

A streamed conversion writes most tensors unchanged, or as the concatenation of unchanged tensors (a fused ``q/k/v``
is its parts' rows one after the other, so their bytes one after the other). Copying such bytes file to file with
``copy_file_range`` is what ``cp`` does: the kernel moves page-cache pages, and the process neither maps the source
(a page fault per 4 KiB page) nor copies the bytes through its own memory twice.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from modelpatch.errors import CheckpointError

# copy_file_range fails with these where the kernel or the file systems cannot copy between the two files (across
# file systems before Linux 5.3, some network and FUSE file systems): the bytes are then read and written instead.
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EPERM}
_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class FileRange:
    """Bytes ``[start, start + length)`` of the file open as ``fd`` (``path`` names it in errors).

    Valid while the file it was taken from stays open (see :meth:`SafetensorsFile.file_range`).
    """

    path: Path
    fd: int
    start: int
    length: int

    def narrow(self, offset: int, length: int) -> FileRange:
        """The ``length`` bytes from ``offset`` (relative to this range's start) of this range."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"{self.path}: bytes [{offset}, {offset + length}) lie outside a {self.length}-byte range")
        return FileRange(self.path, self.fd, self.start + offset, length)

    def copy_to(self, out: int) -> None:
        """Append these bytes to the file open as ``out``, at its current position, which advances past them."""
        position, left = self.start, self.length
        copy = getattr(os, "copy_file_range", None)  # Linux only
        while left and copy is not None:
            try:
                done = copy(self.fd, out, left, position)
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                break
            if done == 0:
                raise CheckpointError(f"{self.path}: ends before byte {position} (was it truncated while being read?)")
            position, left = position + done, left - done
        while left:
            data = os.pread(self.fd, min(left, _CHUNK), position)
            if not data:
                raise CheckpointError(f"{self.path}: ends before byte {position} (was it truncated while being read?)")
            view = memoryview(data)
            while view:
                view = view[os.write(out, view) :]
            position, left = position + len(data), left - len(data)
