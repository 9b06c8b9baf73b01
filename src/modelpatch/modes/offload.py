"""Disk offload: where the weights of the modules a ``device_map`` puts on ``"disk"`` are read from at every forward.

As in stock transformers, a weight that the load reads unconverted from a safetensors file (the same tensor under its
checkpoint key, renamed at most, and cast to the model's dtype when that differs) is offloaded *in place*: its index
entry names the checkpoint file and the tensor's checkpoint key, and nothing is written. A weight that a conversion
produces (fused, split, permuted, dequantized) or that the checkpoint does not hold (initialised at load, a pickle
checkpoint's) has no such place: it is written to ``offload_folder``, and without one the load is refused before any
tensor data is read, naming every such weight; so is an ``offload_folder`` that is not a directory, lies below a file
or whose permissions forbid writing there (a ``CheckpointError`` naming it).

Every read goes through :class:`~modelpatch.checkpoint.SafetensorsFile`, which compares the file with the identity
(device, inode, size, modification and status-change times) recorded when its header was validated: a file rewritten
in place since fails the read, naming the weight, instead of feeding the model other data. The files stay open as
long as the model, so a checkpoint directory replaced since (a save into it, a hub update) does not change what is
read.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from ..checkpoint import Checkpoint, SafetensorsFile, TensorInfo
from ..checkpoint.writer import require_writable_directory
from ..errors import CheckpointError, SaveError

if TYPE_CHECKING:
    from ..loading.plan import LoadPlan

logger = logging.getLogger(__name__)


def _placement(name: str, device_map: Mapping[str, Any]) -> Any:
    """The device ``device_map`` gives tensor (or module) ``name``: its longest enclosing entry's, as accelerate."""
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        module = ".".join(parts[:end])
        if module in device_map:
            return device_map[module]
    return None


@dataclass(frozen=True)
class _Entry:
    file: SafetensorsFile
    key: str
    dtype: torch.dtype


class OffloadedWeights(Mapping[str, torch.Tensor]):
    """The weights of offloaded modules by runtime name, each read from its file when asked for.

    What accelerate's hooks load before every forward of an offloaded module; ``resident`` holds tensors kept in
    memory instead (the ``"cpu"`` modules, which accelerate offloads too when the model runs on an accelerator).
    """

    def __init__(self, entries: Mapping[str, _Entry], resident: Mapping[str, torch.Tensor]) -> None:
        self._entries = dict(entries)
        self._resident = dict(resident)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._resident:
            return self._resident[name]
        entry = self._entries[name]
        try:
            # A mapping of its own: the hook drops the weight after the forward and none of the file stays resident.
            tensor = entry.file.map_tensor(entry.key)
        except CheckpointError as exc:
            raise CheckpointError(
                f"Offloaded weight {name!r} cannot be read from {entry.file.path} (tensor {entry.key!r}): {exc}"
            ) from None
        # The cast the load would have made (stock records the model's dtype in its index and casts on read too).
        return tensor if tensor.dtype == entry.dtype else tensor.to(entry.dtype)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read the tensor; accelerate asks before every read.
        return name in self._resident or name in self._entries

    def __iter__(self) -> Iterator[str]:
        yield from self._resident
        yield from self._entries

    def __len__(self) -> int:
        return len(self._resident) + len(self._entries)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadedWeights:
        # A copied model reads the same read-only files (an open file mapping cannot be copied anyway).
        return OffloadedWeights(self._entries, copy.deepcopy(self._resident, memo))

    @property
    def index(self) -> dict[str, dict[str, str]]:
        """The offloaded weights in stock transformers' ``disk_offload_index`` form.

        ``{runtime name: {"safetensors_file": path, "weight_name": key in that file, "dtype": "float32"}}``: for a
        weight read in place, the checkpoint's file and the tensor's checkpoint key.
        """
        return {
            name: {
                "safetensors_file": str(entry.file.path),
                "weight_name": entry.key,
                "dtype": str(entry.dtype).removeprefix("torch."),
            }
            for name, entry in self._entries.items()
        }


