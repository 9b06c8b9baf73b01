"""Drop-in Auto classes: code written for transformers runs on modelpatch with only its import line changed.

``from modelpatch import AutoModelForCausalLM`` gives a class whose ``from_pretrained`` and ``from_config`` are
:func:`modelpatch.from_pretrained` / :func:`modelpatch.from_config` with transformers' Auto class of the same name, so
``AutoModelForCausalLM.from_pretrained(path_or_id, patcher=..., fusion_config=...)`` works as the model-patching
documentation shows. Nothing in transformers is changed: its own Auto classes keep loading stock models.

One class exists for every Auto model class transformers exports (``AutoModel``, ``AutoModelForCausalLM``,
``AutoModelForSequenceClassification``, ...); each is made the first time it is imported.

The import line stays light (neither transformers nor torch: :func:`auto_class_names` reads one file), because
what a user waits for is the whole process: ``from_pretrained`` first starts reading the checkpoint's files into
the page cache (:func:`~modelpatch.checkpoint.prefetch.prefetching_directory`), then imports transformers, torch and
the loader, so that seconds of imports overlap the disk reads a cold start otherwise pays in the first forward.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint.layout import SAFE_INDEX, SAFE_SINGLE
from .checkpoint.prefetch import prefetching_directory

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_lock = threading.Lock()
_made: dict[str, type[ModelPatchAutoClass]] = {}

# Keywords of a load that reads only part of the files, or reads them in several processes: nothing is prefetched.
_PARTIAL_READS = ("device_map", "tp_plan", "tp_size", "distributed_config")


class _AutoClassType(type):
    """The metaclass of modelpatch's Auto classes: ``transformers_class`` is looked up on first use, so that making
    the class (the import line) imports none of transformers' modeling code."""

    @property
    def transformers_class(cls) -> type:
        """The transformers Auto class this class stands for (``transformers.AutoModelForCausalLM``)."""
        found = cls.__dict__.get("_transformers_class")
        if found is None:
            import transformers

            from ._transformers import is_auto_class

            found = getattr(transformers, cls.__name__, None)
            if not is_auto_class(found):
                raise TypeError(f"transformers.{cls.__name__} is not one of transformers' Auto model classes.")
            type.__setattr__(cls, "_transformers_class", found)
        return found


class ModelPatchAutoClass(metaclass=_AutoClassType):
    """Base of modelpatch's Auto classes; ``transformers_class`` is the transformers Auto class it stands for."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise OSError(
            f"{type(self).__name__} is designed to be instantiated using {type(self).__name__}.from_pretrained(...) "
            f"or {type(self).__name__}.from_config(config)."
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> PreTrainedModel:
        """:func:`modelpatch.from_pretrained` with ``transformers.<this class>``; takes its keyword arguments.

        The checkpoint's files are read into the page cache on a background thread from the first line on, while
        torch and the loader are imported (docs/benchmarks.md; ``MODELPATCH_PREFETCH=0`` turns it off).
        """
        if model_args:
            raise TypeError(
                f"{cls.__name__}.from_pretrained takes the checkpoint and keyword arguments only; "
                f"got {len(model_args)} extra positional argument(s) "
                "(pass a config as config=... or load it with AutoConfig first)."
            )
        with prefetching_directory(
            _prefetched_directory(pretrained_model_name_or_path, kwargs),
            allow_external_symlinks=bool(kwargs.get("allow_external_symlinks")),
        ):
            from .loading.load import from_pretrained

            return from_pretrained(cls.transformers_class, pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs: Any) -> PreTrainedModel:
        """:func:`modelpatch.from_config` with ``transformers.<this class>``; takes its keyword arguments."""
        from .loading.load import from_config

        return from_config(cls.transformers_class, config, **kwargs)


def _prefetched_directory(path: Any, kwargs: dict[str, Any]) -> Path | None:
    """The local directory a load of ``path`` with ``kwargs`` will read every file of, where that is known before
    anything heavy is imported: a local directory, or a snapshot already in the hub cache. None for a load that
    reads part of the files or runs in several processes (``torchrun``), one to download, or one not known yet (the
    loader resolves it and reports what is wrong)."""
    if any(kwargs.get(name) is not None for name in _PARTIAL_READS) or os.environ.get("WORLD_SIZE", "1") != "1":
        return None
    if not isinstance(path, (str, os.PathLike)):
        return None
    subfolder = kwargs.get("subfolder") or ""
    local = Path(path) / subfolder
    if local.is_dir():
        return local
    if kwargs.get("force_download"):
        return None
    from huggingface_hub import try_to_load_from_cache

    for name in (SAFE_INDEX, SAFE_SINGLE):
        try:
            found = try_to_load_from_cache(
                os.fspath(path),
                f"{subfolder}/{name}" if subfolder else name,
                cache_dir=kwargs.get("cache_dir"),
                revision=kwargs.get("revision"),
            )
        except Exception:  # not a repo id (the loader says why)
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


def auto_class_names() -> list[str]:
    """The names transformers exports for its Auto model classes, read without importing transformers.

    They are the ``AutoModel*`` names of the ``__all__`` list of ``transformers/models/auto/modeling_auto.py``: the
    list transformers' own lazy package reads from that file's source to know what it exports (checked against
    5.22.2–5.24.0: the same names as ``dir(transformers)``). Importing transformers' package to ask it costs about a
    second, which the import line would add to the process and which would delay the checkpoint prefetch; this is a
    read of one file. Where the file cannot be found or read, the package is asked (:func:`_package_names`).
    """
    names = _names_in_source()
    return sorted(names if names is not None else _package_names())


def _package_names() -> list[str]:
    """The ``AutoModel*`` names of transformers' package, asked of the package itself (imports it)."""
    import transformers

    return [name for name in dir(transformers) if name.startswith("AutoModel")]


_ALL_LIST = re.compile(r"^__all__\s*=\s*(\[[^\]]*\])", re.MULTILINE)


def _names_in_source() -> list[str] | None:
    """The ``AutoModel*`` names of ``modeling_auto.py``'s ``__all__`` (None where it cannot be read)."""
    try:
        spec = importlib.util.find_spec("transformers")  # finds the package without running it
        if spec is None or spec.origin is None:
            return None
        source = (Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py").read_text(encoding="utf-8")
        found = _ALL_LIST.search(source)
        listed = ast.literal_eval(found.group(1)) if found else None
    except (OSError, ValueError, SyntaxError, ImportError):
        return None
    if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
        return None
    return [name for name in listed if name.startswith("AutoModel")]


def auto_class(name: str) -> type[ModelPatchAutoClass]:
    """modelpatch's ``name`` Auto class (``"AutoModelForCausalLM"``), made on first use."""
    with _lock:
        if name in _made:
            return _made[name]
        # The package is asked too before a name is refused: a release that exports an Auto class from another file
        # than the one read. A name the file lists but the package lacks is refused at first use
        # (:attr:`_AutoClassType.transformers_class`).
        if name not in auto_class_names() and name not in _package_names():
            raise AttributeError(f"transformers has no Auto model class {name!r}.")
        cls: type[ModelPatchAutoClass] = _AutoClassType(  # type: ignore[assignment]  # a subclass, made by its metaclass
            name,
            (ModelPatchAutoClass,),
            {
                "__module__": "modelpatch",
                "__qualname__": name,
                "__doc__": f"``transformers.{name}`` loading through modelpatch: patches, fusions and conversions "
                "apply, and saves go back to the original checkpoint layout.",
            },
        )
        _made[name] = cls
        return cls
