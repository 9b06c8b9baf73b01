"""``save_pretrained``: write a model back in its checkpoint's layout (default) or in its runtime layout.

A save runs the stages of ``stages.py`` (checks, writer, plan, per-tensor transform, write), with the hooks of
the modes the model was loaded with (its record's ``load_modes``) and, last, the save's own mode for ``DTensor``
parameters (``sharded.ShardedTensors``):

1. check that the model can still be saved as built: a module substituted since (a quantizer's module, a tensor
   subclass such as torchao's, a PEFT wrapper) whose state modelpatch cannot reverse is named, and nothing is written;
2. plan which runtime tensors become which checkpoint keys, from their full shapes: tied parameters that still share
   their storage and that the source checkpoint did not store are dropped; in the original format, every key read
   unchanged is written under its checkpoint name, every converted group is run through its exact reverse
   (operations bound to the source's shapes at load time), keys the load never saw (a model built with
   ``from_config``, a new task head) are mapped back by running the model type's transforms backwards. Runtime
   format: the state dict as is, and config.json records that it needs no conversion;
3. each tensor on its way out through the modes (a shard gathered, a weight offloaded to disk read back);
4. config.json (with modelpatch's versioned record: the fusion config, the layout; see ``state.py``) and
   generation_config.json are written with the tensors into a temporary sibling directory that replaces the target
   only when complete (or, for a sharded model, by every rank into files rank 0 pre-sized).

The models modelpatch builds also get an instance-level ``save_pretrained`` (installed by
:func:`~modelpatch.boundary.state_dict.install_state_dict_boundary`, with ``load_state_dict``)
so that stock code paths — ``model.save_pretrained``, ``Trainer.save_model`` — write the original layout too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from .._transformers import has_transformers_adapter
from ..checkpoint.writer import entry_files, remove_replaced_versions
from ..loading.placement import is_fully_sharded_config
from ..loading.record import model_record
from ..modes.distributed import is_fully_sharded
from ..state import stored_fusion_config
from .agreement import in_process_group, lone_save
from .compressed import refuse_runtime_layout, refuse_without_quantization_config
from .contents import config_files, reject_wrapped, untied_pairs
from .plan import SaveMode, SavePlan
from .sharded import STOCK_SAVE, ShardedTensors, agree
from .stages import plan_model_save, save_writer


@contextmanager
def _writing_given_tensors(model: PreTrainedModel) -> Iterator[None]:
    """Stock ``save_pretrained`` writing the state dict it is given, of a model loaded with FSDP2 / HSDP through
    ``distributed_config``.

    For such a model (``config.distributed_config`` asking for a data-parallel mesh) stock ignores the state dict it
    is given and gathers the model's own, in the runtime layout: a fused model's tensors under fused names. The
    original-layout tensors handed to it are whole on every rank already, so the config is hidden from it for the
    call (rank 0 writes them, as it does any save in a process group), and the ranks then wait for rank 0's write, as
    stock makes them wait after its own gathered write.
    """
    config = model.config
    distributed = getattr(config, "distributed_config", None)
    if distributed is None or not is_fully_sharded_config(distributed):
        yield
        return
    config.distributed_config = None
    try:
        yield
    finally:
        config.distributed_config = distributed
    dist.barrier()


def save_pretrained(
    model: PreTrainedModel,
    path: str | Path,
    *,
    save_original_format: bool = True,
    max_shard_size: int | str = "50GB",
) -> list[Path]:
    """Save ``model`` atomically into directory ``path``.

    Args:
        model: A transformers model, typically loaded with :func:`modelpatch.from_pretrained`.
        path: Target directory; written next to it and swapped in only when complete, so a failure or a kill
            mid-save leaves the previous checkpoint intact. Unrelated files already there (tokenizer, ...) are kept.
        save_original_format: Reverse every conversion applied at load, so the files hold exactly the source
            checkpoint's keys, shapes, dtypes and values. False writes the runtime layout and records in config.json
            that a later :func:`modelpatch.from_pretrained` must load it without conversions.
        max_shard_size: Shard above this size (``"5GB"`` or bytes), like transformers.

    Returns:
        The files written.

    Called on every rank of a model with ``DTensor`` parameters (FSDP2's ``fully_shard``, tensor parallelism), it is a
    collective save (``sharded.py``): each rank writes its own rows of the original layout; the files are those
    of the same model saved unsharded.

    A model loaded with a quantizer (torchao) is written as stock writes it: the quantizer's flattened tensors and
    their safetensors metadata, with the ``quantization_config``; a fused torchao layer is cut back into its parts by
    rows where that is exact (``modes/quantized_save.py``). What cannot be written so that stock loads it (a split
    that is not exact, torchao experts stock would stack, other methods' fused tensors, weights dequantized at load)
    is refused by name in the original layout.

    Raises:
        SaveError: A module was substituted since the model was built (a quantizer's module, a quantized tensor
            subclass, PEFT layers) and its state cannot be written so that it loads back the same; nothing is written.
    """
    if not isinstance(model, torch.nn.Module):
        reject_wrapped(model)  # a TypeError naming what it is
    modes = save_modes(model)
    # Chosen before anything is refused, so that every rank of a collective save refuses together.
    writer = save_writer(model, modes)

    def plan() -> SavePlan:
        reject_wrapped(model)  # a PEFT model or injected adapters: said as such, sharded or not
        refuse_without_quantization_config(model)
        return plan_model_save(model, modes, original_format=save_original_format, writer=writer)

    return writer.write(path, plan, max_shard_size)


def save_modes(model: PreTrainedModel) -> tuple[SaveMode, ...]:
    """The modes whose hooks a save of ``model`` calls: those it was loaded with (its record's ``load_modes``), in
    load order, then the save's own for ``DTensor`` parameters."""
    record = model_record(model)
    return (*(() if record is None else record.load_modes), ShardedTensors())


def planned_save(
    model: PreTrainedModel, *, original_format: bool = True, state_dict: Mapping[str, Any] | None = None
) -> SavePlan:
    """The plan of a save of ``model`` (stages 1–3 of ``stages.py``), for a caller that takes its tensors (a
    stream, stock ``save_pretrained``, torch's distributed checkpoint) instead of writing them.

    Raises:
        SaveError: As :func:`save_pretrained`, naming every module or tensor at fault.
    """
    reject_wrapped(model)
    return plan_model_save(model, save_modes(model), original_format=original_format, state_dict=state_dict)


def original_format_save(model: PreTrainedModel, save_directory: str | Path, *args: Any, **kwargs: Any) -> Any:
    """``model.save_pretrained`` of a model modelpatch built: stock transformers' method, fed the original layout.

    Stock ``save_pretrained`` (and so ``Trainer.save_model`` and ``push_to_hub``) would write the fused/runtime
    tensors under a config stock transformers cannot load them with. Bound to one model as an instance attribute
    (transformers' classes are untouched; a real bound method, so that a tool wrapping it can call its ``__func__``
    rebound to the model), it converts the state dict back with modelpatch's exact reverses, then lets stock
    transformers write it (its sharding, hub upload, tokenizer-free config handling). Adapter-only saves of
    transformers' own PEFT integration are passed through unchanged.
    """
    return OriginalFormatSave(model)(save_directory, *args, **kwargs)


class OriginalFormatSave:
    """What :func:`original_format_save` runs, for one model."""

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def __call__(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if has_transformers_adapter(model):
            return type(model).save_pretrained(model, save_directory, *args, **kwargs)
        if not kwargs.get("save_original_format", True):
            refuse_runtime_layout(model, fused=stored_fusion_config(model.config) is not None)
            result = self._stock_save(save_directory, args, kwargs)
            if kwargs.get("is_main_process", True):  # stock's config.json, marked as modelpatch's runtime saves are
                config_json = config_files(model, original_format=False)["config.json"]
                (Path(save_directory) / "config.json").write_bytes(config_json)
            return result
        plan = self._original_plan(save_directory, kwargs.get("state_dict"))
        kwargs["state_dict"] = plan.tensors()
        kwargs["save_original_format"] = False  # already in the original layout: stock must not convert again
        tie = getattr(model.config, "tie_word_embeddings", None)
        if untied_pairs(model, model.state_dict()) and tie:
            model.config.tie_word_embeddings = False
        try:
            with _quantizer_writes(model, plan, kwargs["state_dict"]), _writing_given_tensors(model):
                return self._stock_save(save_directory, args, kwargs)
        finally:
            if tie is not None:
                model.config.tie_word_embeddings = tie

    def _original_plan(self, save_directory: str | Path, state_dict: Mapping[str, Any] | None) -> SavePlan:
        """The plan of the original-layout tensors stock writes. For a sharded model, gathering them is collective:
        the ranks first agree that each runs this save (``sharded.agree``: a rank refusing, running another save or
        none is named at once, or within the join timeout), so that none waits in a gather the others never enter."""
        if not (in_process_group() and is_fully_sharded(self.model)):
            lone_save(Path(save_directory), "model.save_pretrained")
            return planned_save(self.model, state_dict=state_dict)
        plan, failure = None, None
        try:
            plan = planned_save(self.model, state_dict=state_dict)
        except Exception as exc:  # refused on every rank together
            failure = exc
        agree(Path(save_directory).absolute(), STOCK_SAVE, [], failure)
        assert plan is not None  # agree raised the failure
        return plan

    def _stock_save(self, save_directory: str | Path, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Stock ``save_pretrained``, then the previous version it left beside its own removed.

        Stock writes in place, and leaves a previous checkpoint of the other layout (a ``model.safetensors`` beside
        its new index, an index beside its new ``model.safetensors``): the directory is left holding one version, as
        a modelpatch save leaves it (``writer.remove_replaced_versions``).
        """
        writes = kwargs.get("is_main_process", True)
        before = entry_files(save_directory) if writes else {}
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        if writes:
            remove_replaced_versions(save_directory, before)
        return result


@contextmanager
def _quantizer_writes(model: PreTrainedModel, plan: SavePlan, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, the serialisation stock ``save_pretrained`` asks ``model``'s quantizer for is ``plan``'s.

    Stock replaces the state dict it is given by ``hf_quantizer.get_state_dict_and_metadata(model)`` (the quantizer's
    flattening of the model's own, runtime-layout state): for a fused torchao model it would write ``qkv_proj`` under
    a config stock loads as ``q_proj`` / ``k_proj`` / ``v_proj``. Where the plan is a quantizer's serialisation, the
    quantizer answers with it (the original layout, ``tensors``, and its metadata), on this one instance, until the
    block ends.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if plan.serialised is None or quantizer is None:
        yield
        return
    metadata = dict(plan.metadata or {})
    quantizer.get_state_dict_and_metadata = lambda _model: (tensors, dict(metadata))
    try:
        yield
    finally:
        del quantizer.get_state_dict_and_metadata
