"""Build a model's module tree under the active patches, on the meta device (no memory, no weights) or for real.

transformers' own patch registry (``transformers.monkey_patching``) never takes part in these builds. transformers
enters its global ``apply_patches()`` in ``PreTrainedModel.get_init_context`` and in every ``_from_config``, which
composite models call from their own ``__init__`` for their sub-models (156 modeling modules of 5.23 do, Qwen2-VL's
vision tower and text model among them). Left in, a patch registered with *transformers'* ``register_patch_mapping``
(or the fused class a stock ``fusion_config`` load leaves registered there for good) would replace classes in every
modelpatch build of the process, outside modelpatch's scopes and without the conversions that go with them; and
``patch_output_recorders`` would rewrite ``_can_record_outputs`` after it. Filtering the top-level init contexts
cannot reach the nested ``_from_config`` calls, so both readers of that registry are made to see it empty while, and
only while, the current context is inside a modelpatch build (see
:func:`modelpatch._installs.isolate_from_transformers_patches`).

Module constructors initialise their parameters even on the meta device (``nn.Linear`` runs ``kaiming_uniform_``
through torch's meta decompositions), which is half the time of a meta build and fills nothing: meta tensors hold
no values and draw no random numbers. Inside modelpatch builds, ``torch.nn.init``'s filling functions therefore
return a meta tensor untouched (see :func:`modelpatch._installs.skip_meta_initialisation`); a real tensor is
initialised as always. Both are process-wide installs, and live with the others in ``modelpatch/_installs.py``.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .._installs import inside_build, isolate_from_transformers_patches, skip_meta_initialisation
from .._transformers import (
    fp32_module_patterns,
    init_contexts,
    initialized_from_config,
    keys_to_ignore_on_load,
    tied_weight_keys,
)
from ..errors import CheckpointError, LoadPlanError, ModelPatchError, PatchError
from ..patching.mapping import PatchMapping
from ..patching.scope import PatchScope, patch_scope

# transformers' init contexts change process-wide state while a model is built or finalised (torch's default dtype,
# ``PreTrainedModel.tie_weights``); two overlapping builds would restore each other's values. Builds and
# finalisation therefore take turns; loading tensor data runs concurrently.
model_state_lock = threading.RLock()


@contextmanager
def _isolated_build() -> Iterator[None]:
    """The context of one build: the turn on process-wide state, transformers' patch registry reading empty, and no
    initialisation of meta tensors."""
    isolate_from_transformers_patches()
    skip_meta_initialisation()
    with model_state_lock:
        token = inside_build.set(True)
        try:
            yield
        finally:
            inside_build.reset(token)


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
    return build_empty_model_patched(model_class, config, dtype, layers, prepare)[0]


def build_empty_model_patched(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    dtype: torch.dtype,
    layers: Sequence[PatchMapping],
    prepare: Callable[[PreTrainedModel], None] | None = None,
) -> tuple[PreTrainedModel, PatchScope]:
    """:func:`build_empty_model`, and the :class:`PatchScope` of the build (what it matched and replaced)."""
    with _isolated_build(), ExitStack() as stack:
        for context in init_contexts(model_class, dtype, prepare is not None):
            stack.enter_context(context)
        with patch_scope(*layers) as scope:
            model = _whole_model(model_class(config), model_class, scope)
        if prepare is not None:
            prepare(model)
        return model, scope


def build_initialized_model(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    dtype: torch.dtype | None,
    layers: Sequence[PatchMapping],
) -> tuple[PreTrainedModel, PatchScope]:
    """Instantiate and initialise ``model_class`` from ``config`` like stock ``from_config``, under the patches;
    return it with the :class:`PatchScope` of the build."""
    with _isolated_build(), patch_scope(*layers) as scope:
        return _whole_model(initialized_from_config(model_class, config, dtype), model_class, scope), scope


def _whole_model(model: object, model_class: type, scope: PatchScope) -> PreTrainedModel:
    """``model``, built for ``model_class`` under ``scope``; refused when a patch replaced the model class itself by
    something that is not a transformers model (``--patch '.*=torch.nn:Identity'`` matches every class, the model's
    included). Loading, saving and every later step use the whole model's PreTrainedModel API (config, dtype plan,
    tied weights): without this check the first of them fails on an attribute the replacement lacks.

    Raises:
        PatchError: naming the patch key, the model class and the replacement.
    """
    if isinstance(model, PreTrainedModel):
        return model
    key, replacement = scope.replaced.get(model_class.__name__, ("?", type(model)))
    raise PatchError(
        f"The patch {key!r} replaces the model class {model_class.__name__} itself by "
        f"{replacement.__module__}.{replacement.__qualname__}, which is not a transformers PreTrainedModel. A patch "
        "replaces modules inside the model: name the classes to replace, or write a pattern that does not match "
        f"{model_class.__name__} (the model class may be replaced by a PreTrainedModel only, a subclass of it)."
    )


def keep_in_fp32(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Give the meta model stock's float32 exceptions: ``_keep_in_fp32_modules`` for float16 loads,
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16 loads (transformers' own dtype plan).

    The load casts every tensor to its meta parameter's dtype, so this is all it takes for the loaded state to have
    stock's dtypes, and for those tensors to be saved back in float32.
    """
    plan = fp32_module_patterns(model, dtype)
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