def meta_tensors(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` whose tensors are on the meta device (they hold no values)."""
    return [key for key, tensor in state.items() if isinstance(tensor, torch.Tensor) and tensor.is_meta]


def unreadable_meta_tensors(model: PreTrainedModel, keys: Sequence[str]) -> SaveError:
    """The refusal of a save of ``model`` whose tensors ``keys`` are on the meta device with nothing to read them
    from."""
    return SaveError(
        f"Cannot save {type(model).__name__}: {len(keys)} tensor(s) are on the meta device with no offloaded copy "
        f"to read them from: {', '.join(keys)}. Nothing was written. Only tensors of modules that "
        "modelpatch.from_pretrained offloaded with its device_map can be read back."
    )


@dataclass
class DiskOffload:
    """How the weights of the ``"disk"`` modules will be read, decided from the load plan before any data is read.

    ``in_place``: runtime name -> the checkpoint tensor read unconverted for it. ``written``: the names written to
    ``folder`` once loaded.
    """

    in_place: dict[str, TensorInfo]
    written: tuple[str, ...]
    folder: Path | None
    _files: dict[Path, SafetensorsFile] = field(default_factory=dict, repr=False)

    @classmethod
    def plan(
        cls,
        model: PreTrainedModel,
        device_map: Mapping[str, Any],
        load_plan: LoadPlan,
        checkpoint: Checkpoint,
        *,
        offload_folder: str | os.PathLike[str] | None,
        offload_buffers: bool,
        in_place: bool = True,
    ) -> DiskOffload:
        """Sort the offloaded weights of ``model`` (meta device) into read in place and to write.

        ``in_place=False`` writes every one (a quantized load, whose tensors the quantizer turns into others).
        Raises ``ValueError`` naming the weights to write when there is no ``offload_folder``.
        """
        parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        # Persistent buffers go with the weights only when asked, as accelerate moves the others to the device.
        names = [
            name
            for name in load_plan.expected
            if _placement(name, device_map) == "disk" and (name in parameters or offload_buffers)
        ]
        sources = {name: _source(name, load_plan, checkpoint) if in_place else None for name in names}
        written = tuple(name for name, source in sources.items() if source is None)
        if written and offload_folder is None:
            raise ValueError(
                f"device_map offloads {len(written)} weight(s) to 'disk' that cannot be read in place from the "
                "checkpoint's safetensors files (a conversion at load produces them, or the checkpoint does not hold "
                f"them as they are): {', '.join(written)}. Pass offload_folder=... to have them written there. "
                "Nothing was loaded."
            )
        if written and offload_folder is not None:
            # Before any tensor is read: a folder that cannot take the weights would fail the load once it was done.
            require_writable_directory(
                Path(offload_folder),
                f"offload_folder: disk offload writes {len(written)} weight(s) there",
                "pass another offload_folder",
            )
        return cls(
            {name: source for name, source in sources.items() if source is not None},
            written,
            None if offload_folder is None else Path(offload_folder),
        )

    def keep_files(self, checkpoint: Checkpoint) -> None:
        """Take over the checkpoint files read in place, before the load closes the checkpoint."""
        self._files = checkpoint.hand_over({info.path for info in self.in_place.values()})

    def weights(self, model: PreTrainedModel, resident: Mapping[str, torch.Tensor]) -> OffloadedWeights:
        """The offloaded weights of the loaded ``model``: the converted ones are written to the folder now."""
        state = model.state_dict(keep_vars=True)
        entries = {
            name: _Entry(self._files[info.path], info.key, state[name].dtype) for name, info in self.in_place.items()
        }
        entries.update(self._write(state))
        logger.info(
            "Offloaded %d weight(s) to disk: %d read in place from the checkpoint, %d written to %s",
            len(entries),
            len(self.in_place),
            len(self.written),
            self.folder,
        )
        return OffloadedWeights(entries, resident)

    def _write(self, state: Mapping[str, torch.Tensor]) -> dict[str, _Entry]:
        if not self.written:
            return {}
        assert self.folder is not None  # plan() refused the load otherwise
        entries = {}
        name = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for name in self.written:
                tensor = state[name].detach().contiguous()
                entries[name] = _Entry(_write_weight(self.folder, name, tensor), name, tensor.dtype)
        except OSError as exc:  # the folder changed since the plan checked it, or the disk is full
            what = f"weight {name!r}" if name is not None else "the folder"
            raise CheckpointError(f"{self.folder}: disk offload cannot write {what} to offload_folder: {exc}") from exc
        return entries


def _write_weight(folder: Path, name: str, tensor: torch.Tensor) -> SafetensorsFile:
    """Write ``tensor`` to ``folder/<name>.safetensors`` (as stock names it) and open that file for reading.

    Written beside and renamed over, so that a model still reading an older file of that name keeps its own; read
    through the descriptor of the file written here, whatever the name points at later.
    """
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.close(handle)
    path = folder / f"{name}.safetensors"
    try:
        save_file({name: tensor}, temporary)
        descriptor = os.open(temporary, os.O_RDONLY)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    try:
        os.replace(temporary, path)
    except BaseException:
        os.close(descriptor)
        Path(temporary).unlink(missing_ok=True)
        raise
    return SafetensorsFile.from_fd(path, descriptor)


def _source(name: str, load_plan: LoadPlan, checkpoint: Checkpoint) -> TensorInfo | None:
    """The safetensors tensor the load reads unconverted for ``name``, or None.

    A tied weight the checkpoint does not store is its partner's tensor (transformers ties it to the one present).
    """
    tied = load_plan.tied
    source = tied.get(name, name)
    partners = sorted({source, *(target for target, of in tied.items() if of == source)} - {name})
    for key in (name, *partners):
        checkpoint_key = load_plan.conversion.direct.get(key)
        if checkpoint_key is not None:
            info = checkpoint.info(checkpoint_key)
            return info if info.start >= 0 else None  # a pickle checkpoint's tensor has no byte range to read
    return None
