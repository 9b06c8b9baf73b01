"""Drop-in Auto classes: code written for transformers runs on modelpatch with only its import line changed.

``from modelpatch import AutoModelForCausalLM`` gives a class whose ``from_pretrained`` and ``from_config`` are
:func:`modelpatch.from_pretrained` / :func:`modelpatch.from_config` with transformers' Auto class of the same name, so
``AutoModelForCausalLM.from_pretrained(path_or_id, patcher=..., fusion_config=...)`` works as the model-patching
documentation shows. Nothing in transformers is changed: its own Auto classes keep loading stock models.

One class exists for every Auto model class transformers exports (``AutoModel``, ``AutoModelForCausalLM``,
``AutoModelForSequenceClassification``, ...); each is made the first time it is imported.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from transformers import PretrainedConfig, PreTrainedModel

from ._transformers import is_auto_class

_lock = threading.Lock()
_made: dict[str, type[ModelPatchAutoClass]] = {}


class ModelPatchAutoClass:
    """Base of modelpatch's Auto classes; ``transformers_class`` is the transformers Auto class it stands for."""

    transformers_class: ClassVar[type]  # one of transformers' Auto model classes

    def __init__(self, *args: Any, **kwargs: Any):
        raise OSError(
            f"{type(self).__name__} is designed to be instantiated using {type(self).__name__}.from_pretrained(...) "
            f"or {type(self).__name__}.from_config(config)."
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> PreTrainedModel:
        """:func:`modelpatch.from_pretrained` with ``transformers.<this class>``; takes its keyword arguments."""
        from .loading import from_pretrained

        if model_args:
            raise TypeError(
                f"{cls.__name__}.from_pretrained takes the checkpoint and keyword arguments only; "
                f"got {len(model_args)} extra positional argument(s) "
                "(pass a config as config=... or load it with AutoConfig first)."
            )
        return from_pretrained(cls.transformers_class, pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs: Any) -> PreTrainedModel:
        """:func:`modelpatch.from_config` with ``transformers.<this class>``; takes its keyword arguments."""
        from .loading import from_config

        return from_config(cls.transformers_class, config, **kwargs)


def auto_class_names() -> list[str]:
    """The names transformers exports for its Auto model classes."""
    import transformers

    return sorted(name for name in dir(transformers) if name.startswith("AutoModel"))


def auto_class(name: str) -> type[ModelPatchAutoClass]:
    """modelpatch's ``name`` Auto class (``"AutoModelForCausalLM"``), made on first use."""
    with _lock:
        if name in _made:
            return _made[name]
        import transformers

        try:
            original = getattr(transformers, name)
        except (AttributeError, ImportError):
            original = None
        if not is_auto_class(original):
            raise AttributeError(f"transformers has no Auto model class {name!r}.")
        cls = type(
            name,
            (ModelPatchAutoClass,),
            {
                "transformers_class": original,
                "__module__": "modelpatch",
                "__qualname__": name,
                "__doc__": f"``transformers.{name}`` loading through modelpatch: patches, fusions and conversions "
                "apply, and saves go back to the original checkpoint layout.",
            },
        )
        _made[name] = cls
        return cls