def check_layer_count(
    model_class: type, config: PretrainedConfig, keys: Iterable[str], config_file: Path, dtype: torch.dtype
) -> None:
    """Refuse a config with more layers than the checkpoint holds before the model is built: a meta build takes time
    in proportion to the layers (minutes for ``num_hidden_layers: 100000``) only to report their tensors missing.

    Every layer of a transformers model is an item of a module list, so its index is a segment of its tensors' keys,
    whatever renaming the checkpoint needs. When no key has an index as high as the config's last layer, small
    builds (one, two and three layers) tell which module lists grow with the layer count and what their last index
    will be (OneFormer's decoder holds one layer fewer than ``num_hidden_layers``; ALBERT's shared layers hold no
    tensors of their own). The config is refused only when a list's last item needs tensors (neither tied to
    others nor ignorable when missing) at an index above every index of the checkpoint: those are provably missing.

    Raises:
        LoadPlanError: the checkpoint cannot hold that many layers.
    """
    text_config = config.get_text_config()
    count = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(count, int) or count < 2:
        return
    highest = max((int(part) for key in keys for part in key.split(".") if part.isdigit()), default=-1)
    if count - 1 <= highest:
        return
    needed = _last_needed_index(model_class, config, count, dtype)
    if needed is None or needed[1] <= highest:
        return
    name, index = needed
    absent = f"{name}.{index}" if index == highest + 1 else f"{name}.{highest + 1}..{index}"
    raise LoadPlanError(
        f"{config_file}: num_hidden_layers = {count}, but no tensor key of the checkpoint has an index above "
        f"{highest}, and the model's {name}[{index}] needs tensors of its own: the checkpoint holds at most "
        f"{highest + 1} items of it. Fix num_hidden_layers in config.json, or pass new_parameters=[...] (regex "
        "patterns) for the layers to initialise freshly.",
        {"missing from the checkpoint": [absent]},
    )


_PROBE_LAYERS = (1, 2, 3)


def _last_needed_index(
    model_class: type, config: PretrainedConfig, count: int, dtype: torch.dtype
) -> tuple[str, int] | None:
    """The module list that ``count`` layers make the longest, among those that grow with the layer count and whose
    items need tensors from the checkpoint, and the index of its last item; ``None`` when none can be told.

    Three small builds show each list's length at one, two and three layers; a list growing by the same step both
    times grows by it with every layer (``count`` layers: its length at three plus ``count - 3`` steps). A config
    that cannot be built that small tells nothing: the full build reports what is wrong.
    """
    lengths: list[dict[str, int]] = []
    for layers in _PROBE_LAYERS:
        probe = copy.deepcopy(config)
        try:  # some configs refuse the setting itself (Funnel: "set block_sizes")
            probe.get_text_config().num_hidden_layers = layers
            model = build_empty_model(model_class, probe, dtype, [])
        except Exception:
            return None
        lengths.append(_list_lengths(model))
    needing = _lists_needing_tensors(model)  # in the three-layer build
    best: tuple[str, int] | None = None
    for name, last in lengths[-1].items():
        first, middle = lengths[0].get(name), lengths[1].get(name)
        if first is None or middle is None or not 0 < middle - first == last - middle or name not in needing:
            continue
        index = last - 1 + (count - _PROBE_LAYERS[-1]) * (last - middle)
        if best is None or index > best[1]:
            best = (name, index)
    return best


def _list_lengths(model: nn.Module) -> dict[str, int]:
    """The number of items of each module list (``nn.ModuleList``, ``nn.Sequential``) of ``model``, by name."""
    return {
        name: len(module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.Sequential))
    }


def _lists_needing_tensors(model: PreTrainedModel) -> set[str]:
    """The module lists of ``model`` each of whose items has a tensor the checkpoint must provide: a parameter or
    persistent buffer neither tied to another nor among the keys the model class lets be missing."""
    tied = tied_weight_keys(model)
    exempt = {*tied, *tied.values()}
    ignorable = [re.compile(pattern) for pattern in keys_to_ignore_on_load(model, "missing") if pattern]
    owners: set[str] = set()  # every module holding such a tensor, however deep
    for key in model.state_dict(keep_vars=True):
        if key in exempt or any(pattern.search(key) for pattern in ignorable):
            continue
        parts = key.split(".")
        owners.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return {
        name
        for name, length in _list_lengths(model).items()
        if length and all((f"{name}.{i}" if name else str(i)) in owners for i in range(length))
    }
