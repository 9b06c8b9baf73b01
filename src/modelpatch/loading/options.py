"""The settings of a load: every keyword of the public entry points, gathered and validated once, in one place."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from transformers import GenerationConfig, PretrainedConfig

from .._transformers import DistributedConfig
from ..checkpoint import Checkpoint
from ..modes.base import LoadMode
from ..patching.patcher import Patcher
from .hub import HubOptions
from .keywords import config_overrides
from .placement import distributed_config_of, single_device

_Read = TypeVar("_Read")

logger = logging.getLogger(__name__)

FusionConfig = Mapping[str, bool | Mapping[str, Any]]
UnexpectedKeys = Literal["warn", "error", "ignore"]

# The keywords that make up LoadOptions.hub, and those that make up LoadOptions.distributed.
_HUB_KEYWORDS = tuple(f.name for f in dataclasses.fields(HubOptions))
_DISTRIBUTED_KEYWORDS = ("tp_plan", "tp_size", "distributed_config")


@dataclass(frozen=True)
class LoadOptions:
    """Every setting of a load: what :func:`~modelpatch.from_pretrained`, :func:`~modelpatch.plan_pretrained` and
    offline conversion take as keywords (transformers' ``from_pretrained`` keywords, with their names and meanings).
    Built by :meth:`from_keywords` (which validates the keywords together) and checked when built, so a bad value is
    refused before any file is looked at.

    Attributes:
        patcher: Class replacements and conversion adjustments for this load only.
        fusion_config: ``{fusion name: True / False / options}``; None: the one stored in the config.
        dtype: Like transformers 5: ``"auto"`` / None (the config's dtype, else the checkpoint's) or a
            ``torch.dtype`` (or its name). The keyword ``torch_dtype`` is its deprecated alias (``dtype`` wins).
        new_parameters: Regex patterns of parameters that may be absent from the checkpoint; they are initialised as
            stock transformers initialises them (a fresh task head, say). Any other absent parameter is an error.
        unexpected_keys: What to do with checkpoint keys the model has no place for: "warn", "error" or "ignore".
        allow_pickle: Accept ``pytorch_model.bin`` checkpoints, read with ``torch.load(weights_only=True)``.
        allow_external_symlinks: Follow symlinked checkpoint files wherever they lead. By default a symlink must stay
            inside the checkpoint directory or, in a hub cache snapshot, inside its repository's ``blobs/``.
        hub: Where and how a hub repository is resolved: the keywords ``revision`` (branch, tag, ``refs/pr/N`` or
            commit), ``subfolder``, ``cache_dir``, ``token``, ``local_files_only`` and ``force_download``.
        quantization_config: Quantize at load like stock (a transformers ``TorchAoConfig``), or loading options of a
            quantized checkpoint. Quantized checkpoints (``quantization_config`` in config.json) need nothing: fp8,
            torchao and compressed-tensors load as stock loads them; other methods are refused by name.
        device: Where parameters go (None: the CPU). Unconverted CPU tensors stay memory-mapped (zero-copy). The
            keyword ``device_map`` naming one device (``"cpu"``, ``"cuda:0"``, ``0``, ``{"": device}``) sets it too.
        device_map: Modules spread over several devices with accelerate: ``"auto"`` (fit ``max_memory``),
            ``"balanced"``, ... or ``{module name: device}``. Weights of ``"disk"`` modules are read in place from the
            checkpoint's safetensors files when the load reads them unconverted, as in stock; converted ones need
            ``offload_folder``.
        max_memory: ``{device: bytes or "10GiB"}`` limits for ``device_map="auto"``.
        offload_folder: Where the weights offloaded to ``"disk"`` that cannot be read in place are written.
        offload_buffers: Offload buffers with the parameters of modules on ``"disk"``.
        distributed: The tensor-parallel layout asked for with the keywords ``tp_plan`` (``"auto"``: the model's own
            TP plan; a dict overrides some of its rules), ``tp_size`` (default: the world size) or
            ``distributed_config`` (a transformers ``DistributedConfig`` or dict: tensor parallelism, or FSDP2 with
            ``fsdp_size`` / HSDP with ``dp_replicate_size``): each ``torchrun`` rank reads only its shards
            (docs/loading_and_saving.md). None: no sharding.
        unsharded_tp_plan: The rules of a ``tp_plan`` dict given to a load that shards nothing (one process, or
            ``tp_size=1``; set from those keywords, never by itself): the model is loaded whole, as in transformers,
            and a rule naming no module of it is refused, as every rank of a sharded load refuses it.
        use_safetensors: ``True`` refuses checkpoints without safetensors weights; None reads safetensors, or pickle
            files when the checkpoint has nothing else and ``allow_pickle=True``.
        config: The config to build the model from instead of the checkpoint's ``config.json``: a
            ``PretrainedConfig`` or a directory / repo id holding one.
        config_overrides: Attributes of the checkpoint's config to override (the keywords no other field takes,
            ``output_attentions=True``), as in transformers. ``low_cpu_mem_usage`` (and ``offload_state_dict``) are
            accepted and change nothing: modelpatch always loads lazily. transformers keywords that modelpatch cannot
            honour (``key_mapping``, ``state_dict``, ...) raise ``ValueError`` saying why.
        attn_implementation: ``"eager"``, ``"sdpa"``, ... set on the config before the model is built, as stock.
        experts_implementation: The MoE experts implementation, set on the config as stock does.
        generation_config: Used instead of the checkpoint's ``generation_config.json``.
        trust_remote_code: modelpatch loads the model types built into transformers only: ``True`` is refused for
            a checkpoint that ships its own modeling code (``auto_map``).
        load_modes: Load modes of the caller's (:class:`~modelpatch.modes.base.LoadMode` instances, one load
            each), whose hooks run after those of the modes the other options ask for, in this order. Their planning
            hooks may run twice when the load's fusions step aside and the load is planned again without them.
    """

    patcher: Patcher | None = None
    fusion_config: FusionConfig | None = None
    dtype: torch.dtype | str | None = None
    new_parameters: Sequence[str] = ()
    unexpected_keys: UnexpectedKeys = "warn"
    allow_pickle: bool = False
    allow_external_symlinks: bool = False
    hub: HubOptions = field(default_factory=HubOptions)
    quantization_config: Any = None
    device: torch.device | None = None
    device_map: str | Mapping[str, Any] | None = None
    max_memory: Mapping[Any, Any] | None = None
    offload_folder: str | os.PathLike[str] | None = None
    offload_buffers: bool = False
    distributed: DistributedConfig | None = None
    unsharded_tp_plan: Mapping[str, str] | None = None
    use_safetensors: bool | None = None
    config: PretrainedConfig | str | os.PathLike[str] | None = None
    config_overrides: Mapping[str, Any] = field(default_factory=dict)
    attn_implementation: str | None = None
    experts_implementation: str | None = None
    generation_config: GenerationConfig | None = None
    trust_remote_code: bool | None = None
    load_modes: Sequence[LoadMode] = ()

    def __post_init__(self) -> None:
        if self.patcher is not None and not isinstance(self.patcher, Patcher):
            raise TypeError(f"patcher must be a modelpatch.Patcher, got {self.patcher!r}.")
        if self.unexpected_keys not in ("warn", "error", "ignore"):
            raise ValueError(f"unexpected_keys must be 'warn', 'error' or 'ignore', got {self.unexpected_keys!r}.")
        _check_patterns(self.new_parameters)
        if not all(isinstance(mode, LoadMode) for mode in self.load_modes):
            raise TypeError(f"load_modes must be a list of modelpatch LoadMode instances, got {self.load_modes!r}.")
        # Frozen: a list the caller changes later must not change the options.
        object.__setattr__(self, "new_parameters", tuple(self.new_parameters))
        object.__setattr__(self, "load_modes", tuple(self.load_modes))

    @classmethod
    def keywords(cls) -> frozenset[str]:
        """The keyword names :meth:`from_keywords` takes besides config overrides (those of ``from_pretrained``)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {
            "hub",
            "distributed",
            "unsharded_tp_plan",
            "config_overrides",
        }
        return frozenset({*fields, *_HUB_KEYWORDS, *_DISTRIBUTED_KEYWORDS, "torch_dtype"})

    @classmethod
    def from_keywords(cls, **keywords: Any) -> LoadOptions:
        """The options of ``from_pretrained(model_class, path, **keywords)``, every keyword checked here.

        Each keyword means what the attribute of its name (or the one it makes up: ``hub``, ``distributed``) says;
        keywords that are none of :meth:`keywords` are config overrides.

        Raises:
            ValueError, TypeError: A bad value or combination, naming the keyword; nothing was read.
        """
        known = {name: keywords.pop(name) for name in cls.keywords() & keywords.keys()}
        overrides = config_overrides(keywords)
        dtype = _dtype_argument(known.pop("dtype", None), known.pop("torch_dtype", None))
        if known.get("use_safetensors") is False:
            raise ValueError(
                "use_safetensors=False is not supported: modelpatch reads safetensors whenever a checkpoint has them; "
                "allow_pickle=True reads checkpoints that have only pytorch_model.bin."
            )
        hub = HubOptions(**{name: known.pop(name) for name in _HUB_KEYWORDS if name in known})
        device, device_map = _placement(known.pop("device", None), known.pop("device_map", None))
        distributed, unsharded_tp_plan = distributed_config_of(
            *(known.pop(name, None) for name in _DISTRIBUTED_KEYWORDS)
        )
        if distributed is not None and (device is not None or device_map is not None):
            raise ValueError(
                "A sharded load (tensor parallelism, FSDP2) places each rank's shards on its own device: pass no "
                "device or device_map."
            )
        if device_map is not None and (one_device := single_device(device_map)) is not None:
            device, device_map = one_device, None
        return cls(
            dtype=dtype,
            hub=hub,
            device=_torch_device(device),
            device_map=device_map,
            distributed=distributed,
            unsharded_tp_plan=unsharded_tp_plan,
            config_overrides=overrides,
            **known,
        )

    def open_checkpoint(self, directory: Path, read: Callable[[], _Read]) -> tuple[Checkpoint, _Read]:
        """The checkpoint in ``directory``, opened with these options' file permissions (headers validated), and what
        ``read()`` made of the other files of the same saved version (:meth:`Checkpoint.open_with`)."""
        return Checkpoint.open_with(
            directory, read, allow_pickle=self.allow_pickle, allow_external_symlinks=self.allow_external_symlinks
        )


def _placement(device: Any, device_map: Any) -> tuple[Any, Any]:
    if device is not None and device_map is not None:
        raise ValueError("Pass either device or device_map, not both.")
    return device, device_map


def _torch_device(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except RuntimeError as exc:  # torch's error for an unknown device string
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None


def _dtype_argument(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """``dtype``, or transformers' deprecated alias ``torch_dtype`` when ``dtype`` is not given (as in stock)."""
    if torch_dtype is None:
        return dtype
    _warn_torch_dtype_deprecated()
    return dtype if dtype is not None else torch_dtype


@functools.cache
def _warn_torch_dtype_deprecated() -> None:
    logger.warning("`torch_dtype` is deprecated! Use `dtype` instead!")  # transformers' own wording, once


def _check_patterns(new_parameters: Sequence[str]) -> None:
    # A bare string would be taken letter by letter: every parameter containing an "e" would be allowed to be new.
    if isinstance(new_parameters, str) or not all(isinstance(p, str) for p in new_parameters):
        raise TypeError(f"new_parameters must be a list of regex patterns, got {new_parameters!r}.")
    for pattern in new_parameters:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"new_parameters entry {pattern!r} is not a valid regular expression: {exc}.") from None
