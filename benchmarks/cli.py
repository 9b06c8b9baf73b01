"""Command-line start-up benchmark: how long ``modelpatch --help``, ``--version`` and ``inspect`` take.

Each measurement is a FRESH process (what a user waits for when typing the command), timed from spawn to exit with
the wall clock; the median and the fastest of ``--repeats`` runs are printed. ``--help`` and ``--version`` must not
import torch or transformers (target: well under a second); ``inspect`` does, and builds a tiny Llama on the meta
device, so it shows what a command that needs them costs on top.

The command is the installed ``modelpatch`` console script next to this Python when there is one (else
``python -m modelpatch.cli``), run on the modelpatch sources this script imports (``PYTHONPATH`` points at them), so
that a checkout is measured rather than whatever is installed.

Usage::

    python benchmarks/cli.py                 # 7 runs each
    python benchmarks/cli.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import modelpatch


def build_checkpoint(directory: Path) -> Path:
    """A tiny Llama written by stock ``save_pretrained`` (the only time this process imports torch)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def command() -> list[str]:
    script = Path(sys.executable).with_name("modelpatch")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "modelpatch.cli"]


def time_runs(args: list[str], repeats: int, env: dict[str, str]) -> list[float]:
    """Wall-clock seconds of ``repeats`` fresh runs of ``modelpatch ARGS`` (each must exit 0)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = subprocess.run([*command(), *args], capture_output=True, text=True, env=env, check=False)
        times.append(time.perf_counter() - start)
        if result.returncode != 0:
            raise SystemExit(f"modelpatch {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="fresh processes per command (default 7)")
    options = parser.parse_args(argv)

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(modelpatch.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
    }
    with tempfile.TemporaryDirectory(prefix="modelpatch-cli-bench-") as scratch:
        checkpoint = build_checkpoint(Path(scratch) / "llama")
        print(f"{' '.join(command())} ({options.repeats} fresh processes each)")
        print(f"{'command':<28} {'median':>9} {'fastest':>9}")
        for args in (["--help"], ["--version"], ["inspect", str(checkpoint)]):
            times = time_runs(args, options.repeats, env)
            label = " ".join(args[:1] + (["TINY"] if len(args) > 1 else []))
            print(f"modelpatch {label:<17} {statistics.median(times):>8.3f}s {min(times):>8.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
