"""Command-line start-up benchmark: how long ``modelpatch --help``, ``--version``, ``inspect`` and ``plan`` take.

Each measurement is a FRESH process (what a user waits for when typing the command), timed from spawn to exit
(``os.wait4``: wall clock, and the CPU time of the process beside it); the median and the fastest of ``--repeats``
runs are printed, the commands alternating run by run. ``--help`` and ``--version`` must not import torch or
transformers (target: well under a second); ``inspect`` and ``plan`` do, and build a tiny Llama on the meta device.
Beside them, the imports such a command cannot avoid: ``python -c "import transformers"`` and ``python -c "import
transformers.modeling_utils"`` (what any transformers model class imports, torch included).

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


def time_run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one fresh run of ``argv``, spawn to exit (it must exit 0)."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    errors = process.stderr.read().decode(errors="replace") if process.stderr else ""
    if process.stderr:
        process.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}:\n{errors}")
    return wall, usage.ru_utime + usage.ru_stime


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
    # Bytecode cached, as an installed package has it (with PYTHONDONTWRITEBYTECODE set, a source checkout would
    # compile modelpatch's modules in every run while transformers' are cached).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryDirectory(prefix="modelpatch-cli-bench-") as scratch:
        env["PYTHONPYCACHEPREFIX"] = str(Path(scratch) / "pycache")
        checkpoint = build_checkpoint(Path(scratch) / "llama")
        runs = {
            "modelpatch --help": [*command(), "--help"],
            "modelpatch --version": [*command(), "--version"],
            "modelpatch inspect TINY": [*command(), "inspect", str(checkpoint)],
            "modelpatch plan TINY": [*command(), "plan", str(checkpoint)],
            "import transformers": [sys.executable, "-c", "import transformers"],
            "import transformers.modeling_utils": [sys.executable, "-c", "import transformers.modeling_utils"],
        }
        for argv in runs.values():  # untimed: writes the bytecode caches
            time_run(argv, env)
        times: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
        for i in range(options.repeats):  # alternating, so that a busy spell of the machine hits every command
            for label in list(runs) if i % 2 == 0 else list(runs)[::-1]:
                times[label].append(time_run(runs[label], env))
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"{' '.join(command())} ({options.repeats} fresh processes each; load average {load})")
        print(f"{'command':<36} {'median':>9} {'fastest':>9} {'CPU median':>11}")
        for label, samples in times.items():
            walls, cpus = [w for w, _ in samples], [c for _, c in samples]
            print(
                f"{label:<36} {statistics.median(walls):>8.3f}s {min(walls):>8.3f}s {statistics.median(cpus):>10.3f}s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
