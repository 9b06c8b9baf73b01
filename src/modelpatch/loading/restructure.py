"""``fuse`` and ``unfuse``: restructure a model that is already in memory, with the transforms a load would use.

A model loaded by stock transformers, left by a Trainer, or loaded by modelpatch can be fused (and unfused) in
place, without touching disk. The target modules are built exactly as a load builds them — on the meta device, from
the model's own config, under the fusion's patch layer — and each is filled from the live module's tensors through
the fusion's weight transforms (forward to fuse, the exact reverse to unfuse), one module at a time: the extra memory
is at most one converted group. Tensors no transform touches (``o_proj``, norms) move over as the same
``nn.Parameter`` objects, so optimizers and tied references keep working. What a save needs is recorded, so
:func:`modelpatch.save_pretrained` and ``model.save_pretrained`` still write the original checkpoint layout.

Hooks registered on the modules replaced (an activation-steering forward hook on ``mlp``, transformers' own output
recorders) move to the modules that stand in their place where they keep their meaning: the replaced module itself
(its replacement is called where it was, with the same arguments, and computes the same function), and each module
inside it whose counterpart is called the same way (the same class, or a stand-in such as the projection slice that
stands where ``q_proj`` was). Their handles keep working. A hook that would lose its meaning (one on ``qkv_proj`` when
unfusing, a tensor hook on a weight that is converted into a new tensor) is refused by name before anything changes.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.nn.modules.module import _WrappedHook
from transformers import PreTrainedModel

from .._transformers_mapping import model_conversions
from ..conversion.planner import ConversionGroup, ConversionPlan, TensorMeta, plan_load, plan_save
from ..conversion.transforms import WeightConverter, WeightTransform
from ..errors import FusionError
from ..fusions.apply import normalize_fusion_config, prepare_fusions, resolve_fusion_config, spec_transforms
from ..fusions.generated import finish_fused_modules, fused_class_origin, fused_origin
from ..fusions.projections import ProjectionSlice
from ..patching import registry
from ..patching.patcher import Patcher
from ..state import record_fusion_config, stored_fusion_config
from .build import build_empty_model
from .distributed import refuse_sharded
from .materialize import return_freed_memory
from .plan import model_expectations
from .record import ensure_model_record, model_record
from .state_dict import install_state_dict_boundary

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

# torch's per-module hook dicts, with what the error messages call them: those run around a call, and those run
# around state-dict saves and loads. The ``_with_kwargs`` / ``_always_called`` dicts are flags of forward hooks.
_CALL_HOOKS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_pre_hooks_with_kwargs": "",
    "_forward_hooks": "forward hook",
    "_forward_hooks_with_kwargs": "",
    "_forward_hooks_always_called": "",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
_STATE_HOOKS = {
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_load_state_dict_pre_hooks": "load-state-dict pre-hook",
    "_load_state_dict_post_hooks": "load-state-dict post-hook",
}


def _hook_kinds(module: nn.Module, table: Mapping[str, str]) -> list[str]:
    return [label for attribute, label in table.items() if label and getattr(module, attribute)]


def _same_constructor(a: type, b: type) -> bool:
    """Whether instances of ``a`` and ``b`` are built by the same code: the same class, or a fused class and the
    class it replaced (whose ``__init__`` it runs)."""
    return a is b or any(
        origin is not None and origin[0] is other
        for origin, other in ((fused_class_origin(a), b), (fused_class_origin(b), a))
    )


def _called_alike(live: nn.Module, new: nn.Module) -> bool:
    """Whether ``new`` is called where ``live`` was, with the same arguments, returning what it returned."""
    a, b = type(live), type(new)
    return _same_constructor(a, b) or a in getattr(b, "stands_in_for", ()) or b in getattr(a, "stands_in_for", ())


def _state_layout(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(tensor.shape) for key, tensor in module.state_dict(keep_vars=True).items()}


def _hook_moves(
    live: nn.Module, new: nn.Module, name: str, verb: str
) -> tuple[list[tuple[nn.Module, nn.Module]], list[str]]:
    """The hooked modules inside ``live`` (module ``name``) and those of ``new`` their hooks move to; and, for each
    hook that would lose its meaning in ``new``, the module and why.

    The replaced module itself is called where it was, with the same arguments, and computes the same function: its
    call hooks always keep their meaning. A module inside it keeps them when ``new`` has a module at the same path
    that is called alike; state-dict hooks need the same state (keys and shapes) there.
    """
    targets = dict(new.named_modules(remove_duplicate=False))
    moves: list[tuple[nn.Module, nn.Module]] = []
    problems: list[str] = []
    for path, module in live.named_modules():
        call, state = _hook_kinds(module, _CALL_HOOKS), _hook_kinds(module, _STATE_HOOKS)
        forward = "forward" in module.__dict__
        if not (call or state or forward):
            continue
        target = targets.get(path)
        if forward:
            why = "its forward is set on the instance (it would keep calling the replaced module)"
        elif target is None:
            why = f"the {verb}d model has no module there"
        elif call and path and not _called_alike(module, target):
            why = f"a {type(target).__name__} stands there, not called as the {type(module).__name__} was"
        elif state and _state_layout(module) != _state_layout(target):
            why = f"the {type(target).__name__} that stands there holds other tensors"
        else:
            moves.append((module, target))
            continue
        kinds = ", ".join([*call, *state] or ["a forward set on the instance"])
        problems.append(f"{name}.{path} ({kinds}): {why}" if path else f"{name} ({kinds}): {why}")
    return moves, problems


def _move_hooks(live: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the hook dicts of ``live`` (the very objects, so that the hooks' handles remove them from
    ``new``). Hooks ``new`` registered itself when built are kept unless ``live`` was built by the same code (then
    ``live`` holds their twins)."""
    same = _same_constructor(type(live), type(new))
    for attribute in (*_CALL_HOOKS, *_STATE_HOOKS):
        hooks, own = getattr(live, attribute), getattr(new, attribute)
        if not hooks:
            continue
        if not same:
            for key, hook in own.items():
                hooks.setdefault(key, hook)
        new.__dict__[attribute] = hooks
    for hook in new._load_state_dict_pre_hooks.values():
        # register_load_state_dict_pre_hook binds its hook to the module by weak reference.
        if isinstance(hook, _WrappedHook) and hook.with_module and hook.module() is live:
            hook.module = weakref.ref(new)
    if live._backward_hooks or live._backward_pre_hooks:
        new._is_full_backward_hook = live._is_full_backward_hook


