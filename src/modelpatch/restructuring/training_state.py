"""The training state of tensors a restructuring converts: ``requires_grad`` and an accumulated ``.grad``.

``fuse`` / ``unfuse`` / ``patch_model`` (:mod:`modelpatch.restructuring.restructure`) build new tensors from several old
ones (``qkv_proj`` from ``q_proj``, ``k_proj`` and ``v_proj``) or several from one. Where the parts agree, the new
tensors take their state: the same ``requires_grad``, and each ``.grad`` converted exactly as the weights are. Where
they do not, or a ``.grad`` would pass through an operation that does not only move entries, planning refuses by name
before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from ..conversion.planner import ConversionGroup, ConversionPlan
from ..errors import FusionError


def _grad(tensor: torch.Tensor) -> torch.Tensor | None:
    """The gradient a parameter has accumulated (None for a buffer)."""
    return tensor.grad if isinstance(tensor, nn.Parameter) else None


def _run_on_grads(plan: ConversionPlan, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``plan`` run on the gradients of its inputs, converted exactly as the weights are: the outputs whose sources
    all have one (the others have none: training_state_problems refused the rest)."""
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


def training_state_problems(name: str, state: Mapping[str, torch.Tensor], plans: Sequence[ConversionPlan]) -> list[str]:
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


def training_state_error(model: nn.Module, problems: Sequence[str], verb: str) -> FusionError:
    function = "patch_model" if verb == "patch" else verb
    return FusionError(
        f"Cannot {verb} {type(model).__name__} without changing how it trains: {'; '.join(problems)}. A parameter "
        "has one requires_grad (a gradient mask would still let weight decay and momentum move the frozen entries), "
        "and a .grad is carried over only where every part has one and the conversion only moves entries. Freeze or "
        f"unfreeze the parts alike (requires_grad_) and clear their gradients (optimizer.zero_grad()) before "
        f"{function}(), or leave the model as it is. The model was left unchanged."
    )


def trains(state: Mapping[str, torch.Tensor], plans: Sequence[ConversionPlan]) -> dict[str, bool]:
    """Each output of ``plans`` (run one after another on ``state``) -> whether it is a trainable parameter: built from
    parameters that train (they agree: :func:`training_state_problems` refused the rest)."""
    origins, _ = _lineage(plans, state)
    result = {}
    for output, sources in origins.items():
        parts = [state[key] for key in sources if isinstance(state[key], nn.Parameter)]
        result[output] = bool(parts) and parts[0].requires_grad
    return result


def carried_grads(state: Mapping[str, torch.Tensor], plans: Sequence[ConversionPlan]) -> dict[str, torch.Tensor]:
    """The accumulated gradients of ``state``'s parameters, run through ``plans`` as the weights are: output key ->
    its ``.grad`` (none for an output whose parts have none)."""
    grads = {key: grad for key, tensor in state.items() if (grad := _grad(tensor)) is not None}
    for plan in plans:
        grads = _run_on_grads(plan, grads)
    return grads
