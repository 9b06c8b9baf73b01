"""Execute a validated load plan: put checkpoint data into a meta-device model.

Tensors that need no conversion are memory-mapped views of the checkpoint (zero-copy) whenever their dtype and
device already match; so is a group that only concatenates along dim 0 tensors the file holds back to back (a fused
``gate_up`` from a ``save_pretrained`` file). Other converted groups are materialised one at a time, so peak memory
stays near the model's size plus its largest group: once a group (or a cast tensor) is materialised, the file pages
its sources were read from are released, or they would stay resident in the mapping and count towards the process's
memory.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Container, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .._transformers import mark_initialized
from ..checkpoint.pages import in_file_mapping, release_pages
from ..conversion.planner import ConversionGroup, ConversionPlan
from ..modes.base import LoadMode, TensorSource
from .plan import LoadPlan

# Below this many bytes a load is quick enough that a progress bar is noise.
PROGRESS_BAR_MIN_BYTES = 256 * 1024 * 1024


def set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``key`` of ``model`` by ``value``, keeping its kind and ``requires_grad``."""
    module_name, _, name = key.rpartition(".")
    _set_on(model.get_submodule(module_name), name, key, value)


def _set_on(module: nn.Module, name: str, key: str, value: torch.Tensor) -> None:
    """:func:`set_tensor` on the module owning ``key`` (``name``: the tensor's attribute there)."""
    if name in module._parameters:
        old = module._parameters[name]
        param = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else value.is_floating_point())
        mark_initialized(param)
        module._parameters[name] = param
    elif name in module._buffers:
        mark_initialized(value)
        module._buffers[name] = value
    else:
        raise KeyError(f"{key} is neither a parameter nor a buffer of the model.")


def _find_malloc_trim() -> Callable[[], object] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


_malloc_trim = _find_malloc_trim()


def return_freed_memory() -> None:
    """Give the memory of freed tensors back to the operating system now (glibc keeps freed heap chunks otherwise).

    Restructuring a live model frees each module's old tensors right after allocating the new ones; their chunks,
    of other sizes than the next module's, would not be reused, and resident memory would grow by every converted
    group instead of one. A no-op where the C library has no ``malloc_trim``.
    """
    if _malloc_trim is not None:
        _malloc_trim()


def _placed(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.device == device else tensor.to(device)


def load_into_model(
    model: nn.Module,
    plan: LoadPlan,
    source: TensorSource,
    device: torch.device,
    total_bytes: int,
    modes: Sequence[LoadMode] = (),
) -> None:
    """Fill every planned parameter of ``model`` from ``source.fetch(checkpoint_key)``.

    Where ``source.file_mapped(key)`` says ``fetch(key)`` is a view of a private file mapping, :func:`release_pages`
    drops its pages once the tensor has been copied or converted. Each converted group runs through the last of
    ``modes`` whose :meth:`~LoadMode.run_group` takes it, and each tensor lands through the last whose
    :meth:`~LoadMode.place` takes it; by default a group runs whole (or, when it only concatenates tensors along dim
    0 that lie back to back in one file, is that view of the file: :attr:`TensorSource.joined`) and a tensor is cast
    to its planned dtype, moved to ``device`` and set on ``model``.
    """
    expected = plan.expected
    # One walk of the module tree instead of a path lookup per tensor (every name: a module shared under two names
    # owns the keys of both).
    modules = dict(model.named_modules(remove_duplicate=False))

    latest_first = list(reversed(modes))

    def place(runtime_key: str, value: torch.Tensor) -> bool:
        """Put ``value`` on the model; whether it was copied (not kept as it is, e.g. as a view of the file)."""
        if any(mode.place(runtime_key, value) for mode in latest_first):
            return True
        placed = _placed(value, expected[runtime_key].dtype, device)
        module_name, _, name = runtime_key.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise KeyError(f"{runtime_key} is neither a parameter nor a buffer of the model.")
        _set_on(module, name, runtime_key, placed)
        return placed is not value

    def run_group(group: ConversionGroup, fetch_source: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        for mode in latest_first:
            outputs = mode.run_group(group, fetch_source)
            if outputs is not None:
                return outputs
        view = joined(group)
        return group.run(fetch_source) if view is None else view

    def joined(group: ConversionGroup) -> dict[str, torch.Tensor] | None:
        """The one target of ``group`` as a view of the file, when the group only concatenates along dim 0 tensors
        that the file holds back to back in that order."""
        rows = group.concatenated_rows()
        flat = None if rows is None else source.joined(rows)
        if flat is None:
            return None
        (target,) = group.target_keys()
        (shape,) = group.target_shapes
        return {target: flat.view(shape)}  # type: ignore[arg-type]  # concatenated_rows: one tensor target

    with tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="Loading weights",
        disable=total_bytes < PROGRESS_BAR_MIN_BYTES,
        leave=False,
    ) as progress:
        fill(plan.conversion, source, place, run_group=run_group, wanted=expected, progress=progress.update)


def fill(
    conversion: ConversionPlan,
    source: TensorSource,
    place: Callable[[str, torch.Tensor], bool],
    *,
    run_group: Callable[
        [ConversionGroup, Callable[[str], torch.Tensor]], dict[str, torch.Tensor]
    ] = ConversionGroup.run,
    wanted: Container[str] | None = None,
    progress: Callable[[int], object] = lambda size: None,
) -> None:
    """The fill stage: put every output of ``conversion`` that is ``wanted`` (default: all) on a model, through
    ``place(key, tensor)``.

    A direct tensor is ``source.fetch(source_key)``; a converted group is ``run_group(group, fetch)`` (default: run
    whole) on the tensors it reads from ``source``, one group at a time, its outputs made contiguous. ``place`` says
    whether it copied what it was given: then the file pages that tensor was read from are released (where
    ``source.file_mapped`` says it is a view of a private file mapping), as are a group's sources once it ran.
    ``progress`` is told the bytes of each tensor placed. A load fills its meta model from a checkpoint
    (:func:`load_into_model`); a restructuring fills each new module from the live model's tensors
    (:mod:`modelpatch.restructuring.restructure`).
    """
    for runtime_key, source_key in conversion.direct.items():
        if wanted is not None and runtime_key not in wanted:
            continue
        tensor = source.fetch(source_key)
        if place(runtime_key, tensor) and source.file_mapped(source_key):
            release_pages(tensor)
        progress(tensor.numel() * tensor.element_size())
    for group in conversion.groups:
        sources: list[torch.Tensor] = []

        def fetch_source(key: str) -> torch.Tensor:
            tensor = source.fetch(key)
            if source.file_mapped(key):
                sources.append(tensor)  # noqa: B023 - called only within this iteration, by run_group
            return tensor

        outputs = run_group(group, fetch_source)
        for runtime_key, tensor in outputs.items():
            wanted_here = wanted is None or runtime_key in wanted
            if wanted_here and place(runtime_key, tensor.contiguous()) and in_file_mapping(tensor):
                release_pages(tensor)  # a view of the file (joined), copied: as a direct tensor
            progress(tensor.numel() * tensor.element_size())
        del outputs
        for tensor in sources:
            release_pages(tensor)
