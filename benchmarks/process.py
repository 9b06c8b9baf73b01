"""Whole-process benchmark: what a user waits for, from the exec of ``python`` to the exit of the process.

Each sample is one FRESH Python process running the script a user writes, with only its import line changed::

    import torch
    from transformers import AutoModelForCausalLM      # stock
    from modelpatch import AutoModelForCausalLM        # modelpatch (side "fused": fusion_config qkv + gate_up)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        model(torch.randint(0, vocab, (1, 16)))

The clock starts in this (driver) process just before the child is spawned and stops when ``os.wait4`` has reaped
it: interpreter start, every import, the load, the forward, the ``atexit`` handlers and the interpreter's shutdown
(its garbage collections, the unmapping of the checkpoint, the threads still running) are all in the figure. CPU
time is the child's user + system time from the same ``wait4`` (every thread of it), less noisy than the wall clock
on a shared machine. The child also stamps (``time.monotonic``, one clock for every process) its first line, the
end of its import line, of the load, of its last line, and the end of the ``atexit`` handlers (a handler registered
first runs last), so each figure splits into:

* ``start``: spawn -> the script's first line (interpreter start, ``site``);
* ``script``: first line -> last line, of which the import line, ``from_pretrained`` and the forward;
* ``exit``: last line -> reaped, of which ``atexit`` (the handlers) and shutdown (the rest); with the CPU time spent
  after the last line, and the threads still alive at the last line and after the ``atexit`` handlers.

Sides (``--sides``): ``stock``, ``modelpatch``, ``fused`` (modelpatch with ``qkv`` + ``gate_up``; stock cannot
fuse), ``no-prefetch`` (modelpatch with ``MODELPATCH_PREFETCH=0``). They alternate in rotating order (A B C, C B A,
...), one untimed sample per side first; medians over the rounds are printed with min-max, and per-round ratios
to stock (median and range). The load average is printed before and after each case: read ratios, not absolute
times, on a shared machine.

Cases (``--cases``):

* ``warm``: every checkpoint page in the page cache before each sample (every file read; ``mincore`` checks it);
* ``cold``: every checkpoint file evicted from the page cache before each sample (``fsync`` then
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file, which needs no privilege; the fraction still resident is measured
  with ``mincore`` and printed), then ``--settle`` seconds of waiting (default 15: on a virtual machine with
  virtio-balloon free page reporting, memory freed by the eviction goes back to the host about two seconds later,
  and the first touch of each page re-allocated from it then costs a host fault: a checkpoint really cold, the first
  load after a boot, sits in such memory; ``--settle 0`` measures the other state).

The checkpoint is a ~414 MB (383 MiB) bf16 Llama, or with ``--large`` a ~2.2 GB TinyLlama-shaped one, written by
stock ``save_pretrained`` into ``--out`` (default: a folder under /tmp; deleted at the end unless ``--keep``). Python
modules stay cached in every case (bytecode under a prefix in /tmp, as an installed package has its ``.pyc`` files,
even where ``PYTHONDONTWRITEBYTECODE`` is set: a source checkout would otherwise compile modelpatch's ~80 modules
in every sample while transformers' are cached): only the checkpoint is evicted.

``--external`` runs each sample under GNU ``/usr/bin/time`` as well and prints its medians beside this script's,
from the same samples: an outside timer of the same processes. ``--print-command SIDE`` prints the exact command of
one sample (for ``hyperfine`` or any other timer) and exits.

Usage::

    python benchmarks/process.py                                  # warm, stock / modelpatch / fused, 9 rounds
    python benchmarks/process.py --cases cold --large --sides stock modelpatch no-prefetch --rounds 5
    python benchmarks/process.py --external --rounds 5
    python benchmarks/process.py --quick                          # tiny checkpoint: checks the script, not speed
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fuse_live import LLAMA as LLAMA_SMALL  # the ~414 MB Llama of the other benchmarks
from fuse_live import LLAMA_QUICK as QUICK

from modelpatch.checkpoint.prefetch import resident_fraction as file_fraction

# The user's script (the lines between the two markers), with the stamps around it. The stamps cost nothing
# measurable: two imports already made by the interpreter's start, a few clock reads and one small write at exit.
CHILD = r"""
import atexit, os, sys, time
_first = time.monotonic()
_stamps = {"first": _first}
def _threads():
    import threading
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
def _after_atexit():  # registered first: runs after every other atexit handler
    times = os.times()
    _stamps.update(atexit_done=time.monotonic(), cpu_atexit_done=times.user + times.system,
                   threads_after_atexit=_threads())
    with open(os.environ["PROCESS_BENCH_STAMPS"], "w") as out:
        out.write(__import__("json").dumps(_stamps))
atexit.register(_after_atexit)
side, path, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])  # vocab: 32000 but for --quick
# ---- the user's script
import torch
if side == "stock":
    from transformers import AutoModelForCausalLM
else:
    from modelpatch import AutoModelForCausalLM
