"""Offline conversion of a checkpoint directory into another layout, streamed one tensor at a time.

A conversion needs neither the model's tensors nor its forward. The load plan (from safetensors headers: exactly what
a load would do) says where each of the model's tensors comes from, and the save plan
(:func:`~modelpatch.saving.save.checkpoint_layout`) where each written tensor comes from. The writer asks for the
tensors of each output file in file order; each is computed from memory-mapped source tensors when its turn comes,
written, and the pages of its sources released. Memory holds one converted group (one layer's q/k/v, say) and
those of its outputs not written yet, never a shard or the model. A tensor whose bytes are source bytes unchanged
(read as is, a row range of one, or several concatenated along dim 0: a fused ``qkv_proj``) is not computed at all:
the writer copies those byte ranges file to file, as ``cp`` does.

The files are those a load followed by :func:`~modelpatch.saving.save.save_pretrained` writes, byte for byte.
What only a loaded model can give is converted that way, with the reason logged: a quantized checkpoint (its
quantizer serialises the model) and parameters the checkpoint does not fill (transformers initialises them at load).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from ..checkpoint import Checkpoint
from ..checkpoint.file_range import FileRange
from ..checkpoint.pages import release_pages
from ..checkpoint.writer import Streamed, stream_checkpoint
from ..conversion.planner import ConversionGroup, ConversionPlan, TensorMeta
from ..fusions.apply import normalize_fusion_config
from ..loading import materialize
from ..loading.diagnose import collapse_indices
from ..loading.load import load_with_options, open_plan
from ..loading.materialize import _placed
from ..loading.options import FusionConfig, LoadOptions
from ..loading.plan import LoadPlan
from ..loading.report import LoadReport
from ..patching.patcher import Patcher
from ..state import record_fusion_config
from .contents import checkpoint_layout, config_files
from .save import save_pretrained

logger = logging.getLogger(__name__)

Fetch = Callable[[str], torch.Tensor]


class _Rows:
    """A converted tensor left uncomputed: file-mapped source tensors concatenated along dim 0, which is their bytes one
    after the other. Written by copying those bytes; computed (:func:`_tensor`) only where an operation reads it."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts


def _tensor(value: torch.Tensor | _Rows) -> torch.Tensor:
    return torch.cat(value.parts) if isinstance(value, _Rows) else value


