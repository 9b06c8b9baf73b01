"""``load_sharded``: fill a model the caller sharded (FSDP2 ``fully_shard``, ``DTensor`` parameters) from a
checkpoint, each rank reading only its own shards, through the fully sharded load mode (``modes/fsdp.py``)."""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import PreTrainedModel

from ..modes.distributed import current_rank
from ..modes.fsdp import FullyShardedLoad
from ..state import stored_fusion_config
from .load import execute_plan, plan_pretrained

logger = logging.getLogger(__name__)


# from_pretrained's keywords that place tensors: a sharded model has placed them already.
_PLACING_KEYWORDS = frozenset(
    {
        "dtype",
        "torch_dtype",
        "device",
        "device_map",
        "max_memory",
        "offload_folder",
        "offload_buffers",
        "tp_plan",
        "tp_size",
        "distributed_config",
        "quantization_config",
        "load_modes",
    }
)


def load_sharded(model: PreTrainedModel, path: str | os.PathLike[str], **keywords: Any) -> PreTrainedModel:
    """Fill ``model``, whose parameters are already sharded (FSDP2 ``fully_shard``, DTensors), from the checkpoint at
    ``path``: each rank reads and keeps only its own shard of every parameter, with the load's conversions applied.

    Call it on every rank, after sharding and materialising the model::

        with torch.device("meta"):
            model = modelpatch.from_config(AutoModelForCausalLM, config, fusion_config={"qkv": True})
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        modelpatch.load_sharded(model, "path/or/org/name")

    The load is planned exactly as :func:`modelpatch.from_pretrained` plans it (the model's fusion config, recorded in
    its config by :func:`modelpatch.from_config`, unless ``fusion_config`` is given; the model's dtype), from the
    safetensors headers alone, and must give the sharded model's keys and full shapes. A rank's parameter sharded
    along dim 0 reads only its rows: a view of the memory-mapped file for a tensor read unchanged, the matching rows
    of the ``q``/``k``/``v`` (``gate``/``up``) sources of a fused projection, the experts it holds of stacked experts;
    other conversions run on the whole group, of which the rank keeps its shard. The model's non-persistent buffers
    (rotary ``inv_freq``) are recomputed, and the load is recorded on the model (what
    :func:`modelpatch.save_pretrained` reverses).

    ``keywords`` are :func:`modelpatch.from_pretrained`'s that plan a load (``patcher``, ``fusion_config``,
    ``new_parameters``, ``unexpected_keys``, the hub and file options: ``revision``, ``subfolder``, ``cache_dir``,
    ``token``, ``local_files_only``, ``allow_external_symlinks``, ...), with their meanings. Those that place tensors
    (``dtype``, ``device``, ``device_map``, ``tp_plan``, ``quantization_config``, ...) are refused: the sharded model
    already decides where its shards live and in which dtype.

    Returns:
        ``model``, filled.

    Raises:
        ShardedLoadError: The checkpoint does not plan into the sharded model (every differing key is named).
        LoadPlanError: The checkpoint does not match the model class (as ``from_pretrained`` raises it).
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}.")
    if placing := sorted(keywords.keys() & _PLACING_KEYWORDS):
        raise TypeError(
            f"load_sharded() got {', '.join(placing)}: the sharded model already decides where each rank's shards "
            "live and in which dtype; shard (and cast) the model before loading."
        )
    keywords.setdefault("unexpected_keys", "warn")  # as from_pretrained (plan_pretrained's default is "ignore")
    if keywords.get("fusion_config") is None:
        keywords["fusion_config"] = stored_fusion_config(model.config)
    mode = FullyShardedLoad(model)
    plan = plan_pretrained(type(model), path, **keywords, dtype=model.dtype, load_modes=[mode])
    # The loader's execute stage, into the sharded model: the mode's hooks read and place each rank's part.
    execute_plan(plan, model)
    logger.info("Loaded the shards of rank %d of %s from %s", current_rank(), type(model).__name__, plan.directory)
    return mode.finish(model)