_stamps["imported"] = time.monotonic()
kwargs = {"fusion_config": {"qkv": True, "gate_up": True}} if side == "fused" else {}
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
_stamps["loaded"] = time.monotonic()
with torch.no_grad():
    model(torch.randint(0, vocab, (1, 16)))
# ---- end of the user's script
_times = os.times()
_stamps.update(last=time.monotonic(), cpu_last=_times.user + _times.system, threads_at_last=_threads())
"""

SIDES = ("stock", "modelpatch", "fused", "no-prefetch")
PYCACHE = Path(tempfile.gettempdir()) / "modelpatch-process-bench-pycache"
LLAMA_LARGE = {  # TinyLlama-1.1B's shape
    **LLAMA_SMALL,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}


# ------------------------------------------------------------------------------------------------- page cache


def resident_fraction(folder: Path) -> float:
    """The fraction of the pages of the safetensors files in ``folder`` that are in the page cache (``mincore``)."""
    files = sorted(folder.glob("*.safetensors"))
    sizes = [file.stat().st_size for file in files]
    return sum(file_fraction(f) * size for f, size in zip(files, sizes, strict=True)) / max(sum(sizes), 1)


def evict(folder: Path, settle: float = 0.0) -> float:
    """Drop ``folder``'s files from the page cache and wait ``settle`` seconds (the module docstring says why);
    returns the fraction of their pages still resident."""
    for file in sorted(folder.iterdir()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    time.sleep(settle)
    return resident_fraction(folder)


def warm(folder: Path) -> float:
    """Read every file of ``folder`` once; returns the fraction of their pages then resident."""
    for file in sorted(folder.iterdir()):
        with file.open("rb") as f:
            while f.read(1 << 24):
                pass
    return resident_fraction(folder)


# ------------------------------------------------------------------------------------------------- one sample


def build(path: Path, shape: dict) -> None:
    if (path / "config.json").is_file():
        return
    print(f"building {path} ...", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, json, torch, transformers\n"
            "from transformers import AutoConfig, AutoModelForCausalLM\n"
            "transformers.logging.set_verbosity_error()\n"
            "torch.manual_seed(0)\n"
            "config = AutoConfig.for_model('llama', **json.loads(sys.argv[2]))\n"
            "AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(sys.argv[1])\n",
            str(path),
            json.dumps(shape),
        ],
        check=True,
        capture_output=True,
    )


def child_env(side: str) -> dict[str, str]:
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    # Bytecode cached as in an installed package (see the module docstring).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    if side == "no-prefetch":
        env["MODELPATCH_PREFETCH"] = "0"
    return env


def child_command(side: str, path: Path) -> list[str]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return [sys.executable, "-c", CHILD, side, str(path), str(vocab)]


def sample(side: str, path: Path, scratch: Path, external: bool) -> dict:
    """One fresh process of ``side``'s script on checkpoint ``path``: its figures (seconds; peak RSS in bytes)."""
    stamps_file, time_file = scratch / "stamps.json", scratch / "time.txt"
    env = {**child_env(side), "PROCESS_BENCH_STAMPS": str(stamps_file)}
    command = child_command(side, path)
    if external:
        command = ["/usr/bin/time", "-o", str(time_file), "-f", "%e %U %S", *command]
    spawned = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    reaped = time.monotonic()
    errors = process.stderr.read().decode(errors="replace") if process.stderr else ""
    if process.stderr:
        process.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{side} sample failed ({os.waitstatus_to_exitcode(status)}):\n{errors[-4000:]}")
    stamps = json.loads(stamps_file.read_text())
    result = {
        "wall": reaped - spawned,
        "cpu": usage.ru_utime + usage.ru_stime,
        "start": stamps["first"] - spawned,
        "script": stamps["last"] - stamps["first"],
        "import": stamps["imported"] - stamps["first"],
        "load": stamps["loaded"] - stamps["imported"],
        "forward": stamps["last"] - stamps["loaded"],
        "exit": reaped - stamps["last"],
        "atexit": stamps["atexit_done"] - stamps["last"],
        "shutdown": reaped - stamps["atexit_done"],
        "exit_cpu": usage.ru_utime + usage.ru_stime - stamps["cpu_last"],
        "peak": usage.ru_maxrss * 1024,
        "threads_at_last": stamps["threads_at_last"],
        "threads_after_atexit": stamps["threads_after_atexit"],
    }
    if external:  # /usr/bin/time timed itself (fork + exec of the child); its wall clock has 10 ms steps
        wall, user, system = (float(v) for v in time_file.read_text().split()[-3:])
        result.update(external_wall=wall, external_cpu=user + system)
    return result


