"""Offline conversion at scale: ``modelpatch convert`` of a >= 4 GB sharded bf16 Llama into the runtime layout and back.

The checkpoint is a Llama config (bf16, 10 layers of hidden size 4096: 4.56 GB) built on the meta device,
materialised with ``to_empty`` and filled tensor by tensor (the model exists once in memory, never twice), then saved
sharded (1 GB shards) by stock ``save_pretrained``.

Measured, each in its own process, in alternating rounds after one warm-up run of each (page cache warm: every
file was read, the source and the runtime checkpoint fit in RAM), each after an untimed ``sync`` so that none pays
for writing back what an earlier one left dirty:

* ``cp -r`` of the checkpoint directory, and ``cp -r`` followed by ``sync`` of the copied files (the converter
  fsyncs every file it writes before swapping the directory in; plain ``cp`` leaves its data in the page cache);
* ``modelpatch convert SRC RUNTIME --fusion qkv,gate_up --runtime-format --max-shard-size 1GB``;
* ``modelpatch convert RUNTIME BACK --fusion none --max-shard-size 1GB`` (back to the original layout);

wall time, throughput (checkpoint bytes / seconds) and its ratio to ``cp``'s, and the peak RSS of each convert process
(``ru_maxrss`` from ``wait4``) against the bound: the largest output shard + 256 MB. With ``--cold``, one more round
runs after ``echo 1 > /proc/sys/vm/drop_caches`` before each command (when this process may write it). Targets:
throughput >= 0.5x ``cp``'s, peak RSS <= the bound; the converted-back files must equal the source's tensors.

Usage::

    python benchmarks/convert_scale.py                 # 4.56 GB checkpoint, 2 rounds (~10 minutes, ~20 GB of disk)
    python benchmarks/convert_scale.py --cold --rounds 3 --out /tmp/convert_scale
    python benchmarks/convert_scale.py --quick         # a 60 MB checkpoint, to check the script itself

Every file it writes is deleted at the end (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FULL = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 10,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
}
QUICK = {
    **FULL,
    "vocab_size": 8000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
SHARD = "1GB"
BOUND_SLACK = 256 * 2**20


def build(path: Path, sizes: dict, shard: str) -> None:
    """A bf16 Llama of ``sizes`` saved by stock ``save_pretrained`` in ``shard``-sized files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**sizes, dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # filled in place: no second copy of the model
            parameter.normal_(0, 0.02, generator=generator)
    model.save_pretrained(path, max_shard_size=shard)


def _tensor_bytes(directory: Path) -> int:
    from modelpatch.checkpoint import Checkpoint

    with Checkpoint.open(directory) as checkpoint:
        return checkpoint.total_bytes


