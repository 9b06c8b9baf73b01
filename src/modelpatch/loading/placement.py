"""The placement keywords of a load, parsed and checked before anything is built: ``device_map`` naming one device,
and the distributed keywords ``tp_plan`` / ``tp_size`` / ``distributed_config`` (tensor parallelism, FSDP2, HSDP).

They are read while the options are made (:meth:`LoadOptions.from_keywords
<modelpatch.loading.options.LoadOptions.from_keywords>`), so a bad value is refused before any file is looked at;
the modes they ask for (``dispatch.py``, ``parallel.py``, ``fsdp.py``) are made from the options later. Kept out of
those modes' modules so that ``options.py`` imports none of them: a mode's hooks receive the load plan, which holds
the options, so an import of a mode by the options would close a circle.
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


# What modelpatch loads of DistributedConfig's parallelisms, in words for the messages refusing the others.
SUPPORTED_PARALLELISMS = (
    "tensor parallelism alone (tp_plan / tp_size), FSDP2 alone (fsdp_size) or HSDP (dp_replicate_size x fsdp_size), "
    "the last two with fsdp_plan and fsdp_mixed_precision"
)

# DistributedConfig fields that ask for something modelpatch does not load, with the value that asks for nothing.
# The sizes (tp_size x fsdp_size, pp_size, ep_size) are checked once the config has resolved them.
_UNSUPPORTED_FIELDS: Mapping[str, tuple[object, str]] = {
    "enable_expert_parallel": (False, "expert parallelism"),
    "ep_plan": (None, "expert parallelism"),
    "enable_sequence_parallel": (False, "sequence parallelism"),
    # Stock's CPU offload pins memory, which needs a GPU: not tested on the CPU ranks of the suite, so not offered.
    "fsdp_cpu_offload": (False, "FSDP CPU offload (fsdp_cpu_offload)"),
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
        for name, (none, _) in _UNSUPPORTED_FIELDS.items()
        if name in fields and fields[name] is not None and fields[name] != none
    }
    if asked:
        kinds = sorted({_UNSUPPORTED_FIELDS[name][1] for name in asked})
        raise TensorParallelError(
            f"distributed_config asks for {', '.join(kinds)} ({asked}): modelpatch loads {SUPPORTED_PARALLELISMS}; "
            "load such models with transformers."
        )


def distributed_config_of(
    tp_plan: str | dict[str, str] | None, tp_size: int | None, distributed_config: DistributedConfig | dict | None
) -> tuple[DistributedConfig | None, dict[str, str] | None]:
    """The :class:`DistributedConfig` the keywords ask for (as transformers reads them), or None for no sharding
    (a config asking for FSDP2 or HSDP has ``dp_size > 1``, one asking for tensor parallelism ``tp_size > 1``);
    and, for a load that shards nothing (one process, or ``tp_size=1``: as in transformers), the rules of its
    ``tp_plan`` dict, which the load checks against the model as every rank of a sharded load does
    (:class:`UnshardedPlan`), else None.

    Checked before anything is read: a ``tp_plan`` that is neither ``"auto"`` nor a dict of known parallel styles, a
    ``tp_size`` that is no positive integer or exceeds the processes launched, ``distributed_config`` fields it does
    not have, an FSDP mesh (``dp_replicate_size x fsdp_size``) of another size than the processes launched.

    Raises:
        TensorParallelError: Both ``distributed_config`` and ``tp_plan``/``tp_size``; a bad value as above; or what
            modelpatch does not load (:data:`SUPPORTED_PARALLELISMS` says what it does): tensor parallelism together
            with FSDP, pipeline, expert or sequence parallelism, FSDP's CPU offload.
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
    """``distributed_config`` if it shards over more than one rank in a way that this process can load: tensor
    parallelism alone, or FSDP2 / HSDP alone (:data:`SUPPORTED_PARALLELISMS`); None when it shards nothing."""
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
    sizes = {
        name: getattr(distributed_config, name, 1) or 1
        for name in ("tp_size", "dp_replicate_size", "fsdp_size", "pp_size", "ep_size")
    }
    data_parallel = sizes["dp_replicate_size"] * sizes["fsdp_size"]  # is_fully_sharded_config's product
    others = {name: size for name, size in sizes.items() if size > 1}
    if sizes["pp_size"] > 1 or sizes["ep_size"] > 1 or (sizes["tp_size"] > 1 and data_parallel > 1):
        raise TensorParallelError(
            f"distributed_config asks for {others}: modelpatch loads {SUPPORTED_PARALLELISMS}; tensor parallelism "
            "together with FSDP, pipeline and expert parallelism are not supported yet: load such models with "
            "transformers."
        )
    if data_parallel > 1:
        return _checked_fully_sharded(distributed_config, sizes, data_parallel)
    tp_size = distributed_config.tp_size  # an int once the config is built (None is resolved to the world size)
    if tp_size is None or tp_size <= 1:
        return None
    _check_distributed_api(f"Tensor-parallel loading (tp_size={tp_size})", "load without tp_plan")
    world_size = _world_size()
    if tp_size > world_size:
        raise TensorParallelError(
            f"tp_size={tp_size} needs {tp_size} processes, but this one was launched with world size {world_size}: "
            f"run the script under torchrun --nproc-per-node {tp_size} (one process per device), or lower tp_size."
        )
    return distributed_config