# ------------------------------------------------------------------------------------------------- the driver


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run_case(
    cold: bool, path: Path, sides: list[str], rounds: int, settle: float, external: bool, scratch: Path
) -> list[str]:
    """Alternate the sides ``rounds`` times; returns the report lines of the case."""
    samples: dict[str, list[dict]] = {side: [] for side in sides}
    residency: list[float] = []
    for side in sides:  # untimed: writes the bytecode caches, reads the Python files into the page cache
        warm(path)
        sample(side, path, scratch, external=False)
    before = loadavg()
    for i in range(rounds):
        shift = i % len(sides)
        order = sides[shift:] + sides[:shift]
        for side in order if i % 2 == 0 else order[::-1]:
            residency.append(evict(path, settle) if cold else warm(path))
            samples[side].append(sample(side, path, scratch, external))
    after = loadavg()
    files = list(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    how = (
        f"evicted (fsync + posix_fadvise DONTNEED per file), then {settle:g} s of waiting"
        if cold
        else "every file read"
    )
    lines = [
        f"## {'cold' if cold else 'warm'}: {path.name}, {size / 1e6:.0f} MB in {len(files)} file(s); {rounds} rounds; "
        f"load average before {before}, after {after}",
        f"   page cache before each sample: {how}; resident fraction by mincore: "
        f"min {min(residency):.3f}, max {max(residency):.3f}",
    ]
    base = sides[0]

    def row(label: str, key: Callable[[dict], float], unit: str = "s") -> None:
        def fmt(value: float) -> str:
            return f"{value / 2**20:.0f} MiB" if unit == "MiB" else f"{value:.3f} s"

        cells = []
        for side in sides:
            values = [key(s) for s in samples[side]]
            cell = f"{side} {fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"
            if side != base:
                pairs = zip(samples[side], samples[base], strict=True)
                ratios = [key(s) / key(b) if key(b) else float("nan") for s, b in pairs]
                median_ratio = statistics.median(values) / max(statistics.median(key(s) for s in samples[base]), 1e-9)
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
                cell += f" = {median_ratio:.3f}x (per round {statistics.median(ratios):.3f}x, {spread})"
            cells.append(cell)
        lines.append(f"   {label:<38} " + " | ".join(cells))

    row("WHOLE PROCESS wall, exec -> exit", lambda s: s["wall"])
    row("WHOLE PROCESS CPU (user + sys)", lambda s: s["cpu"])
    if external:
        row("  /usr/bin/time wall (same samples)", lambda s: s["external_wall"])
        row("  /usr/bin/time CPU (same samples)", lambda s: s["external_cpu"])
    row("start: spawn -> first line", lambda s: s["start"])
    row("script: first -> last line", lambda s: s["script"])
    row("  the import line", lambda s: s["import"])
    row("  from_pretrained", lambda s: s["load"])
    row("  the forward", lambda s: s["forward"])
    row("exit: last line -> reaped", lambda s: s["exit"])
    row("  atexit handlers", lambda s: s["atexit"])
    row("  shutdown after them", lambda s: s["shutdown"])
    row("  CPU after the last line", lambda s: s["exit_cpu"])
    row("peak RSS (ru_maxrss)", lambda s: s["peak"], unit="MiB")
    for side in sides:
        at_last = sorted({name for s in samples[side] for name in s["threads_at_last"]})
        after_atexit = sorted({name for s in samples[side] for name in s["threads_after_atexit"]})
        lines.append(
            f"   {side}: threads alive at the last line {at_last or 'none'}; after atexit {after_atexit or 'none'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="where the checkpoint is built (default: under /tmp)")
    parser.add_argument("--rounds", type=int, default=9, help="alternated samples per side (medians reported)")
    parser.add_argument("--cases", nargs="+", choices=("warm", "cold"), default=["warm"])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=["stock", "modelpatch", "fused"])
    parser.add_argument("--large", action="store_true", help="the ~2.2 GB checkpoint instead of the ~414 MB one")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds waited after each eviction (cold)")
    parser.add_argument("--external", action="store_true", help="time each sample with /usr/bin/time as well")
    parser.add_argument("--print-command", choices=SIDES, help="print one sample's command line and exit")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (reused by the next run)")
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint: check the script, not the speed")
    args = parser.parse_args(argv)

    out = args.out or Path(tempfile.gettempdir()) / "modelpatch-process-bench"
    out.mkdir(parents=True, exist_ok=True)
    name = "quick" if args.quick else ("llama-2.2gb" if args.large else "llama-414mb")
    path = out / name
    try:
        build(path, QUICK if args.quick else (LLAMA_LARGE if args.large else LLAMA_SMALL))
        if args.print_command:
            env = {k: v for k, v in child_env(args.print_command).items() if os.environ.get(k) != v}
            unset = [k for k in os.environ if k not in child_env(args.print_command)]
            prefix = " ".join([*(f"-u {k}" for k in unset), *(f"{k}={shlex.quote(v)}" for k, v in env.items())])
            stamps = f"PROCESS_BENCH_STAMPS={out / 'stamps.json'}"
            print(f"env {prefix} {stamps} {shlex.join(child_command(args.print_command, path))}")
            args.keep = True
            return 0
        report = [
            f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {'QUICK' if args.quick else 'full size'}; "
            "ratios are to the first side"
        ]
        with tempfile.TemporaryDirectory(prefix="modelpatch-process-bench-") as scratch:
            for case in args.cases:
                report += run_case(
                    case == "cold", path, args.sides, args.rounds, args.settle, args.external, Path(scratch)
                )
        print("\n".join(report))
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(PYCACHE, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
