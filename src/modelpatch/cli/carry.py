"""The files of SRC besides its weights that ``modelpatch convert`` copies into DST.

A converted checkpoint must stay usable as the source was: its tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, vocab and merges files, ``tokenizer.model``), chat template,
processor configs, README and LICENSE come along. Copied: every regular file directly in SRC, except

* weight files of any format (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.h5``,
  ``*.msgpack``, ``*.gguf``, ``*.onnx``, ...) and weight indexes (``*.index.json``): the written tensors replace the
  source's, and another format's copy of the old weights would not match a changed layout;
* the files the save itself writes (``config.json``, ``generation_config.json``);
* symlinks leading outside SRC (a copy must not pull in files the checkpoint does not hold).

Subdirectories are not copied (training checkpoints, ONNX exports, caches can be large and are not part of the
model), except the small module folders of a sentence-transformers model that its ``modules.json`` names
(``1_Pooling``, ``2_Normalize``, ``2_Dense``: their configs and small layers); their regular files are copied, one
level deep, under the same rules for symlinks. Whatever is left out for another reason than being a weight file is
reported as a note.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from ..checkpoint.json_file import MAX_CONFIG_BYTES, read_json
from .arguments import UsageError

WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".onnx_data",
    ".index.json",
)

SENTENCE_TRANSFORMERS_MODULES = "modules.json"


@dataclass
class CarryPlan:
    """What convert copies from ``source``: ``files`` (relative paths) and ``skipped`` (``"name (why)"`` notes)."""

    source: Path
    files: list[PurePath] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def copy_to(self, destination: Path, written: set[str]) -> list[PurePath]:
        """Copy the planned files into ``destination``, except those the save wrote there; return those copied."""
        copied = [relative for relative in self.files if str(relative) not in written]
        try:
            # What DST already holds under these names (kept from before a --force) is replaced, never written
            # through: it may be a symlink.
            for name in {relative.parts[0] for relative in copied}:
                _remove(destination / name)
        except OSError as exc:
            raise UsageError(f"{destination}: cannot replace {exc.filename} ({exc.strerror}).") from None
        for relative in copied:
            target = destination / relative
            try:
                target.parent.mkdir(exist_ok=True)
                shutil.copy2((self.source / relative).resolve(), target)
            except OSError as exc:
                raise UsageError(
                    f"{self.source / relative}: cannot copy it into {destination} ({exc}); the converted tensors and "
                    "config are written, copy the remaining files of SRC by hand."
                ) from None
        return copied


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def plan_carry(source: Path) -> CarryPlan:
    """Decide which files of checkpoint directory ``source`` convert copies (see the module docstring).

    Raises:
        CheckpointError: ``modules.json`` is not readable JSON.
    """
    plan = CarryPlan(source)
    root = source.resolve()
    module_folders = _sentence_transformers_folders(source)
    for entry in sorted(source.iterdir()):
        if entry.name.endswith(WEIGHT_SUFFIXES):
            continue
        if entry.is_dir():
            if entry.name in module_folders and not entry.is_symlink():
                for child in sorted(entry.iterdir()):
                    _add(plan, root, child, PurePath(entry.name, child.name))
            else:
                plan.skipped.append(f"{entry.name}/ (a subdirectory)")
        else:
            _add(plan, root, entry, PurePath(entry.name))
    return plan


def _add(plan: CarryPlan, root: Path, path: Path, relative: PurePath) -> None:
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        plan.skipped.append(f"{relative} (a symlink to {resolved}, outside SRC)")
    elif path.is_dir():
        plan.skipped.append(f"{relative}/ (a subdirectory)")
    elif not resolved.is_file():
        plan.skipped.append(f"{relative} (not a regular file)")
    else:
        plan.files.append(relative)


def _sentence_transformers_folders(source: Path) -> set[str]:
    """The module folders ``source/modules.json`` names: plain names of folders inside ``source``, never the root
    (or a folder) holding the transformer itself."""
    path = source / SENTENCE_TRANSFORMERS_MODULES
    if not path.is_file():
        return set()
    modules = read_json(path, MAX_CONFIG_BYTES)
    if not isinstance(modules, list):
        return set()
    return {
        module["path"]
        for module in modules
        if isinstance(module, dict)
        and isinstance(module.get("path"), str)
        and module["path"] not in ("", ".", "..")
        and "/" not in module["path"]
        and "\\" not in module["path"]
        and not str(module.get("type", "")).endswith(".Transformer")
    }
