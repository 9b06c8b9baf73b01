"""Checkpoint directories as the tests read, rewrite and watch them."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# Name parts of the temporary and previous-version directories a save makes next to its target.
SIBLING_MARKERS = (".modelpatch-tmp-", ".modelpatch-old-")


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of ``directory`` (read eagerly, independent of the files)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor key of ``directory``'s safetensors files -> its shape, read from the headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def config_json(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


def rewrite_checkpoint(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a single-file checkpoint, letting ``edit`` change its tensors (a hand-made variant of a stock one)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``directory`` (and the directory itself) -> (kind, size, mtime_ns): any write shows."""
    directory = Path(directory)
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in [".", *dirs, *files]:
            path = Path(root) / name
            st = path.lstat()
            out[str(path.relative_to(directory))] = (st.st_mode >> 12, st.st_size, st.st_mtime_ns)
    return out


def siblings(directory: Path) -> list[str]:
    """Temporary or previous-version directories a save left next to ``directory``."""
    directory = Path(directory)
    return sorted(
        p.name
        for p in directory.parent.iterdir()
        if p.name.startswith(f".{directory.name}.") and any(m in p.name for m in SIBLING_MARKERS)
    )
