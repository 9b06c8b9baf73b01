"""Whole-process benchmark: what a user waits for, modelpatch beside stock transformers, in one run.

Each sample is one FRESH Python process running the script a user writes, with only its import line changed::

    from transformers import AutoModelForCausalLM      # stock
    from modelpatch import AutoModelForCausalLM        # modelpatch (optionally fusion_config={"qkv": ..., ...})
    model = AutoModelForCausalLM.from_pretrained(path)
    model(input_ids=...)                               # first forward, 16 tokens, under torch.no_grad()

The clock starts in this (driver) process just before the child is spawned and stops when the child's first forward
returns, so interpreter start, every import and the load are in the figure. Figures, each labelled in the output:

* ``whole-process warm``: every checkpoint page in the page cache before each sample (read once, checked with
  ``mincore``); ~380 MB bf16 Llama;
* ``whole-process fused warm``: the same, modelpatch with ``qkv`` + ``gate_up`` fusions (stock cannot fuse: it
  loads the same checkpoint unfused);
* ``whole-process cold``: every checkpoint file evicted from the page cache before each sample
  (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file, after an ``fsync``; the resident fraction is then measured
  with ``mincore`` and printed), then ``--settle`` seconds of waiting (default 15); ~2.2 GB TinyLlama-shaped bf16
  Llama. A third side, modelpatch with ``MODELPATCH_PREFETCH=0``, shows what the checkpoint prefetch (started first
  thing in ``from_pretrained``) does. Why the wait: on a virtual machine with virtio-balloon free page reporting,
  the memory the eviction frees goes back to the host about two seconds later, and the first CPU touch of each page
  re-allocated from it then costs a host fault, about as much as reading it from disk (measured here: ~3.5 s for
  2.2 GB). A checkpoint that is really cold (the first load after a boot, or after other work pushed it out) sits
  in such memory; one evicted just before the sample does not, which makes the figure depend on how fast the child
  starts. ``--settle 0`` measures that other state. ``cold-floor`` runs stock and modelpatch on the same checkpoint
  warm: what each costs without the disk, the floor a cold start cannot go below;
* ``in-process``: measured inside the warm samples: the ``from_pretrained`` call alone, first call in the fresh
  process (the imports it makes land there), and a second load + forward in the same process.

Python modules stay cached in every case (one untimed sample per side first; bytecode cached under a prefix in
/tmp, as an installed package has it, even where ``PYTHONDONTWRITEBYTECODE`` is set): only the checkpoint is
evicted. Peak RSS is the child's ``VmHWM`` after
its first forward. The sides alternate (A B, then B A, ...), medians over the pairs are reported with the median of
the per-pair ratios, and the load average is printed before and after each case (the machine may be shared: read
ratios, not absolute times).

Checkpoints are built with stock ``save_pretrained`` into ``--out`` (default: a folder under /tmp) and deleted at
the end unless ``--keep``.

Usage::

    python benchmarks/process.py                    # all cases, 5 pairs each (~10 minutes on 2 cores)
    python benchmarks/process.py --pairs 7 --cases warm fused
    python benchmarks/process.py --cases cold cold-floor --settle 0
    python benchmarks/process.py --quick            # tiny checkpoints: checks the script, not the speed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fuse_live import LLAMA as LLAMA_WARM  # the ~380 MB Llama of the other benchmarks
from fuse_live import LLAMA_QUICK as QUICK

from modelpatch.checkpoint.prefetch import resident_fraction as file_fraction

# The child: the user's script, plus the timestamps and the in-process figures printed as one JSON line.
CHILD = r"""
import json, sys, time
started = time.time()
side, path, fused, again = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
if side == "stock":
    from transformers import AutoModelForCausalLM
else:
    from modelpatch import AutoModelForCausalLM
imported = time.time()
kwargs = {"fusion_config": {"qkv": True, "gate_up": True}} if fused else {}
model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
loaded = time.time()
import torch
input_ids = torch.arange(16).unsqueeze(0)
with torch.no_grad():
    model(input_ids=input_ids)
forward = time.time()
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
second = None
if again:
    del model
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    second_loaded = time.time()
    with torch.no_grad():
        model(input_ids=input_ids)
    second = (second_loaded - start, time.time() - start)
print(json.dumps({"started": started, "imported": imported, "loaded": loaded, "forward": forward, "peak": peak,
                  "second": second}))
