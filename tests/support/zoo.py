"""The zoo sweep (``benchmarks/zoo.py``) as a module: its tiny configs of every model type and its checks, which the
zoo slices in CI call in-process."""

from __future__ import annotations

import importlib
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


def experts_classes() -> list[type]:
    """Every experts class of the installed transformers holding fused ``gate_up_proj`` weights (a class named
    ``*Experts`` whose source names ``gate_up_proj`` and that defines its own forward), from each modeling module whose
    source names them."""
    import inspect

    import transformers.models
    from torch import nn

    found: list[type] = []
    root = Path(transformers.models.__file__).parent
    for path in sorted(root.glob("*/modeling_*.py")):
        if "gate_up_proj" not in path.read_text(encoding="utf-8"):
            continue
        try:
            module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        except ImportError:  # a model needing an optional package this environment lacks
            continue
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and issubclass(cls, nn.Module)
                and cls.__module__ == module.__name__
                and cls.__name__.endswith("Experts")
                and "forward" in cls.__dict__
                and "gate_up_proj" in inspect.getsource(cls)
            ):
                found.append(cls)
    return found
