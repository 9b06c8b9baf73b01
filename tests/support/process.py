"""Running a script in a fresh Python process, for what only a new interpreter shows (what an import line imports,
what registers at import time)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def run_fresh(script: str, *args: str, unset: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (``python -c``) with ``args`` in a new interpreter that imports what this one does (the same
    ``sys.path``), without the environment variables ``unset``; asserts it exits 0 and returns the result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in unset:
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result