def _tensor_hook_problems(tensors: Mapping[str, torch.Tensor], kept: set[str], verb: str) -> list[str]:
    """Tensors with hooks of their own (``register_hook``, ``register_post_accumulate_grad_hook``) that the
    restructuring converts into new tensors, which would not have them."""
    return [
        f"{key} (a tensor hook): {verb} converts it into a new tensor"
        for key, tensor in tensors.items()
        if key not in kept and (tensor._backward_hooks or getattr(tensor, "_post_accumulate_grad_hooks", None))
    ]


def _grad(tensor: torch.Tensor) -> torch.Tensor | None:
    """The gradient a parameter has accumulated (None for a buffer)."""
    return tensor.grad if isinstance(tensor, nn.Parameter) else None


def _run_on_grads(plan: ConversionPlan, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``plan`` run on the gradients of its inputs, converted exactly as the weights are: the outputs whose sources
    all have one (the others have none: _training_state_problems refused the rest)."""
    out = {key: grads[source] for key, source in plan.direct.items() if source in grads}
    for group in plan.groups:
        if (sources := group.source_keys()) and all(key in grads for key in sources):
            out.update(group.run(grads.__getitem__))
    return out


def _lineage(
    plans: Sequence[ConversionPlan], keys: Iterable[str]
) -> tuple[dict[str, frozenset[str]], list[tuple[ConversionGroup, frozenset[str]]]]:
    """Each output of ``plans`` (run one after another on tensors ``keys``) -> the keys of ``keys`` it is built from;
    and each converted group of every plan with the keys of ``keys`` its sources are built from."""
    origins = {key: frozenset((key,)) for key in keys}
    groups: list[tuple[ConversionGroup, frozenset[str]]] = []
    for plan in plans:
        groups += [(group, frozenset().union(*(origins[key] for key in group.source_keys()))) for group in plan.groups]
        origins = {
            out: frozenset().union(*(origins[key] for key in sources)) for out, sources in plan.sources_of().items()
        }
    return origins, groups


def _listed(keys: Iterable[str], local: int, limit: int = 4) -> str:
    names = [key[local:] for key in sorted(keys)]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _training_state_problems(
    name: str, state: Mapping[str, torch.Tensor], plans: Sequence[ConversionPlan]
) -> list[str]:
    """What of the parts' training state a tensor built from several of them cannot keep, in module ``name``.

    A Parameter has one ``requires_grad``: parts frozen and parts trainable cannot become one (a gradient mask would
    still let weight decay and momentum move the frozen entries). A ``.grad`` is carried into the new layout as the
    weights are, which needs every part to have one (an optimizer skips a parameter without one, and steps one with
    zeros) and operations that only move entries.
    """
    origins, groups = _lineage(plans, state)
    local = len(name) + 1
    problems: list[str] = []
    for output, sources in sorted(origins.items()):
        if len(sources) < 2:
            continue
        parameters = [key for key in sources if isinstance(state[key], nn.Parameter)]
        frozen = [key for key in parameters if not state[key].requires_grad]
        if frozen and len(frozen) < len(parameters):
            trainable = set(parameters) - set(frozen)
            problems.append(
                f"{name}: {output[local:]} would be one parameter made of {_listed(frozen, local)} (frozen: "
                f"requires_grad=False) and {_listed(trainable, local)} (trainable)"
            )
        graded = [key for key in sources if _grad(state[key]) is not None]
        if graded and len(graded) < len(sources):
            problems.append(
                f"{name}: {output[local:]} would be made of {_listed(graded, local)} (with an accumulated .grad) and "
                f"{_listed(sources - set(graded), local)} (without one)"
            )
    for group, sources in groups:
        moving = [type(op).__name__ for op in group.operations if not op.moves_entries]
        if moving and any(_grad(state[key]) is not None for key in sources):
            problems.append(
                f"{name}: the .grad of {_listed(sources, local)} cannot be carried through {', '.join(moving)} "
                f"(it does not only move entries) to {_listed(group.target_keys(), local)}"
            )
    return problems


def _training_state_error(model: nn.Module, problems: Sequence[str], verb: str) -> FusionError:
    function = "patch_model" if verb == "patch" else verb
    return FusionError(
        f"Cannot {verb} {type(model).__name__} without changing how it trains: {'; '.join(problems)}. A parameter "
        "has one requires_grad (a gradient mask would still let weight decay and momentum move the frozen entries), "
        "and a .grad is carried over only where every part has one and the conversion only moves entries. Freeze or "
        f"unfreeze the parts alike (requires_grad_) and clear their gradients (optimizer.zero_grad()) before "
        f"{function}(), or leave the model as it is. The model was left unchanged."
    )


def _swap(
    model: PreTrainedModel, target: nn.Module, names: Sequence[str], steps: Sequence[Step], verb: str
) -> list[ConversionGroup]:
    """Replace each module ``names`` of ``model`` by the meta module of the same name in ``target``, filled from it.
    Returns the converted groups of the last step (their operations bound to the real shapes).

    A module's tensors go through ``steps``, each a planner (``plan_load`` / ``plan_save`` bound to transforms) run
    on the previous step's output. Every module is planned (metadata only) before any is replaced, so a mismatch
    leaves the model untouched; then modules are converted one at a time and the old one is released before the next,
    so the memory a restructuring adds is one converted module.
    """
    plans = _plan_swap(model, target, names, steps, verb)
    last_groups = [group for _, module_plans in plans for group in module_plans[-1].groups]
    with torch.no_grad():
        for name, module_plans in plans:
            _fill(model, target, name, module_plans)
            return_freed_memory()  # the old module's converted tensors go now, not at the end
    return last_groups


def _plan_swap(
    model: PreTrainedModel, target: nn.Module, names: Sequence[str], steps: Sequence[Step], verb: str
) -> list[tuple[str, list[ConversionPlan]]]:
    """Plan every module ``names`` through ``steps`` (metadata only) and move the hooks that stay meaningful; a
    module whose tensors do not convert to its ``target`` counterpart, or a hook that would lose its meaning, is a
    FusionError before anything changes."""
    plans = []
    hook_moves: list[tuple[nn.Module, nn.Module]] = []
    hook_problems: list[str] = []
    training_problems: list[str] = []
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
        moves, hooked = _hook_moves(model.get_submodule(name), new, name, verb)
        hook_moves += moves
        hook_problems += hooked + _tensor_hook_problems(state, set(passed.values()), verb)
        expected = {
            f"{name}.{key}": TensorMeta(tuple(t.shape), t.dtype) for key, t in new.state_dict(keep_vars=True).items()
        }
        wrong = sorted(
            key
            for key in metas.keys() | expected.keys()
            if key not in metas or key not in expected or metas[key].shape != expected[key].shape
        )
        if problems or wrong:
            raise FusionError(
                f"Cannot {verb} {name} ({type(model.get_submodule(name)).__name__}): its tensors do not convert to "
                f"those of {type(new).__name__} ({', '.join(wrong[:6])}{', ...' if len(wrong) > 6 else ''}"
                f"{'; ' + '; '.join(problems) if problems else ''}). The model was left unchanged."
            )
        training_problems += _training_state_problems(name, state, module_plans)
        plans.append((name, module_plans))
    if training_problems:
        raise _training_state_error(model, training_problems, verb)
    if hook_problems:
        raise FusionError(
            f"Cannot {verb} {type(model).__name__}: hooks are registered where the {verb}d model would not keep "
            f"their meaning: {'; '.join(hook_problems)}. Remove them (handle.remove()), {verb}, and register them "
            f"again on the modules that stand there then. The model was left unchanged."
        )
    for live, new in hook_moves:
        _move_hooks(live, new)
    return plans


def _fill(model: PreTrainedModel, target: nn.Module, name: str, module_plans: Sequence[ConversionPlan]) -> None:
    """Convert the live module ``name``'s tensors through ``module_plans`` into ``target``'s meta module of that name,
    put it in the live one's place and dismantle the live one."""
    live, new = model.get_submodule(name), target.get_submodule(name)
    state = _module_state(model, name)
    tensors: Mapping[str, torch.Tensor] = state
    grads = {key: grad for key, tensor in state.items() if (grad := _grad(tensor)) is not None}
    for plan in module_plans:
        tensors, grads = plan.run(tensors.__getitem__), _run_on_grads(plan, grads)
    origins, _ = _lineage(module_plans, state)
    local = len(name) + 1
    for key, tensor in tensors.items():
        # Its parts agree (_training_state_problems): the first Parameter among them says whether it trains.
        parts = [state[origin] for origin in origins[key] if isinstance(state[origin], nn.Parameter)]
        requires_grad = bool(parts) and parts[0].requires_grad
        contiguous = tensor if isinstance(tensor, nn.Parameter) else tensor.contiguous()
        _assign(new, key[local:], contiguous, requires_grad, grads.get(key))
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
    """Break the owner <-> slice reference cycles of a replaced fused module, so that reference counting frees its
    tensors at once rather than at the next garbage collection (a forward still running on it finishes)."""
    for child in module.modules():
        if isinstance(child, ProjectionSlice):
            child.release_owner()


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
    _swap(model, target, names, [functools.partial(plan_load, transforms=prepared.transforms)], "fuse")
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
    _swap(
        model, target, sorted(fused), [functools.partial(plan_save, transforms=transforms, alternatives=True)], "unfuse"
    )
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
    patched = _bound(patched, _swap(model, target, names, steps, "patch"))
    ensure_model_record(model).base_transforms = tuple(patched)
    _record(model, stored_fusion_config(model.config) or {}, patched)
    logger.info("Patched %d modules of %s", len(names), type(model).__name__)
    return model