def _run(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of ``command``, run under ``/usr/bin/time`` (a small parent: the peak is the
    command's own, not inherited from this Python process across fork)."""
    with tempfile.NamedTemporaryFile("r") as report:
        start = time.perf_counter()
        subprocess.run(["/usr/bin/time", "-f", "%M", "-o", report.name, *command], check=True)
        seconds = time.perf_counter() - start
        return seconds, int(report.read().split()[-1]) * 1024


CONVERT = """
import json, sys, time
import torch, transformers, transformers.models.llama.modeling_llama
from modelpatch.cli.main import main
start = time.perf_counter()
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"seconds": time.perf_counter() - start, "code": code}, f)
sys.exit(code)
"""


def _convert(arguments: list[str]) -> tuple[float, int, float]:
    """``modelpatch convert`` in a fresh process: wall seconds and peak RSS of the whole command, and the seconds of
    the command proper (after importing torch, transformers and the Llama modeling module)."""
    with tempfile.NamedTemporaryFile("r") as timing:
        seconds, rss = _run([sys.executable, "-c", CONVERT, timing.name, "-q", "convert", *arguments])
        return seconds, rss, json.loads(timing.read())["seconds"]


def _drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def _largest_shard(directory: Path) -> int:
    return max(path.stat().st_size for path in directory.glob("*.safetensors"))


def _same_tensors(a: Path, b: Path) -> bool:
    """Whether the checkpoints hold the same keys with the same bytes, read one tensor at a time."""
    import torch
    from safetensors import safe_open

    def index(directory: Path) -> dict[str, Path]:
        found = {}
        for path in directory.glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                found.update(dict.fromkeys(f.keys(), path))
        return found

    left, right = index(a), index(b)
    if left.keys() != right.keys():
        return False
    for key in sorted(left):
        with safe_open(left[key], "pt") as f, safe_open(right[key], "pt") as g:
            x, y = f.get_tensor(key), g.get_tensor(key)
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):  # bitwise
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/modelpatch-convert-scale"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="one more round after dropping the page cache")
    parser.add_argument("--quick", action="store_true", help="a small checkpoint, to check the script")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    args = parser.parse_args()

    out = args.out
    source, copy, runtime, back = out / "src", out / "cp", out / "runtime", out / "back"
    shard = "20MB" if args.quick else SHARD
    out.mkdir(parents=True, exist_ok=True)
    try:
        if not (source / "config.json").is_file():
            print(f"building the checkpoint in {source} ...", flush=True)
            build_seconds, build_rss = _run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--build",
                    str(source),
                    json.dumps(QUICK if args.quick else FULL),
                    shard,
                ]
            )
            print(f"built in {build_seconds:.1f} s, peak RSS {build_rss / 2**30:.2f} GiB", flush=True)
        size = _tensor_bytes(source)
        files = sorted(p.name for p in source.glob("*.safetensors"))
        print(
            f"checkpoint: {size / 1e9:.2f} GB of bf16 tensors in {len(files)} shards "
            f"(largest {_largest_shard(source) / 1e9:.2f} GB)",
            flush=True,
        )

        commands = {
            "cp -r": ["cp", "-r", str(source), str(copy)],
            "cp -r + sync": ["sh", "-c", f'cp -r "{source}" "{copy}" && sync "{copy}"/*'],
            "convert -> runtime": [
                str(source),
                str(runtime),
                "--fusion",
                "qkv,gate_up",
                "--runtime-format",
                "--max-shard-size",
                shard,
            ],
            "convert -> original": [str(runtime), str(back), "--fusion", "none", "--max-shard-size", shard],
        }
        targets = {"cp -r": copy, "cp -r + sync": copy, "convert -> runtime": runtime, "convert -> original": back}

        def measure(name: str) -> tuple[float, int, float]:
            shutil.rmtree(targets[name], ignore_errors=True)
            # Untimed: every command starts with no dirty pages of an earlier one still being written back (plain
            # `cp` leaves its 4.5 GB dirty, and the disk would be writing them during the next command).
            subprocess.run(["sync"], check=True)
            if name.startswith("convert"):
                return _convert(commands[name])
            seconds, rss = _run(commands[name])
            return seconds, rss, seconds

        results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in commands}
        for name in commands:  # warm-up: page cache, and the runtime checkpoint the way back reads
            measure(name)
        for _ in range(args.rounds):
            for name in commands:
                results[name].append(measure(name))
        cold: dict[str, tuple[float, int, float]] = {}
        cold_state = "not measured (pass --cold)"
        if args.cold:
            if _drop_caches():
                for name in commands:
                    _drop_caches()
                    cold[name] = measure(name)
                cold_state = "measured with the page cache dropped (echo 1 > /proc/sys/vm/drop_caches) before each"
            else:
                cold_state = "not measured: /proc/sys/vm/drop_caches is not writable here"

        def row(name: str, seconds: float, proper: float, rss: int, cp: float, cp_sync: float) -> str:
            return (
                f"{name:20} {seconds:8.2f} {proper:8.2f} {size / seconds / 1e9:6.2f} {cp / seconds:6.2f}x "
                f"{cp_sync / seconds:9.2f}x {cp / proper:11.2f}x {rss / 2**20:8.0f}Mi"
            )

        header = (
            f"{'command':20} {'seconds':>8} {'proper':>8} {'GB/s':>6} {'vs cp':>7} {'vs cp+sync':>10} "
            f"{'proper vs cp':>12} {'peak RSS':>9}"
        )
        print(
            f"\npage cache warm (each command ran once before), {args.rounds} alternating rounds, median, each "
            "command started after a `sync`; 'proper' excludes importing torch and transformers"
        )
        cp_seconds = statistics.median(s for s, _, _ in results["cp -r"])
        cp_sync_seconds = statistics.median(s for s, _, _ in results["cp -r + sync"])
        print(header)
        for name, runs in results.items():
            print(
                row(
                    name,
                    statistics.median(s for s, _, _ in runs),
                    statistics.median(p for _, _, p in runs),
                    max(r for _, r, _ in runs),
                    cp_seconds,
                    cp_sync_seconds,
                )
            )
        print(f"\ncold: {cold_state}")
        if cold:
            print(header)
            for name, (seconds, rss, proper) in cold.items():
                print(row(name, seconds, proper, rss, cold["cp -r"][0], cold["cp -r + sync"][0]))
        print()
        ok = True
        for name, target in (("convert -> runtime", runtime), ("convert -> original", back)):
            bound = _largest_shard(target) + BOUND_SLACK
            rss = max(r for _, r, _ in results[name])
            ratio = cp_seconds / statistics.median(s for s, _, _ in results[name])
            print(
                f"{name}: peak RSS {rss / 2**20:.0f} MiB vs bound {bound / 2**20:.0f} MiB (largest output shard "
                f"{_largest_shard(target) / 2**20:.0f} MiB + 256 MiB): {'ok' if rss <= bound else 'OVER'}; "
                f"throughput {ratio:.2f}x cp's, warm (target >= 0.5x): {'ok' if ratio >= 0.5 else 'BELOW'}"
            )
            ok &= rss <= bound and ratio >= 0.5
        same = _same_tensors(source, back)
        print(f"converted back == source, tensor for tensor: {same}")
        print("PASSED" if ok and same else "TARGETS MISSED")
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        build(Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
    else:
        main()