class Conversion:
    """A conversion of one checkpoint planned from its headers; :meth:`write` reads the tensors and writes them.

    Obtained from :func:`plan_conversion`, which keeps the source open while it is in use.
    """

    def __init__(
        self,
        plan: LoadPlan,
        checkpoint: Checkpoint,
        reload: Callable[[], PreTrainedModel],
        generation: GenerationConfig | None,
    ) -> None:
        self.plan = plan
        self._checkpoint = checkpoint
        self._reload = reload
        if generation is not None and plan.model.can_generate():
            plan.model.generation_config = generation
        plan.fusions.record(plan.model)  # the fusion config a load records, which config.json stores

    @property
    def ignored(self) -> list[str]:
        """Checkpoint keys the model class declares ignorable: a load drops them, and so would the conversion."""
        return list(self.plan.ignored)

    def write(
        self,
        destination: str | Path,
        *,
        runtime_format: bool = False,
        max_shard_size: int | str = "50GB",
        recorded_fusions: FusionConfig | None = None,
    ) -> list[Path]:
        """Write the converted checkpoint into ``destination`` (atomically, like a save) and return its files.

        ``runtime_format`` writes the layout the model holds (its fusions applied, config.json marked so that later
        loads skip conversion); otherwise the original layout, every conversion reversed exactly.

        ``recorded_fusions``: the fusion config that config.json records for later modelpatch loads to apply, instead
        of the fusions the source was planned with (those of them that fuse something: :attr:`unapplied` are left
        out); for the original layout only (``{}`` records none, as a
        runtime-layout source turned back into its original layout needs: its own record would fuse it again). A
        runtime layout records the fusions its tensors are in.

        Raises:
            FusionError: ``recorded_fusions`` is not a valid fusion config (before anything is written).
            ValueError: ``recorded_fusions`` is given with ``runtime_format``.
        """
        record = self._fusions_to_record(recorded_fusions, runtime_format)
        reason = self._not_streamable()
        if reason is not None:
            logger.info("%s: converting through a loaded model: %s", self.plan.directory, reason)
            reloaded = self._reload()
            record_fusion_config(reloaded.config, record)
            return save_pretrained(
                reloaded, destination, save_original_format=not runtime_format, max_shard_size=max_shard_size
            )
        model = self.plan.model
        record_fusion_config(model.config, record)
        state = _Tensors(self.plan, self._checkpoint, runtime_format)
        with tqdm(
            total=state.total_bytes,
            unit="B",
            unit_scale=True,
            desc="Converting weights",
            disable=state.total_bytes < materialize.PROGRESS_BAR_MIN_BYTES,
            leave=False,
        ) as progress:
            files = stream_checkpoint(
                destination,
                state.layout,
                state.produce,
                extra_files=config_files(model, original_format=not runtime_format),
                max_shard_size=max_shard_size,
                written=progress.update,
            )
        logger.info(
            "Converted %d tensors to %s (%s layout)",
            len(state.layout),
            destination,
            "runtime" if runtime_format else "checkpoint",
        )
        return files

    @property
    def unapplied(self) -> list[str]:
        """The enabled fusions of the plan that fuse nothing in this model (``linear_experts`` of a dense model):
        :meth:`write` leaves them out of config.json's record, which says what the checkpoint is fused with."""
        config, fused = self.plan.fusions.config, self.plan.fusions.fused
        return sorted(name for name, value in config.items() if value is not False and name not in fused)

    def _fusions_to_record(self, recorded_fusions: FusionConfig | None, runtime_format: bool) -> dict[str, Any]:
        """The fusion config the written config.json records (see :meth:`write`)."""
        if recorded_fusions is None:
            unapplied = self.unapplied
            return {k: v for k, v in copy.deepcopy(self.plan.fusions.config).items() if k not in unapplied}
        if runtime_format:
            raise ValueError(
                "recorded_fusions applies to the original layout only: a runtime layout records the fusions its "
                "tensors are in."
            )
        return normalize_fusion_config(recorded_fusions)

    def _not_streamable(self) -> str | None:
        """Why this conversion needs the loaded model (None when streaming it writes the same files)."""
        plan = self.plan
        if any(mode.quantizes for mode in plan.modes):
            return "a quantized checkpoint is written by its quantizer"
        loaded = set(plan.loaded_keys())
        left_out = _left_out(plan)
        unfilled = [key for key in plan.expected if key not in loaded and key not in left_out]
        if unfilled:
            return f"the checkpoint does not fill {', '.join(collapse_indices(unfilled))}"
        # A tied parameter converted from other keys is saved only when its values differ from its source's.
        converted_tied = sorted(left_out & loaded)
        if converted_tied:
            return f"tied parameters {', '.join(converted_tied)} are converted from other keys"
        return None


def _left_out(plan: LoadPlan) -> set[str]:
    """Tied parameters a save of the loaded model leaves out (see save._state_to_save): those not read under their
    own name, which share the tensor of their source (always, when the checkpoint does not fill them)."""
    loaded = set(plan.loaded_keys())
    stored = set(plan.checkpoint) | loaded & set(plan.conversion.direct)
    return {target for target, source in plan.tied.items() if target not in stored and source in loaded}


