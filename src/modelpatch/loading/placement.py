"""The placement keywords of a load, parsed and checked before anything is built: ``device_map`` naming one device,
and the tensor-parallel keywords ``tp_plan`` / ``tp_size`` / ``distributed_config``.

They are read while the options are made (:meth:`LoadOptions.from_keywords
<modelpatch.loading.options.LoadOptions.from_keywords>`), so a bad value is refused before any file is looked at;
the modes they ask for (``dispatch.py``, ``parallel.py``) are made from the options later. Kept out of those modes'
modules so that ``options.py`` imports none of them: a mode's hooks receive the load plan, which holds the options,
so an import of a mode by the options would close a circle.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._transformers import DistributedConfig, parallel_style_names, tensor_parallel_supported
from ..errors import TensorParallelError

_AUTO = ("auto", "balanced", "balanced_low_0", "sequential")


def single_device(device_map: str | int | torch.device | Mapping[str, Any]) -> torch.device | None:
    """The one device ``device_map`` puts the whole model on, or None when it asks for a dispatch.

    As in transformers: a device name (``"cpu"``, ``"cuda:0"``; ``"cuda"`` is the ``LOCAL_RANK`` GPU), an index, a
    ``torch.device`` or ``{"": device}`` mean one device; the model is then loaded straight onto it.
    """
    if isinstance(device_map, Mapping):
        whole = device_map.get("") if len(device_map) == 1 else None
        return None if whole is None or whole == "disk" else _device(whole)
    if isinstance(device_map, str) and device_map in _AUTO:
        return None
    if device_map == "cuda":
        device_map = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return _device(device_map)


def _device(value: Any) -> torch.device:
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise ValueError(f"device_map names no device: {value!r} (for the CPU, pass 'cpu').")
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device_map must be a dict or one of {_AUTO}, or a device ('cpu', 'cuda:0', 0), got {value!r}."
        ) from None


# DistributedConfig fields that ask for a parallelism other than tensor parallelism, with the value that asks for
# none. The sizes (fsdp_size, pp_size, ...) are checked once the config has resolved them.
_NOT_TENSOR_PARALLEL: Mapping[str, tuple[object, str]] = {
    "enable_expert_parallel": (False, "expert parallelism"),
    "ep_plan": (None, "expert parallelism"),
    "enable_sequence_parallel": (False, "sequence parallelism"),
    "fsdp_plan": (None, "FSDP"),
    "fsdp_cpu_offload": (False, "FSDP"),
    "fsdp_mixed_precision": (False, "FSDP"),
}


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _check_tp_plan(plan: object, where: str) -> None:
    """A dict plan maps module or parameter patterns (strings) to the name of a registered parallel style."""
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise TensorParallelError(
            f"{where} must be 'auto' or a dict of {{module pattern: parallel style}}, got {plan!r} "
            f"({type(plan).__name__})."
        )
    if not tensor_parallel_supported():
        return  # no style registry to check against: a sharded load is refused below
    styles = parallel_style_names()
    unknown = {pattern: style for pattern, style in plan.items() if style not in styles}
    if unknown:
        raise TensorParallelError(
            f"{where} names unknown parallel styles: {unknown}. The styles are: {', '.join(sorted(styles))}."
        )


def _refuse_other_parallelisms(fields: Mapping[str, object]) -> None:
    asked = {
        name: fields[name]
        for name, (none, _) in _NOT_TENSOR_PARALLEL.items()
        if name in fields and fields[name] is not None and fields[name] != none
    }
    if asked:
        kinds = sorted({_NOT_TENSOR_PARALLEL[name][1] for name in asked})
        raise TensorParallelError(
            f"distributed_config asks for {', '.join(kinds)} ({asked}): modelpatch loads with tensor parallelism only "
            "(tp_plan / tp_size); load such models with transformers."
        )


def distributed_config_of(
    tp_plan: str | dict[str, str] | None, tp_size: int | None, distributed_config: DistributedConfig | dict | None
) -> tuple[DistributedConfig | None, dict[str, str] | None]:
    """The :class:`DistributedConfig` the keywords ask for (as transformers reads them), or None for no sharding;
    and, for a load that shards nothing (one process, or ``tp_size=1``: as in transformers), the rules of its
    ``tp_plan`` dict, which the load checks against the model as every rank of a sharded load does
    (:class:`UnshardedPlan`), else None.

    Checked before anything is read: a ``tp_plan`` that is neither ``"auto"`` nor a dict of known parallel styles, a
    ``tp_size`` that is no positive integer or exceeds the processes launched, ``distributed_config`` fields it does
    not have.

    Raises:
        TensorParallelError: Both ``distributed_config`` and ``tp_plan``/``tp_size``; a bad value as above; or a
            parallelism other than tensor parallelism (FSDP, pipeline, expert or sequence parallel), which modelpatch
            does not do.
    """
    if distributed_config is not None and (tp_plan is not None or tp_size is not None):
        raise TensorParallelError("Pass either distributed_config or tp_plan/tp_size, not both.")
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1):
        raise TensorParallelError(f"tp_size must be a positive integer, got {tp_size!r}.")
    if tp_plan is not None or tp_size is not None:
        distributed_config = _from_tp_keywords(tp_plan, tp_size)
    elif isinstance(distributed_config, Mapping):
        distributed_config = _from_mapping(distributed_config)
    if distributed_config is None:
        return None, None
    sharded = _checked(distributed_config)
    rules = getattr(distributed_config, "tp_plan", None)  # checked: "auto", None or a dict of strings
    return sharded, dict(rules) if sharded is None and isinstance(rules, Mapping) else None


def _from_tp_keywords(tp_plan: str | dict[str, str] | None, tp_size: int | None) -> DistributedConfig:
    if tp_size is not None and tp_plan is None:
        raise TensorParallelError(f"tp_size={tp_size} needs tp_plan ('auto' for the model's own plan).")
    plan: dict[str, str] | Literal["auto"] | None
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise TensorParallelError(f"tp_plan must be 'auto' or a dict of rules, got {tp_plan!r}.")
        plan = "auto"
    else:
        _check_tp_plan(tp_plan, "tp_plan")
        plan = dict(tp_plan)  # type: ignore[arg-type]  # checked: a mapping of strings
    return _distributed_config(tp_plan=plan, tp_size=tp_size)


def _from_mapping(distributed_config: Mapping[str, Any]) -> DistributedConfig:
    # transformers before 5.23 made DistributedConfig otherwise: its fields are not listed there.
    fields = (
        {f.name for f in dataclasses.fields(DistributedConfig)} if dataclasses.is_dataclass(DistributedConfig) else None
    )
    unknown = sorted(str(name) for name in distributed_config if fields is not None and name not in fields)
    if unknown:
        raise TensorParallelError(
            f"distributed_config has no field {', '.join(map(repr, unknown))}; DistributedConfig's fields are "
            f"{', '.join(sorted(fields or ()))}."
        )
    # Read before DistributedConfig resolves them (enable_expert_parallel becomes ep_size there).
    _refuse_other_parallelisms(distributed_config)
    return _distributed_config(**dict(distributed_config))


def _checked(distributed_config: object) -> DistributedConfig | None:
    """``distributed_config`` if it asks for tensor parallelism over more than one rank, that this process can do."""
    if not isinstance(distributed_config, DistributedConfig):
        raise TensorParallelError(
            f"distributed_config must be a transformers DistributedConfig or a dict, got {distributed_config!r}."
        )
    _refuse_other_parallelisms(vars(distributed_config))
    if isinstance(distributed_config.tp_plan, str):
        if distributed_config.tp_plan != "auto":
            raise TensorParallelError(
                f"distributed_config.tp_plan must be 'auto' or a dict of rules, got {distributed_config.tp_plan!r}."
            )
    elif distributed_config.tp_plan is not None:
        _check_tp_plan(distributed_config.tp_plan, "distributed_config.tp_plan")
    # A field this transformers' DistributedConfig lacks (dp_replicate_size before 5.23) asks for nothing.
    others = {
        name: getattr(distributed_config, name, 1)
        for name in ("fsdp_size", "dp_replicate_size", "pp_size", "ep_size")
        if (getattr(distributed_config, name, 1) or 1) > 1
    }
    if others:
        raise TensorParallelError(
            f"distributed_config asks for {others}: modelpatch loads with tensor parallelism only (tp_plan / tp_size); "
            "load FSDP, pipeline or expert-parallel models with transformers."
        )
    tp_size = distributed_config.tp_size  # an int once the config is built (None is resolved to the world size)
    if tp_size is None or tp_size <= 1:
        return None
    if not tensor_parallel_supported():
        import transformers

        raise TensorParallelError(
            f"Tensor-parallel loading (tp_size={tp_size}) drives the distributed API of transformers 5.23; "
            f"transformers {transformers.__version__} predates it. Upgrade transformers, or load without tp_plan."
        )
    world_size = _world_size()
    if tp_size > world_size:
        raise TensorParallelError(
            f"tp_size={tp_size} needs {tp_size} processes, but this one was launched with world size {world_size}: "
            f"run the script under torchrun --nproc-per-node {tp_size} (one process per device), or lower tp_size."
        )
    return distributed_config


def _distributed_config(**fields: Any) -> DistributedConfig:
    """``DistributedConfig(**fields)``, its own validation errors (sizes below 1, ...) as TensorParallelError."""
    try:
        return DistributedConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise TensorParallelError(f"Invalid distributed config {fields}: {exc}") from None
