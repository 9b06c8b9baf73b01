"""Tensor-parallel load benchmark: stock ``from_pretrained(tp_plan="auto")`` vs modelpatch's, two ranks on CPU (gloo).

The ~207M-parameter bf16 Llama of ``benchmarks/load.py`` is built locally with stock ``save_pretrained``. Inside one
``torchrun`` launch, every round loads it once with each side (alternating which goes first), between barriers, and
records the slowest rank's wall time and the growth of each rank's resident memory (``VmRSS``) after the load.
Both sides' first-forward logits are compared (they must be equal). modelpatch is also timed with
``fusion_config={"qkv": True, "gate_up": True}``.

Usage::

    python benchmarks/tensor_parallel.py                 # builds the checkpoint, launches 2 ranks, 5 rounds
    python benchmarks/tensor_parallel.py --quick         # a tiny model, to check the script itself
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from load import CASES, QUICK  # benchmarks/load.py: the same Llama

HERE = Path(__file__).resolve()
SIDES = ("stock", "modelpatch", "modelpatch_fused")


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _load(side: str, path: str):
    import transformers

    import modelpatch

    if side == "stock":
        return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    fusion_config = {"qkv": True, "gate_up": True} if side == "modelpatch_fused" else None
    return modelpatch.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", fusion_config=fusion_config)


def worker(path: str, rounds: int) -> None:
    """One rank: ``rounds`` rounds of every side; rank 0 prints the results as JSON."""
    import torch
    import torch.distributed as dist
    import transformers

    import modelpatch  # noqa: F401  (imported before the clock starts, like transformers)

    transformers.logging.set_verbosity_error()
    _load("stock", path)  # initialises the process group and warms imports and the page cache
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    rss: dict[str, list[int]] = {side: [] for side in SIDES}
    logits = {}
    input_ids = torch.arange(16).unsqueeze(0) % 1000
    for index in range(rounds):
        order = SIDES if index % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            gc.collect()
            dist.barrier()
            before, start = _rss(), time.perf_counter()
            model = _load(side, path)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[side].append(elapsed.item())
            rss[side].append(_rss() - before)
            if index == 0:
                with torch.no_grad():
                    logits[side] = model(input_ids=input_ids).logits
            del model
    if dist.get_rank() == 0:
        result = {
            "median_s": {side: statistics.median(values) for side, values in times.items()},
            "rounds_s": times,
            "rss_growth_mib_rank0": {side: statistics.median(v) / 2**20 for side, v in rss.items()},
            "max_abs_logit_diff_vs_stock": {
                side: (logits[side] - logits["stock"]).abs().max().item() for side in SIDES
            },
        }
        print(json.dumps(result, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/modelpatch_bench_tp"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = args.out / ("llama_quick" if args.quick else "llama")
    if not (path / "config.json").exists():
        config = LlamaConfig(**(QUICK["llama"] if args.quick else CASES["llama"][1]), dtype="bfloat16")
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    launch_ranks(HERE, ["--worker", str(path), "--rounds", str(args.rounds)], port=29517)


def launch_ranks(script: Path, arguments: list[str], *, port: int, ranks: int = 2) -> None:
    """Run ``script arguments`` on ``ranks`` processes under ``torchrun`` (this folder importable)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(script),
        *arguments,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(command, check=True, env=env)


if __name__ == "__main__":
    main()
