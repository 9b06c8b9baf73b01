"""Child-process side of the crash-safety tests (run as a script; not a test module).

Imports torch, transformers and modelpatch once, then serves one JSON command per stdin line: it forks a child that
loads ``source`` with modelpatch, shifts every parameter by ``shift`` and saves to ``target``, optionally

* under a file-size limit (``fsize``: ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored, so writes fail with ``EFBIG``, as on
  a full disk),
* killed with SIGKILL ``kill_after`` seconds after the save started (this process kills its own, still unreaped,
  child: the pid cannot have been reused), or
* killed with SIGKILL at a named point of the writer (``kill_at``), via hooks installed in the child only.

Every event is printed as one JSON line: the child's ``saving`` / ``saved`` / ``error`` and this process's ``exit``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # no thread pools before fork

import json  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import modelpatch  # noqa: E402
from modelpatch.checkpoint import writer  # noqa: E402

torch.set_num_threads(1)


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_hook(point: str) -> None:
    """SIGKILL this child at ``point`` of the write (only this forked child is affected)."""
    if point.startswith("shard:"):
        wanted = int(point.split(":")[1])
        real_save_file, calls = writer.save_file, [0]

        def save_file(*args, **kwargs):
            calls[0] += 1
            if calls[0] == wanted:
                die()
            return real_save_file(*args, **kwargs)

        writer.save_file = save_file
    elif point == "before_swap":
        writer._swap_in = lambda *args: die()
    elif point in ("after_exchange", "removing_previous"):
        real_exchange = writer._exchange

        def exchange(a, b):
            assert real_exchange(a, b), "this file system has no atomic exchange"
            if point == "after_exchange":
                die()
            return True

        def rmtree(path, *args, **kwargs):
            files = sorted(e.path for e in os.scandir(path) if e.is_file())
            for file in files[: len(files) // 2]:  # half of the previous version is gone, then the kill
                os.unlink(file)
            die()

        writer._exchange = exchange
        if point == "removing_previous":
            writer.shutil.rmtree = rmtree
    elif point == "between_renames":
        # A platform without an atomic exchange: the swap is two renames; die right after the first.
        real_rename, renames = os.rename, [0]
        writer._exchange = lambda a, b: False

        def rename(src, dst):
            real_rename(src, dst)
            renames[0] += 1
            if renames[0] == 1:
                die()

        writer.os.rename = rename
    else:
        raise ValueError(point)


def child(command: dict, ready: int) -> None:
    if command.get("fsize"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (command["fsize"], command["fsize"]))
    model = modelpatch.from_pretrained(AutoModelForCausalLM, command["source"])
    with torch.no_grad():
        for param in model.parameters():
            param.add_(command["shift"])
    if command.get("kill_at"):
        install_kill_hook(command["kill_at"])
    os.write(ready, b"s")
    start = time.monotonic()
    try:
        modelpatch.save_pretrained(model, command["target"], max_shard_size=command["max_shard_size"])
    except Exception as exc:
        emit(event="error", type=type(exc).__name__, message=str(exc))
        os._exit(1)
    emit(event="saved", seconds=time.monotonic() - start)
    os._exit(0)


def serve() -> None:
    emit(event="ready")
    for line in sys.stdin:
        command = json.loads(line)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                child(command, write_end)
            except BaseException as exc:  # noqa: BLE001 - report anything, then leave without cleanup
                emit(event="error", type=type(exc).__name__, message=str(exc))
            os._exit(2)
        os.close(write_end)
        started = os.read(read_end, 1) == b"s"
        os.close(read_end)
        if started and command.get("kill_after") is not None:
            time.sleep(command["kill_after"])
            os.kill(pid, signal.SIGKILL)  # not reaped yet: still our child, even if it has just exited
        _, status = os.waitpid(pid, 0)
        emit(
            event="exit",
            started=started,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        )


if __name__ == "__main__":
    serve()