class _Tensors:
    """The converted checkpoint's tensors, computed on demand: the load's step (the load plan, each tensor cast to
    the model's dtype as the load casts it), then the save's (:func:`checkpoint_layout`, or as is for the runtime
    layout).

    Runs on real tensors read from the checkpoint and, once, on meta tensors: that run gives :attr:`layout`, the
    shape and dtype of every output, from the same code that computes the data.
    """

    def __init__(self, plan: LoadPlan, checkpoint: Checkpoint, runtime_format: bool) -> None:
        self._checkpoint = checkpoint
        self._direct = {k: v for k, v in plan.conversion.direct.items() if k in plan.expected}
        self._groups = {key: group for group in plan.conversion.groups for key in group.target_keys()}
        self._dtypes = {key: meta.dtype for key, meta in plan.expected.items()}
        # File-mapped source views (and their checkpoint keys) read since their pages were last released, by storage
        # (one per key): an output sharing one is a view of the mapping too (a chunk of a fused tensor, say), whose
        # bytes lie in the file as they are in memory.
        self._mapped: dict[int, tuple[str, torch.Tensor]] = {}
        kept = sorted(set(plan.loaded_keys()) - _left_out(plan))

        def meta_of(key: str) -> torch.Tensor:
            info = checkpoint.info(key)
            return torch.empty(info.shape, dtype=info.dtype, device="meta")

        runtime = self._loaded(kept, meta_of)
        if runtime_format:
            self._save = ConversionPlan(direct={key: key for key in kept})
        else:
            metas = {key: TensorMeta(tuple(_tensor(t).shape), _tensor(t).dtype) for key, t in runtime.items()}
            self._save = checkpoint_layout(LoadReport.from_plan(plan), plan.transforms, metas)
        self._save_groups = {key: group for group in self._save.groups for key in group.target_keys()}
        self._written_as: dict[str, list[str]] = {}
        for output, key in self._save.direct.items():
            self._written_as.setdefault(key, []).append(output)
        self.layout: dict[str, torch.Tensor] = {}
        for output in [*self._save.direct, *self._save_groups]:
            if output not in self.layout:
                computed = self._compute(output, set(self._save.direct) | set(self._save_groups), meta_of)
                self.layout.update((key, _tensor(value)) for key, value in computed.items())
        self.total_bytes = sum(t.numel() * t.element_size() for t in self.layout.values())

    def produce(self, keys: list[str]) -> Iterator[tuple[str, Streamed]]:
        """Each of ``keys`` in turn (a :data:`~modelpatch.checkpoint.writer.TensorStream`): outputs of one group
        that come later in ``keys`` wait until then; source bytes unchanged are given as file ranges, and the source
        pages read are released once a tensor is written."""
        pending: dict[str, torch.Tensor | _Rows] = {}
        remaining = set(keys)
        for key in keys:
            if key not in pending:
                pending.update(self._compute(key, remaining, self._read))
            remaining.discard(key)
            value = pending.pop(key)
            ranges = self._file_ranges(value)
            if ranges is not None:
                yield key, ranges
            else:
                tensor = _tensor(value)
                yield key, tensor
                if tensor.untyped_storage().data_ptr() in self._mapped:  # written straight from the file's mapping
                    release_pages(tensor)
            if not pending:  # the sources of the outputs written: nothing waiting reads them any more
                self._release()
        # A file rewritten in place while it was being read may have given data of two versions.
        self._checkpoint.check_unchanged()

    def _read(self, key: str) -> torch.Tensor:
        tensor = self._checkpoint.tensor(key)
        if self._checkpoint.info(key).start >= 0 and tensor.numel():
            # A view of the file's private mapping: its pages can be dropped, its bytes copied from the file.
            self._mapped[tensor.untyped_storage().data_ptr()] = (key, tensor)
        return tensor

    def _release(self) -> None:
        for _, tensor in self._mapped.values():
            release_pages(tensor)
        self._mapped.clear()

    def _file_ranges(self, value: torch.Tensor | _Rows) -> list[FileRange] | None:
        """Where the bytes of ``value`` lie in the checkpoint's files, when each of its parts is a contiguous view of
        a source's mapping (operations never write into their inputs, so the mapping still holds the file's bytes)."""
        ranges = []
        for part in value.parts if isinstance(value, _Rows) else [value]:
            origin = self._mapped.get(part.untyped_storage().data_ptr()) if part.device.type == "cpu" else None
            if origin is None or not part.is_contiguous():
                return None
            key, whole = origin
            file_range = self._checkpoint.file_range(key)
            if file_range is None:
                return None
            ranges.append(file_range.narrow(part.data_ptr() - whole.data_ptr(), part.numel() * part.element_size()))
        return ranges

    def _compute(self, output: str, wanted: set[str], fetch: Fetch) -> dict[str, torch.Tensor | _Rows]:
        """Output ``output`` and the others its computation gives that are in ``wanted``."""
        group = self._save_groups.get(output)
        if group is not None:
            loaded = self._loaded(group.source_keys(), fetch)
            outputs = group.run(lambda key: _tensor(loaded[key]))
            return {k: t.contiguous() for k, t in outputs.items() if k in wanted}
        key = self._save.direct[output]
        siblings = self._groups[key].target_keys() if key in self._groups else [key]
        loaded = self._loaded([k for k in siblings if any(o in wanted for o in self._written_as.get(k, ()))], fetch)
        return {o: tensor for k, tensor in loaded.items() for o in self._written_as[k] if o in wanted}

    def _loaded(self, keys: Iterable[str], fetch: Fetch) -> dict[str, torch.Tensor | _Rows]:
        """The model's tensors ``keys`` as a load puts them into it (see materialize.load_into_model); a
        concatenation of file-mapped tensors that the load would not cast is left uncomputed (:class:`_Rows`)."""
        out: dict[str, torch.Tensor | _Rows] = {}
        wanted = set(keys)
        for key in wanted:
            if key in out:
                continue
            if key in self._direct:
                tensor = fetch(self._direct[key])
                out[key] = _placed(tensor, self._dtypes[key], tensor.device)
                continue
            group: ConversionGroup = self._groups[key]
            rows = self._rows(group, fetch)
            if rows is not None:
                out[group.target_keys()[0]] = rows
                continue
            for target, tensor in group.run(fetch).items():
                if target in wanted:
                    out[target] = _placed(tensor.contiguous(), self._dtypes[target], tensor.device)
        return out

    def _rows(self, group: ConversionGroup, fetch: Fetch) -> _Rows | None:
        """``group``'s target left uncomputed, when it concatenates file-mapped tensors along dim 0 unchanged."""
        keys = group.concatenated_rows()
        if keys is None:
            return None
        parts = [fetch(k) for k in keys]
        dtype = self._dtypes[group.target_keys()[0]]
        if any(
            part.untyped_storage().data_ptr() not in self._mapped
            or part.dtype != parts[0].dtype
            or (part.is_floating_point() and part.dtype != dtype)  # the load would cast it
            for part in parts
        ):
            return None
        return _Rows(parts)


@contextmanager
def plan_conversion(
    model_class: type,
    source: str | os.PathLike[str],
    *,
    patcher: Patcher | None = None,
    fusion_config: FusionConfig | None = None,
    dtype: torch.dtype | str | None = None,
    allow_pickle: bool = False,
) -> Iterator[Conversion]:
    """Plan the conversion of checkpoint directory ``source`` as :func:`from_pretrained` with these arguments would
    load it, keeping every tensor (``unexpected_keys="error"``); the source stays open inside the ``with`` block.

    Raises what the load raises before reading any tensor (``LoadPlanError`` naming every key, ...).
    """
    options = LoadOptions.from_keywords(
        patcher=patcher, fusion_config=fusion_config, dtype=dtype, unexpected_keys="error", allow_pickle=allow_pickle
    )
    with open_plan(model_class, source, options) as (plan, checkpoint):
        yield Conversion(
            plan, checkpoint, lambda: load_with_options(model_class, source, options), plan.generation_config
        )