"""

PYCACHE = Path(tempfile.gettempdir()) / "modelpatch-process-bench-pycache"
LLAMA_COLD = {  # TinyLlama-1.1B's shape
    **LLAMA_WARM,
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


# ------------------------------------------------------------------------------------------------- the driver


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
    )


def sample(side: str, path: Path, fused: bool, again: bool) -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    # Bytecode cached as in an installed package (site-packages has its .pyc files): with PYTHONDONTWRITEBYTECODE
    # set, a source checkout would compile modelpatch's modules in every sample while transformers' are cached.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    if side == "modelpatch-no-prefetch":
        env["MODELPATCH_PREFETCH"] = "0"
    spawned = time.time()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, side, str(path), "1" if fused else "0", "1" if again else "0"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["total"] = out["forward"] - spawned
    out["load"] = out["loaded"] - out["imported"]
    out["import"] = out["imported"] - out["started"]
    return out


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


EVICTED = "evicted: fsync + posix_fadvise(DONTNEED) per file, then {settle:g} s of waiting"
WARMED = "warmed: every file read"


def run_case(
    name: str, path: Path, sides: list[str], pairs: int, cold: bool, fused: bool, settle: float = 0.0
) -> list[str]:
    """Alternate the sides ``pairs`` times; returns the report lines of the case."""
    samples: dict[str, list[dict]] = {side: [] for side in sides}
    residency: list[float] = []
    for side in sides:  # untimed: writes the bytecode caches and reads the Python files into the page cache
        warm(path)
        sample(side, path, fused and side != "stock", again=False)
    before = loadavg()
    for i in range(pairs):
        order = sides if i % 2 == 0 else sides[::-1]
        for side in order:
            residency.append(evict(path, settle) if cold else warm(path))
            samples[side].append(sample(side, path, fused and side != "stock", again=not cold))
    after = loadavg()
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    lines = [
        f"## {name}: {path.name}, {size / 1e6:.0f} MB in {len(list(path.glob('*.safetensors')))} file(s); "
        f"{pairs} pairs; load average before {before}, after {after}",
        f"   page cache before each sample ({EVICTED.format(settle=settle) if cold else WARMED}); "
        f"resident fraction by mincore: min {min(residency):.3f}, max {max(residency):.3f}",
    ]
    stock = samples["stock"]

    def row(label: str, key, fmt=lambda v: f"{v:.3f} s") -> None:
        base = [key(s) for s in stock]
        cells = [f"stock {fmt(statistics.median(base))}"]
        for side in sides[1:]:
            mine = [key(s) for s in samples[side]]
            ratios = [m / b for m, b in zip(mine, base, strict=True)]
            cells.append(
                f"{side} {fmt(statistics.median(mine))}: {statistics.median(mine) / statistics.median(base):.2f}x "
                f"(per-pair median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x)"
            )
        lines.append(f"   {label:<46} " + " | ".join(cells))

    row("whole process: spawn -> first forward done", lambda s: s["total"])
    row("  of which: the import line", lambda s: s["import"])
    row("in-process: from_pretrained, first call", lambda s: s["load"])
    row("in-process: first forward", lambda s: s["forward"] - s["loaded"])
    if not cold:
        row("in-process: second load in the same process", lambda s: s["second"][0])
        row("in-process: second load + forward", lambda s: s["second"][1])
    row("peak RSS of the process (VmHWM)", lambda s: s["peak"], fmt=lambda v: f"{v / 2**20:.0f} MiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="where checkpoints are built (default: under /tmp)")
    parser.add_argument("--pairs", type=int, default=5, help="alternated samples per side (medians reported)")
    parser.add_argument(
        "--cases", nargs="+", choices=("warm", "fused", "cold", "cold-floor"), default=["warm", "fused", "cold"]
    )
    parser.add_argument(
        "--settle", type=float, default=15.0, help="seconds waited after each eviction (cold case; see above)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (reused by the next run)")
    parser.add_argument("--quick", action="store_true", help="tiny checkpoints: check the script, not the speed")
    args = parser.parse_args(argv)

    out = args.out or Path(tempfile.gettempdir()) / "modelpatch-process-bench"
    out.mkdir(parents=True, exist_ok=True)
    small, large = out / ("quick" if args.quick else "llama-380mb"), out / ("quick" if args.quick else "llama-2.2gb")
    try:
        build(small, QUICK if args.quick else LLAMA_WARM)
        if "cold" in args.cases or "cold-floor" in args.cases:
            build(large, QUICK if args.quick else LLAMA_COLD)
        report = [f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {'QUICK' if args.quick else 'full size'}"]
        if "warm" in args.cases:
            report += run_case("whole-process warm", small, ["stock", "modelpatch"], args.pairs, False, False)
        if "fused" in args.cases:
            report += run_case(
                "whole-process fused warm (qkv + gate_up)", small, ["stock", "modelpatch"], args.pairs, False, True
            )
        if "cold" in args.cases:
            sides = ["stock", "modelpatch", "modelpatch-no-prefetch"]
            report += run_case("whole-process cold", large, sides, args.pairs, True, False, args.settle)
        if "cold-floor" in args.cases:
            floor = "whole-process warm, the cold case's checkpoint"
            report += run_case(floor, large, ["stock", "modelpatch"], args.pairs, False, False)
        print("\n".join(report))
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(PYCACHE, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
