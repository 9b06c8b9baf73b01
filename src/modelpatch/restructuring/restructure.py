"""``fuse``, ``unfuse`` and ``patch_model``: restructure a model in memory, with the transforms a load would use.

A model loaded by stock transformers, left by a Trainer, or loaded by modelpatch can be fused (and unfused) in
place, without touching disk. The target modules are built exactly as a load builds them — on the meta device, from
the model's own config, under the fusion's patch layer — and each is filled from the live module's tensors through
the fusion's weight transforms (forward to fuse, the exact reverse to unfuse), one module at a time: the extra memory
is at most one converted group. Tensors no transform touches (``o_proj``, norms) move over as the same
``nn.Parameter`` objects, so optimizers and tied references keep working. What a save needs is recorded, so
:func:`modelpatch.save_pretrained` and ``model.save_pretrained`` still write the original checkpoint layout.

A restructuring runs in two steps, as a load does. Planning decides everything and changes nothing: every module's
tensors are planned through the transforms (metadata only), their training state checked
(:mod:`~modelpatch.restructuring.training_state`), and the hooks on the modules replaced sorted into those that move to
the modules standing in their place and those that would lose their meaning
(:mod:`~modelpatch.restructuring.hooks_transfer`); any refusal names what is at fault and leaves the model as it was.
Executing moves the hooks and fills each new module through the load's fill stage
(:func:`~modelpatch.loading.materialize.fill`), with the live module's tensors as the source instead of a checkpoint.

A model is restructured by one call at a time (a second ``fuse`` from another thread waits, then finds the model
fused); a forward running meanwhile in another thread computes with the old modules or the new ones, each the same
function.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from .._transformers_mapping import model_conversions
from ..boundary.state_dict import install_state_dict_boundary
from ..conversion.planner import ConversionGroup, ConversionPlan, TensorMeta, plan_load, plan_save
from ..conversion.transforms import WeightConverter, WeightTransform
from ..errors import FusionError
from ..fusions.apply import normalize_fusion_config, prepare_fusions, resolve_fusion_config, spec_transforms
from ..fusions.generated import finish_fused_modules, fused_origin
from ..fusions.settings import settings_differences
from ..loading.build import build_empty_model
from ..loading.materialize import fill, return_freed_memory
from ..loading.plan import model_expectations
from ..loading.record import ensure_model_record, model_record
from ..modes.base import TensorSource
from ..modes.distributed import refuse_sharded
from ..patching import registry
from ..patching.patcher import Patcher
from ..state import record_fusion_config, stored_fusion_config
from .hooks_transfer import HookMove, move_hooks, plan_hook_moves, tensor_hook_problems
from .training_state import carried_grads, training_state_error, training_state_problems, trains

logger = logging.getLogger(__name__)


_Function = TypeVar("_Function", bound=Callable[..., Any])

_locks_guard = threading.Lock()
_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()


def _one_at_a_time(function: _Function) -> _Function:
    """Run ``function(model, ...)`` holding ``model``'s restructuring lock: a second call from another thread waits,
    then sees the model as the first call left it (already fused: the same FusionError as a call made after it)."""

    @functools.wraps(function)
    def locked(model: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(model, nn.Module):
            return function(model, *args, **kwargs)  # refused by name there
        with _locks_guard:
            lock = _locks.get(model)
            if lock is None:
                lock = _locks[model] = threading.RLock()
        with lock:
            return function(model, *args, **kwargs)

    return cast(_Function, locked)


def _check_live(model: Any, what: str) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{what}() takes a transformers PreTrainedModel, got {type(model).__name__}.")
    if getattr(model, "hf_device_map", None):
        raise FusionError(
            f"{what}() cannot restructure a model dispatched over devices (hf_device_map): its modules carry "
            "accelerate hooks. Load it with modelpatch.from_pretrained(..., fusion_config=...) instead."
        )
    # FSDP2 keeps the parameters it sharded (and tensor parallelism the hooks and shards it set up): modules
    # restructured afterwards would hold tensors neither knows.
    refuse_sharded(
        model,
        f"{what}()",
        "restructure the model before sharding it: load it with modelpatch.from_pretrained(..., fusion_config=...) "
        "or call fuse / unfuse / patch_model before fully_shard or the tensor-parallel load.",
        FusionError,
    )


def _base_transforms(model: PreTrainedModel) -> list[WeightTransform]:
    """The transforms that map the model's unfused state to its checkpoint layout."""
    record = model_record(model)
    if record is not None and record.base_transforms is not None:
        return list(record.base_transforms)
    return model_conversions(model)


