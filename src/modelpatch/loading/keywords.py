"""The keywords of transformers' ``from_pretrained`` that modelpatch's ``from_pretrained`` does not name.

:func:`modelpatch.from_pretrained` names every keyword it honours. Every other keyword transformers 5.23's
``PreTrainedModel.from_pretrained`` takes is listed here: either accepted because modelpatch always does what it
asks for, or refused with the reason (a refused keyword is still accepted with the value that means what modelpatch
does anyway, e.g. ``ignore_mismatched_sizes=False``). What remains are config overrides, as in transformers
(``output_attentions=True`` sets that attribute of the loaded config), checked against the config once it is read.
The table in docs/loading_and_saving.md mirrors this module.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Accepted with any value: modelpatch always loads lazily (meta-device build, memory-mapped tensors, one converted
# group at a time), which is what these ask for.
NO_OPS: Mapping[str, str] = {
    "low_cpu_mem_usage": "modelpatch always loads lazily",
    "offload_state_dict": "modelpatch always loads lazily (transformers ignores it too)",
}


@dataclass(frozen=True)
class Refusal:
    """Why a keyword is refused, and the values accepted because they mean what modelpatch does anyway."""

    reason: str
    accepted: tuple[object, ...] = (None,)


_KERNELS = "hub kernels are not supported by modelpatch (they replace modules that modelpatch may have restructured)"
_ADAPTERS = (
    "adapters are not loaded by modelpatch.from_pretrained: load the base model, then the adapter with "
    "peft.PeftModel.from_pretrained"
)

REFUSED: Mapping[str, Refusal] = {
    "key_mapping": Refusal(
        "regex key mappings cannot be reversed on save: pass patcher=Patcher(extra_weight_conversions="
        "[WeightRenaming(...)]) instead, which save_pretrained writes back under the original names"
    ),
    "state_dict": Refusal(
        "modelpatch loads from checkpoints: build the model with modelpatch.from_config and call load_state_dict"
    ),
    "gguf_file": Refusal("GGUF files are not read by modelpatch: convert the checkpoint to safetensors first"),
    "variant": Refusal(
        "weight variants (model.<variant>.safetensors) are not supported yet: put the variant's files under the "
        "standard names in a directory of their own"
    ),
    "ignore_mismatched_sizes": Refusal(
        "modelpatch never fills mismatched parameters with random weights: name the parameters to initialise "
        "freshly with new_parameters=[regex, ...]",
        (False,),
    ),
    "weights_only": Refusal("pickle checkpoints are only read with torch.load(weights_only=True)", (True,)),
    "disable_mmap": Refusal("modelpatch always memory-maps safetensors files", (None, False)),
    "proxies": Refusal(
        "huggingface_hub >= 1.0 takes no per-call proxies: set the HTTPS_PROXY / HTTP_PROXY environment variables"
    ),
    "tqdm_class": Refusal("modelpatch's downloads show huggingface_hub's own progress bars"),
    "mirror": Refusal("download mirrors are gone from transformers and huggingface_hub: set HF_ENDPOINT"),
    "from_tf": Refusal("TensorFlow checkpoints are not read (transformers 5 dropped them)", (None, False)),
    "from_flax": Refusal("Flax checkpoints are not read (transformers 5 dropped them)", (None, False)),
    "device_mesh": Refusal(
        "modelpatch makes the tensor-parallel mesh as transformers does: pass tp_plan='auto' (and tp_size) or "
        "distributed_config under torchrun"
    ),
    "use_kernels": Refusal(_KERNELS, (None, False)),
    "kernel_config": Refusal(_KERNELS),
    "allow_all_kernels": Refusal(_KERNELS, (None, False)),
    "adapter_kwargs": Refusal(_ADAPTERS, (None, {})),
    "adapter_name": Refusal(_ADAPTERS, (None, "default")),
}


def config_overrides(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` minus the keywords of the tables above: what is left to override config attributes with.

    Raises:
        ValueError: A refused keyword with a value modelpatch cannot honour; the message says why and what to do.
    """
    overrides = {}
    for name, value in kwargs.items():
        if name in NO_OPS:
            logger.debug("%s=%r accepted, nothing to do: %s", name, value, NO_OPS[name])
        elif name in REFUSED:
            refusal = REFUSED[name]
            if not any(value is ok or (type(value) is type(ok) and value == ok) for ok in refusal.accepted):
                raise ValueError(f"{name}={value!r} is not supported: {refusal.reason}.")
        else:
            overrides[name] = value
    return overrides
