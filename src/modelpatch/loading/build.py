"""Build a model's module tree under the active patches, on the meta device (no memory, no weights) or for real."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import CheckpointError, ModelPatchError
from ..patching.mapping import PatchMapping
from ..patching.scope import patch_scope

# transformers' init contexts change process-wide state while a model is built or finalised (torch's default dtype,
# ``PreTrainedModel.tie_weights``); two overlapping builds would restore each other's values. Builds and
# finalisation therefore take turns; loading tensor data runs concurrently.
model_state_lock = threading.RLock()


def build_empty_model(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    dtype: torch.dtype,
    layers: Sequence[PatchMapping],
    prepare: Callable[[PreTrainedModel], None] | None = None,
) -> PreTrainedModel:
    """Instantiate ``model_class(config)`` on the meta device with floating parameters in ``dtype``.

    ``layers`` are the patch mappings to apply, highest priority first. transformers' own init contexts are used so
    the result is the same module tree and dtype layout that stock ``from_pretrained`` builds. ``prepare`` runs on
    the built model still inside those contexts but outside the patches, where stock lets a quantizer swap modules.
    """
    with model_state_lock, ExitStack() as stack:
        for context in model_class.get_init_context(dtype, prepare is not None, False, None):
            stack.enter_context(context)
        with patch_scope(*layers):
            model = model_class(config)
        if prepare is not None:
            prepare(model)
        return model


def build_initialized_model(
    model_class: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype | None, layers: Sequence[PatchMapping]
) -> PreTrainedModel:
    """Instantiate and initialise ``model_class`` from ``config`` like stock ``from_config``, under the patches."""
    with model_state_lock, patch_scope(*layers):
        return model_class._from_config(config, **({"dtype": dtype} if dtype is not None else {}))


def keep_in_fp32(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Give the meta model stock's float32 exceptions: ``_keep_in_fp32_modules`` for float16 loads,
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16 loads (transformers' own dtype plan).

    The load casts every tensor to its meta parameter's dtype, so this is all it takes for the loaded state to have
    stock's dtypes, and for those tensors to be saved back in float32.
    """
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return
    # transformers matches these names as globs searched anywhere in the key.
    pattern = re.compile("|".join(f"(?:{name.replace('*', '.*')})" for name in plan))
    for key, tensor in list(model.state_dict(keep_vars=True).items()):
        if not tensor.is_floating_point() or tensor.dtype == torch.float32 or not pattern.search(key):
            continue
        owner_name, _, attribute = key.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attribute in owner._parameters:
            owner._parameters[attribute] = nn.Parameter(tensor.to(torch.float32), requires_grad=tensor.requires_grad)
        else:
            owner._buffers[attribute] = tensor.to(torch.float32)


@contextmanager
def config_build_errors(config_file: Path, model_class: type) -> Iterator[None]:
    """Report a failure to build stock ``model_class`` from a checkpoint's config as a :class:`CheckpointError`.

    transformers' modeling code raises whatever its arithmetic hits on inconsistent values (``ZeroDivisionError``
    for zero heads, ``RuntimeError`` for a negative size, ``KeyError`` for an unknown rope type); for a load these
    are all one thing, a config.json that does not describe a buildable model. Only for builds without patches:
    an error of a replacement class is the replacement's, not the config's.
    """
    try:
        yield
    except ModelPatchError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{config_file}: transformers cannot build {model_class.__name__} from it ({type(exc).__name__}: {exc})"
        ) from exc