def _assign(
    module: nn.Module, name: str, tensor: torch.Tensor, requires_grad: bool, grad: torch.Tensor | None = None
) -> None:
    """Set parameter or buffer ``name`` of ``module`` to ``tensor``: a Parameter is kept as it is (with its own
    ``requires_grad`` and ``.grad``), another tensor becomes one with ``requires_grad`` and ``grad``."""
    owner_name, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if attribute in owner._parameters:
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=requires_grad)
            if grad is not None:
                tensor.grad = grad.contiguous()  # laid out as the weight is (``_fill`` makes it contiguous)
        owner._parameters[attribute] = tensor
    else:
        owner._buffers[attribute] = tensor.detach()


def _module_state(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The state of module ``name`` under its full keys (the parameters themselves, not copies)."""
    return {f"{name}.{key}": tensor for key, tensor in model.get_submodule(name).state_dict(keep_vars=True).items()}


Step = Callable[[Mapping[str, TensorMeta]], ConversionPlan]


@dataclass(frozen=True)
class _Restructuring:
    """What a restructuring will do, decided with nothing changed: each module ``name`` of the live model is replaced
    by ``target``'s meta module of that name, filled from the live one's tensors through ``steps`` (planners run one
    after another), and the hooks that keep their meaning move as ``hook_moves`` say."""

    target: nn.Module
    modules: tuple[tuple[str, tuple[ConversionPlan, ...]], ...]
    hook_moves: tuple[HookMove, ...]

    def last_groups(self) -> list[ConversionGroup]:
        """The converted groups of each module's last step (their operations bound to the real shapes)."""
        return [group for _, steps in self.modules for group in steps[-1].groups]


def _plan(
    model: PreTrainedModel, target: nn.Module, names: Sequence[str], steps: Sequence[Step], verb: str
) -> _Restructuring:
    """Plan replacing each module ``names`` of ``model`` by the meta module of the same name in ``target``: its
    tensors through ``steps``, each a planner (``plan_load`` / ``plan_save`` bound to transforms) run on the previous
    step's output (metadata only), and which of its hooks move where. Changes nothing, hooks included (it reads
    the modules' state dicts, which runs their state-dict hooks as any ``state_dict()`` call does).

    Raises:
        FusionError: a module's tensors do not convert to its ``target`` counterpart, parts of one new tensor differ
            in training state, or a hook would lose its meaning.
    """
    modules = []
    hook_moves: list[HookMove] = []
    hook_problems: list[str] = []
    training_problems: list[str] = []
    tensor_problems: list[str] = []
    owners, reported = _tensor_names(model), set[int]()
    setting_problems: list[str] = []
    for name in names:
        state = _module_state(model, name)
        metas = {key: TensorMeta(tuple(t.shape), t.dtype) for key, t in state.items()}
        module_plans = []
        problems: list[str] = []
        passed = {key: key for key in metas}  # output key -> the source key whose tensor it is, unconverted
        for step in steps:
            plan = step(metas)
            problems.extend(item for items in plan.problems.values() for item in items)
            module_plans.append(plan)
            metas = plan.outputs
            passed = {out: passed[source] for out, source in plan.direct.items() if source in passed}
        new = target.get_submodule(name)
        setting_problems += settings_differences(name, model.get_submodule(name), new)
        moves, hooked = plan_hook_moves(model.get_submodule(name), new, name, verb)
        hook_moves += moves
        hook_problems += hooked + tensor_hook_problems(state, set(passed.values()), verb)
        expected = {
            f"{name}.{key}": TensorMeta(tuple(t.shape), t.dtype) for key, t in new.state_dict(keep_vars=True).items()
        }
        wrong = sorted(
            key
            for key in metas.keys() | expected.keys()
            if key not in metas or key not in expected or metas[key].shape != expected[key].shape
        )
        if problems or wrong:
            keys = [", ".join(wrong[:6]) + (", ..." if len(wrong) > 6 else "")] if wrong else []
            raise FusionError(
                f"Cannot {verb} {name} ({type(model.get_submodule(name)).__name__}): its tensors do not convert to "
                f"those of {type(new).__name__} ({'; '.join([*keys, *problems])}). The model was left unchanged."
            )
        training_problems += training_state_problems(name, state, module_plans)
        converted = set(state) - set(passed.values())
        tensor_problems += _unreadable(state, module_plans[0]) + _shared(state, converted, owners, reported, verb)
        modules.append((name, tuple(module_plans)))
    if setting_problems:
        # The new modules are built from the config, as a load builds them: they would compute with its values.
        raise FusionError(
            f"Cannot {verb} {type(model).__name__}: settings were changed on the live modules after they were built, "
            f"and the {verb}d modules, built from the model's config, would compute without them: "
            f"{'; '.join(setting_problems)}. Set them in model.config too (the new modules read them there), or leave "
            "the model as it is. The model was left unchanged."
        )
    if tensor_problems:
        raise FusionError(
            f"Cannot {verb} {type(model).__name__}: {'; '.join(tensor_problems)}. The model was left unchanged."
        )
    if training_problems:
        raise training_state_error(model, training_problems, verb)
    if hook_problems:
        raise FusionError(
            f"Cannot {verb} {type(model).__name__}: hooks are registered where the {verb}d model would not keep "
            f"their meaning: {'; '.join(hook_problems)}. Remove them (handle.remove()), {verb}, and register them "
            f"again on the modules that stand there then. The model was left unchanged."
        )
    return _Restructuring(target, tuple(modules), tuple(hook_moves))


def _tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter and buffer of ``model`` (by identity) -> all the names it has there, shared ones included."""
    names: dict[int, list[str]] = {}
    for key, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(key)
    return names


def _unreadable(state: Mapping[str, torch.Tensor], first: ConversionPlan) -> list[str]:
    """What of a module's tensors a restructuring could not read: tensors on the meta device (no data: a placeholder
    never filled, a weight offloaded by hand), and parts of one converted tensor on different devices (they are
    joined into one). Planning works on shapes alone; the fill would fail halfway, after earlier modules changed."""
    problems = [f"{key} is on the meta device (it holds no data)" for key, tensor in state.items() if tensor.is_meta]
    for group in first.groups:
        devices = sorted({str(state[key].device) for key in group.source_keys()})
        if len(devices) > 1 and "meta" not in devices:
            problems.append(f"{group.sources_summary()} are on different devices ({', '.join(devices)})")
    return problems


def _shared(
    state: Mapping[str, torch.Tensor],
    converted: set[str],
    owners: Mapping[int, list[str]],
    reported: set[int],
    verb: str,
) -> list[str]:
    """Converted tensors that are also the model's tensor under another name (a weight shared across layers): each
    place would get its own converted copy, and training would move them apart. A tensor no step converts is placed
    as the very object it was, so its sharing is kept."""
    problems = []
    for key in sorted(converted):
        others = [other for other in owners.get(id(state[key]), ()) if other != key]
        if others and id(state[key]) not in reported:
            reported.add(id(state[key]))  # named once, at its first place, not again at the others
            problems.append(
                f"{key} is the same tensor as {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}, and {verb} "
                "converts it into a new tensor at each place, which would no longer be shared"
            )
    return problems


def _execute(model: PreTrainedModel, planned: _Restructuring) -> None:
    """Carry out ``planned``: move the hooks, then replace the modules one at a time through the load's fill stage,
    the old one released before the next, so the memory a restructuring adds is one converted module."""
    for move in planned.hook_moves:
        move_hooks(move)
    with torch.no_grad():
        for name, steps in planned.modules:
            _fill(model, planned.target.get_submodule(name), name, steps)
            return_freed_memory()  # the old module's converted tensors go now, not at the end


def _fill(model: PreTrainedModel, new: nn.Module, name: str, steps: Sequence[ConversionPlan]) -> None:
    """Fill ``new`` (a meta module) from the live module ``name``'s tensors through ``steps``, put it in the live
    one's place and dismantle the live one.

    The last step runs through the load's fill stage (:func:`~modelpatch.loading.materialize.fill`) with the live
    tensors (after the earlier steps) as its source; a tensor no step converts is placed as the very Parameter it was.
    """
    live = model.get_submodule(name)
    state = _module_state(model, name)
    *earlier, last = steps
    tensors: Mapping[str, torch.Tensor] = state
    for plan in earlier:
        tensors = plan.run(tensors.__getitem__)
    requires_grad, grads = trains(state, steps), carried_grads(state, steps)
    local = len(name) + 1

    def place(key: str, tensor: torch.Tensor) -> bool:
        kept = tensor if isinstance(tensor, nn.Parameter) else tensor.contiguous()
        _assign(new, key[local:], kept, requires_grad[key], grads.get(key))
        return False  # nothing copied: no file pages to release

    # Never "file mapped": a live tensor may be a view of a checkpoint's private mapping whose pages it changed since
    # (a training step); releasing them would drop its data.
    fill(last, TensorSource(tensors.__getitem__, lambda key: False), place)
    # Buffers outside the state dict (non-persistent ones) come from the live module, by name.
    live_buffers = dict(live.named_buffers())
    for buffer_name, buffer in list(new.named_buffers()):
        if buffer.device.type == "meta":
            if buffer_name not in live_buffers:
                raise FusionError(f"{name}.{buffer_name}: the restructured module has a buffer the live one lacks.")
            _assign(new, buffer_name, live_buffers[buffer_name], False)
    new.train(live.training)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)
    _dismantle(live)


def _bound(transforms: Sequence[WeightTransform], groups: Sequence[ConversionGroup]) -> list[WeightTransform]:
    """``transforms`` with each converter replaced by its operations as bound in ``groups`` when they are the same in
    every group (the sizes a save needs to reverse it exactly, as a load records them); else kept as declared."""
    bound: dict[WeightConverter, set[tuple]] = {}
    for group in groups:
        bound.setdefault(group.converter, set()).add(group.operations)
    result: list[WeightTransform] = []
    for transform in transforms:
        if isinstance(transform, WeightConverter) and len(bound.get(transform, ())) == 1:
            transform = copy.copy(transform)  # scope, options and patterns as declared; only the operations bound
            transform.operations = next(iter(bound[transform]))
        result.append(transform)
    return result


def _dismantle(module: nn.Module) -> None:
    """Break the reference cycles of a replaced fused module (a projection slice's reference to its owner), so that
    reference counting frees its tensors at once rather than at the next garbage collection (a forward still running
    on it finishes). A family's module with such a cycle says how to break it: ``release_owner()``."""
    for child in module.modules():
        release = getattr(type(child), "release_owner", None)
        if callable(release):
            release(child)


def _record(model: PreTrainedModel, fusion_config: Mapping[str, Any], transforms: Sequence[WeightTransform]) -> None:
    record_fusion_config(model.config, dict(fusion_config))
    record = ensure_model_record(model)
    record.transforms = tuple(transforms)
    record.expected_state = model_expectations(model)
    install_state_dict_boundary(model)


def _fused_modules(model: nn.Module) -> dict[str, tuple[type, Any]]:
    """Fused module name -> (original class, spec), outermost only."""
    found: dict[str, tuple[type, Any]] = {}
    for name, module in model.named_modules():
        origin = fused_origin(module)
        if origin is not None and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = origin
    return found


def _refuse_held(model: nn.Module, names: Sequence[str], optimizer: torch.optim.Optimizer | None, what: str) -> None:
    """Refuse, before anything changes, to replace parameters that ``optimizer`` holds: it would keep stepping the
    old tensors (and its state for them would not follow the conversion)."""
    if optimizer is None:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    hit = [
        f"{name}.{key}" for name in names for key, p in model.get_submodule(name).named_parameters() if id(p) in held
    ]
    if hit:
        raise FusionError(
            f"{what}() would replace {len(hit)} parameter(s) that the optimizer holds ({', '.join(hit[:3])}"
            f"{', ...' if len(hit) > 3 else ''}); it would go on updating the old tensors. Call {what}() before "
            "building the optimizer (and the Trainer), or build a new optimizer afterwards. Nothing was changed."
        )


@_one_at_a_time
def fuse(
    model: PreTrainedModel, fusion_config: Mapping[str, Any], *, optimizer: torch.optim.Optimizer | None = None
) -> PreTrainedModel:
    """Restructure ``model`` in place with ``fusion_config`` (``{"qkv": True, ...}``), as a load with it would.

    Works on any transformers model in memory: loaded by stock ``from_pretrained``, trained by a Trainer, or loaded by
    modelpatch without fusions. Weights are converted with the fusions' own transforms, one module at a time; the
    parameters no fusion touches stay the same objects. Afterwards :func:`modelpatch.save_pretrained` (and
    ``model.save_pretrained``) write the original checkpoint layout, bit for bit, and :func:`unfuse` restores the
    stock structure.

    The fused modules' parameters are new objects: an optimizer built before does not hold them. Pass it as
    ``optimizer`` to have that refused before anything changes; fuse before building the optimizer (or Trainer).

    Returns:
        ``model`` itself.

    Raises:
        FusionError: an unknown fusion or invalid options; the model is already fused (call :func:`unfuse` first); a
            module's tensors do not convert (the model is left unchanged); ``optimizer`` holds parameters it replaces.
    """
    _check_live(model, "fuse")
    normalized = normalize_fusion_config(fusion_config)
    if fused := _fused_modules(model):
        raise FusionError(
            f"{type(model).__name__} is already fused ({stored_fusion_config(model.config)}; "
            f"e.g. {next(iter(fused))}). "
            "Call modelpatch.unfuse(model) first, then fuse it with the new fusion config."
        )
    base_layers = [registry.snapshot()]
    unfused = build_empty_model(type(model), copy.deepcopy(model.config), torch.float32, base_layers)
    prepared = prepare_fusions(unfused, model.config, resolve_fusion_config(model.config, normalized), base_layers)
    if not prepared.fused:
        logger.warning("fuse(): nothing to fuse in %s with %s.", type(model).__name__, normalized)
        return model
    target = build_empty_model(type(model), model.config, model.dtype, [prepared.mapping, *base_layers])
    names = sorted(name for modules in prepared.fused.values() for name in modules)
    for name in names:
        origin = fused_origin(target.get_submodule(name))
        live = model.get_submodule(name)
        if origin is None or type(live) is not origin[0]:
            raise FusionError(
                f"Cannot fuse {name}: it is a {type(live).__name__}, while {type(model).__name__} builds "
                f"{origin[0].__name__ if origin else 'another class'} there (a module replaced since the model was "
                "built). Load the model with modelpatch.from_pretrained(..., fusion_config=...) instead."
            )
    _refuse_held(model, names, optimizer, "fuse")
    base = _base_transforms(model)
    planned = _plan(model, target, names, [functools.partial(plan_load, transforms=prepared.transforms)], "fuse")
    _execute(model, planned)
    finish_fused_modules(model)
    record = ensure_model_record(model)
    if record.base_transforms is None:
        record.base_transforms = tuple(base)
    _record(model, normalized, prepared.adjust_conversions(base))
    logger.info("Fused %d modules of %s: %s", len(names), type(model).__name__, sorted(prepared.fused))
    return model


@_one_at_a_time
def unfuse(model: PreTrainedModel, *, optimizer: torch.optim.Optimizer | None = None) -> PreTrainedModel:
    """Restore the stock structure of a fused ``model`` in place (fused by :func:`fuse` or at load).

    Every fused module is replaced by the class it replaced, filled through the exact reverse of the fusion's
    transforms: the state equals the unfused model's, bit for bit. Returns ``model`` itself. As with :func:`fuse`,
    an ``optimizer`` holding parameters it replaces is refused (a FusionError) before anything changes.
    """
    _check_live(model, "unfuse")
    fused = _fused_modules(model)
    if not fused:
        logger.warning("unfuse(): %s has no fused modules.", type(model).__name__)
        return model
    target = build_empty_model(type(model), model.config, model.dtype, [registry.snapshot()])
    by_spec: dict[int, tuple[Any, dict[str, nn.Module]]] = {}
    for name, (original, spec) in fused.items():
        stock = target.get_submodule(name)
        if type(stock) is not original:
            raise FusionError(
                f"Cannot unfuse {name}: it replaced {original.__name__}, but {type(model).__name__} now builds "
                f"{type(stock).__name__} there (the patch it was built with is no longer registered)."
            )
        by_spec.setdefault(id(spec), (spec, {}))[1][name] = stock
    _refuse_held(model, sorted(fused), optimizer, "unfuse")
    transforms: list[WeightTransform] = []
    for spec, modules in by_spec.values():
        transforms.extend(spec_transforms(spec, model.config, modules))
    steps = [functools.partial(plan_save, transforms=transforms, alternatives=True)]
    _execute(model, _plan(model, target, sorted(fused), steps, "unfuse"))
    _record(model, {}, _base_transforms(model))
    logger.info("Unfused %d modules of %s", len(fused), type(model).__name__)
    return model


@_one_at_a_time
def patch_model(model: PreTrainedModel, patcher: Patcher) -> PreTrainedModel:
    """Apply ``patcher``'s class replacements to a model already in memory, converting weights as a load would.

    Each module the Patcher replaces is rebuilt as a load with that Patcher builds it, and filled from the live
    module: its tensors go back to the checkpoint layout (the model's current transforms, run backwards), then
    forward through the transforms the Patcher adjusts (its filters and extra conversions). Saves afterwards write the
    checkpoint layout, as after a load with the Patcher.

    Returns:
        ``model`` itself.

    Raises:
        FusionError: a replaced module's tensors do not convert (the Patcher's conversions do not allow it); the model
            is left unchanged.
    """
    _check_live(model, "patch_model")
    if not isinstance(patcher, Patcher):
        raise TypeError(f"patcher must be a modelpatch.Patcher, got {patcher!r}.")
    target = build_empty_model(type(model), model.config, model.dtype, [patcher.mapping, registry.snapshot()])
    replacements = patcher.mapping.replacements()
    names: list[str] = []
    for name, module in target.named_modules():
        if type(module) in replacements and not any(name.startswith(f"{outer}.") for outer in names):
            if type(model.get_submodule(name)) is not type(module):
                names.append(name)
    if not names:
        logger.warning("patch_model(): %s has no module %s replaces.", type(model).__name__, patcher)
        return model
    base = _base_transforms(model)
    patched = patcher.adjust_conversions(base)
    steps = [functools.partial(plan_save, transforms=base), functools.partial(plan_load, transforms=patched)]
    planned = _plan(model, target, names, steps, "patch")
    _execute(model, planned)
    patched = _bound(patched, planned.last_groups())
    ensure_model_record(model).base_transforms = tuple(patched)
    _record(model, stored_fusion_config(model.config) or {}, patched)
    logger.info("Patched %d modules of %s", len(names), type(model).__name__)
    return model