def _checked_fully_sharded(
    distributed_config: DistributedConfig, sizes: Mapping[str, int], data_parallel: int
) -> DistributedConfig:
    """``distributed_config`` asking for FSDP2 (``fsdp_size``) or HSDP (``dp_replicate_size x fsdp_size``), if this
    process can load it: transformers' distributed API, a torch whose FSDP2 transformers drives (2.8 on, as stock
    requires), one process per rank of the mesh."""
    asked = ", ".join(f"{name}={sizes[name]}" for name in ("dp_replicate_size", "fsdp_size") if sizes[name] > 1)
    _check_distributed_api(f"FSDP2 loading ({asked})", "load unsharded and fully_shard the model yourself")
    if _torch_version() < (2, 8):
        raise TensorParallelError(
            f"FSDP2 loading ({asked}) needs torch >= 2.8, as transformers' does; this is torch {torch.__version__}. "
            "Upgrade torch, or load unsharded and fully_shard the model yourself."
        )
    world_size = _world_size()
    if data_parallel != world_size:
        raise TensorParallelError(
            f"distributed_config ({asked}) makes a mesh of {data_parallel} ranks, but this process was launched with "
            f"world size {world_size}: run the script under torchrun --nproc-per-node {data_parallel}, or give "
            f"sizes whose product is {world_size}."
        )
    return distributed_config


def is_fully_sharded_config(distributed_config: DistributedConfig) -> bool:
    """Whether ``distributed_config`` (one :func:`distributed_config_of` returned) asks for FSDP2 or HSDP: a
    data-parallel mesh (``dp_replicate_size x fsdp_size``) of more than one rank."""
    return (getattr(distributed_config, "dp_replicate_size", 1) or 1) * (distributed_config.fsdp_size or 1) > 1


def _check_distributed_api(what: str, remedy: str) -> None:
    """Refuse ``what`` (a sharded load) on a transformers without the distributed API modelpatch drives."""
    if not tensor_parallel_supported():
        import transformers

        raise TensorParallelError(
            f"{what} drives the distributed API of transformers 5.23; transformers {transformers.__version__} "
            f"predates it. Upgrade transformers, or {remedy}."
        )


def _torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor) release."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _distributed_config(**fields: Any) -> DistributedConfig:
    """``DistributedConfig(**fields)``, its own validation errors (sizes below 1, ...) as TensorParallelError."""
    try:
        return DistributedConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise TensorParallelError(f"Invalid distributed config {fields}: {exc}") from None
