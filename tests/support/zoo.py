"""The zoo sweep (``benchmarks/zoo.py``) as a module: its tiny configs of every model type and its checks, which the
zoo slices in CI call in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "zoo.py"


def load_zoo() -> ModuleType:
    """``benchmarks/zoo.py``, imported once (as ``zoo``: its worker classes and dataclasses must pickle by name)."""
    if "zoo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("zoo", _PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["zoo"] = module
        spec.loader.exec_module(module)
    return sys.modules["zoo"]
