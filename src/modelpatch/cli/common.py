"""What the commands share once they run: model classes, ``--fusion`` and ``--patch`` specs, progress bars.

This module imports torch and transformers: commands import it inside ``run``, never at module level (see
:mod:`modelpatch.cli.arguments`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import transformers
from torch import nn
from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from .._transformers import is_auto_class, model_class_names_for
from ..errors import FusionError
from ..fusions import available_fusions
from ..loading import materialize
from ..loading.config import load_config
from ..loading.hub import HubOptions, resolve_checkpoint
from ..patching import Patcher
from .arguments import UsageError


def _named_class(name: str) -> type | None:
    cls = getattr(transformers, name, None)
    if is_auto_class(cls) or (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        return cls
    return None


def model_class_for(config: PretrainedConfig, name: str | None = None) -> type:
    """The class to load into: ``name`` (``--model-class``), else the config's ``architectures``, else ``AutoModel``.

    ``AutoModel`` builds the base model, without a task head: commands that must keep every tensor (``convert``)
    check that it has a place for each one.
    """
    if name is not None:
        cls = _named_class(name)
        if cls is None:
            raise UsageError(
                f"--model-class {name!r} is not a transformers model class; for model_type {config.model_type!r}: "
                f"{', '.join(model_classes(config.model_type)) or 'AutoModelForCausalLM, AutoModel, ...'}."
            )
        return cls
    for architecture in getattr(config, "architectures", None) or []:
        if (cls := _named_class(architecture)) is not None:
            return cls
    return AutoModel


def architectures_note(config: PretrainedConfig) -> str:
    """Why :func:`model_class_for` fell back to ``AutoModel`` (empty when the config names a known class)."""
    names = getattr(config, "architectures", None) or []
    if not names:
        return 'config.json has no "architectures"'
    if not any(_named_class(name) for name in names):
        return f"config.json names architectures {names}, which transformers does not have"
    return ""


def model_classes(model_type: str) -> list[str]:
    """Every model class transformers maps ``model_type`` to (base model and task heads), sorted."""
    return model_class_names_for(model_type)


def open_checkpoint(args: argparse.Namespace, path: str) -> tuple[Path, PretrainedConfig]:
    """The local directory of checkpoint ``path`` (a hub repository is resolved into the cache once) and its config."""
    hub = HubOptions(
        revision=args.revision,
        subfolder=args.subfolder,
        cache_dir=args.cache_dir,
        local_files_only=args.local_files_only,
    )
    directory = resolve_checkpoint(path, hub, allow_pickle=args.allow_pickle)
    return directory, load_config(directory)


def parse_fusions(value: str | None) -> dict[str, bool] | None:
    """``"qkv,gate_up"`` -> ``{"qkv": True, "gate_up": True}``; ``"none"`` -> ``{}`` (all off)."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return {}
    unknown = [n for n in names if n not in available_fusions()]
    if unknown:
        raise FusionError(f"Unknown fusion {unknown[0]!r}; available fusions: {', '.join(available_fusions())}.")
    return dict.fromkeys(names, True)


def parse_patches(specs: list[str] | None) -> Patcher | None:
    """``ORIGINAL=package.module:Class`` specs -> a Patcher."""
    if not specs:
        return None
    mapping: dict[str, type[nn.Module]] = {}
    for spec in specs:
        original, sep, target = spec.partition("=")
        module_name, colon, class_name = target.partition(":")
        if not sep or not colon or not original or not module_name or not class_name:
            raise UsageError(f"Bad --patch {spec!r}: expected ORIGINAL=package.module:Class.")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UsageError(f"Bad --patch {spec!r}: cannot import {module_name!r} ({exc}).") from None
        replacement = getattr(module, class_name, None)
        if replacement is None:
            raise UsageError(f"Bad --patch {spec!r}: {module_name} has no {class_name!r}.")
        mapping[original] = replacement
    try:
        return Patcher(class_mapping=mapping)
    except TypeError as exc:
        raise UsageError(f"Bad --patch: {exc}") from None


@contextmanager
def load_progress(enabled: bool) -> Iterator[None]:
    """Let the loader show its progress bar (loads above its size threshold) only when ``enabled``.

    The loader has no switch for its bar, only a size threshold: a disabled bar is a threshold no load reaches, for
    the command's duration.
    """
    if enabled:
        yield
        return
    threshold = materialize.PROGRESS_BAR_MIN_BYTES
    materialize.PROGRESS_BAR_MIN_BYTES = sys.maxsize
    try:
        yield
    finally:
        materialize.PROGRESS_BAR_MIN_BYTES = threshold
