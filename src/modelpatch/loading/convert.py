"""Offline conversion of a checkpoint directory into another layout, streamed one tensor at a time.

A conversion needs neither the model's tensors nor its forward. The load plan (from safetensors headers: exactly what
a load would do) says where each of the model's tensors comes from, and the save plan
(:func:`~modelpatch.loading.save.checkpoint_layout`) where each written tensor comes from. The writer asks for the
tensors of each output file in file order; each is computed from memory-mapped source tensors when its turn comes,
written, and the pages of its sources released. Memory holds one converted group (one layer's q/k/v, say) and
those of its outputs not written yet, never a shard or the model.

The files are those a load followed by :func:`~modelpatch.loading.save.save_pretrained` writes, byte for byte.
What only a loaded model can give is converted that way, with the reason logged: a quantized checkpoint (its
quantizer serialises the model) and parameters the checkpoint does not fill (transformers initialises them at load).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from ..checkpoint import Checkpoint
from ..checkpoint.writer import stream_checkpoint
from ..conversion.planner import ConversionGroup, ConversionPlan, TensorMeta
from ..patching.patcher import Patcher
from . import materialize
from .config import load_config
from .diagnose import collapse_indices
from .load import _load_generation_config, _plan, from_pretrained
from .materialize import _placed, release_pages
from .options import FusionConfig, LoadOptions
from .plan import LoadPlan
from .report import LoadReport
from .save import checkpoint_layout, config_files, save_pretrained

logger = logging.getLogger(__name__)

Fetch = Callable[[str], torch.Tensor]


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
        self, destination: str | Path, *, runtime_format: bool = False, max_shard_size: int | str = "50GB"
    ) -> list[Path]:
        """Write the converted checkpoint into ``destination`` (atomically, like a save) and return its files.

        ``runtime_format`` writes the layout the model holds (its fusions applied, config.json marked so that later
        loads skip conversion); otherwise the original layout, every conversion reversed exactly.
        """
        reason = self._not_streamable()
        if reason is not None:
            logger.info("%s: converting through a loaded model: %s", self.plan.directory, reason)
            return save_pretrained(
                self._reload(), destination, save_original_format=not runtime_format, max_shard_size=max_shard_size
            )
        model = self.plan.model
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

    def _not_streamable(self) -> str | None:
        """Why this conversion needs the loaded model (None when streaming it writes the same files)."""
        plan = self.plan
        if plan.quantization is not None:
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
        # File-mapped source views read since their pages were last released, by storage: an output sharing one is
        # a view of the mapping too (a chunk of a fused tensor, say), whose pages can be released once written.
        self._mapped: dict[int, torch.Tensor] = {}
        kept = sorted(set(plan.loaded_keys()) - _left_out(plan))

        def meta_of(key: str) -> torch.Tensor:
            info = checkpoint.info(key)
            return torch.empty(info.shape, dtype=info.dtype, device="meta")

        runtime = self._loaded(kept, meta_of)
        if runtime_format:
            self._save = ConversionPlan(direct={key: key for key in kept})
        else:
            metas = {key: TensorMeta(tuple(t.shape), t.dtype) for key, t in runtime.items()}
            self._save = checkpoint_layout(LoadReport.from_plan(plan), plan.transforms, metas)
        self._save_groups = {key: group for group in self._save.groups for key in group.target_keys()}
        self._written_as: dict[str, list[str]] = {}
        for output, key in self._save.direct.items():
            self._written_as.setdefault(key, []).append(output)
        self.layout: dict[str, torch.Tensor] = {}
        for output in [*self._save.direct, *self._save_groups]:
            if output not in self.layout:
                self.layout.update(self._compute(output, set(self._save.direct) | set(self._save_groups), meta_of))
        self.total_bytes = sum(t.numel() * t.element_size() for t in self.layout.values())

    def produce(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of ``keys`` in turn (a :data:`~modelpatch.checkpoint.writer.TensorStream`): outputs of one group
        that come later in ``keys`` wait until then; the source pages read are released once a tensor is written."""
        pending: dict[str, torch.Tensor] = {}
        remaining = set(keys)
        for key in keys:
            if key not in pending:
                pending.update(self._compute(key, remaining, self._read))
            remaining.discard(key)
            tensor = pending.pop(key)
            yield key, tensor
            if tensor.untyped_storage().data_ptr() in self._mapped:  # written straight from the file's mapping
                release_pages(tensor)
            if not pending:  # the sources of the outputs written: nothing waiting reads them any more
                self._release()
        # A file rewritten in place while it was being read may have given data of two versions.
        self._checkpoint.check_unchanged()

    def _read(self, key: str) -> torch.Tensor:
        tensor = self._checkpoint.tensor(key)
        if self._checkpoint.info(key).start >= 0:  # a view of the file's private mapping: its pages can be dropped
            self._mapped[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    def _release(self) -> None:
        for tensor in self._mapped.values():
            release_pages(tensor)
        self._mapped.clear()

    def _compute(self, output: str, wanted: set[str], fetch: Fetch) -> dict[str, torch.Tensor]:
        """Output ``output`` and the others its computation gives that are in ``wanted``."""
        group = self._save_groups.get(output)
        if group is not None:
            loaded = self._loaded(group.source_keys(), fetch)
            return {k: t.contiguous() for k, t in group.run(loaded.__getitem__).items() if k in wanted}
        key = self._save.direct[output]
        siblings = self._groups[key].target_keys() if key in self._groups else [key]
        loaded = self._loaded([k for k in siblings if any(o in wanted for o in self._written_as.get(k, ()))], fetch)
        return {o: tensor for k, tensor in loaded.items() for o in self._written_as[k] if o in wanted}

    def _loaded(self, keys: Iterable[str], fetch: Fetch) -> dict[str, torch.Tensor]:
        """The model's tensors ``keys`` as a load puts them into it (see materialize.load_into_model)."""
        out: dict[str, torch.Tensor] = {}
        wanted = set(keys)
        for key in wanted:
            if key in out:
                continue
            if key in self._direct:
                tensor = fetch(self._direct[key])
                out[key] = _placed(tensor, self._dtypes[key], tensor.device)
                continue
            group: ConversionGroup = self._groups[key]
            for target, tensor in group.run(fetch).items():
                if target in wanted:
                    out[target] = _placed(tensor.contiguous(), self._dtypes[target], tensor.device)
        return out


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
    options = LoadOptions(
        patcher=patcher, fusion_config=fusion_config, dtype=dtype, unexpected_keys="error", allow_pickle=allow_pickle
    )
    directory = Path(source)
    config = load_config(directory)
    generation = _load_generation_config(directory)
    with options.open_checkpoint(directory) as checkpoint:
        plan = _plan(model_class, source, config, checkpoint, options)

        def reload() -> PreTrainedModel:
            return from_pretrained(
                model_class,
                source,
                patcher=patcher,
                fusion_config=fusion_config,
                unexpected_keys="error",
                dtype=dtype,
                allow_pickle=allow_pickle,
            )

        yield Conversion(plan, checkpoint, reload, generation)
