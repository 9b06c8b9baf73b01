"""``benchmarks/gpu.py --quick``: the GPU benchmark's every section runs on the CPU with tiny sizes (what CI can
check of a script whose figures need a GPU), both sides compute the same outputs, and every speed is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.mark.slow
def test_quick_run_takes_every_figure(tmp_path):
    out = tmp_path / "speeds.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    speeds = json.loads(out.read_text())["speeds"]
    expected = {"load plain", "load fused", "process plain", "process fused", "compiled decoding"}
    expected |= {f"{case} {fusion}" for case in ("prefill 1x32", "prefill 4x8", "forward 1 token")
                 for fusion in ("qkv", "gate_up", "both")}  # fmt: skip
    expected |= {"generate batch 1", "generate batch 4"} | {f"experts {n}" for n in (1, 32, 256)}
    assert set(speeds) == expected
    assert all(speed > 0 for speed in speeds.values())
    diffs = json.loads(out.read_text())["diffs"]
    assert len(diffs) == 12 and max(diffs.values()) < 0.05, diffs  # bf16 rounding at most
    # the fused sides compute what stock computes: greedy tokens equal, logits and block outputs within rounding
    lines = result.stdout.splitlines()
    generate = [line for line in lines if line.startswith("|") and line.rstrip(" |").endswith(("True", "False"))]
    assert len(generate) == 3 and all(line.rstrip(" |").endswith("True") for line in generate), generate
