"""What a save writes: the checks of the model's state, the checkpoint's original layout it is turned into, and the
config files beside it.

The plan stage of every save (``stages.py``) runs these; the writers (``stages.WholeFiles``,
``sharded.py``) and the state-dict boundary (``boundary/state_dict.py``) take what it planned.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .._transformers import tied_weight_keys
from .._transformers_mapping import model_conversions
from ..conversion.planner import ConversionPlan, TensorMeta, plan_save
from ..conversion.transforms import WeightTransform
from ..errors import ConversionError, SaveError
from ..loading.record import get_load_report, model_record, offloaded_weights
from ..loading.report import LoadReport
from ..modes.distributed import local_part, model_class
from ..state import mark_runtime_layout, record_file_layout, stored_fusion_config
from .compressed import compressed_layout, compressed_modules

logger = logging.getLogger(__name__)


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]


def _kind(dtype: torch.dtype) -> str:
    return "floating" if dtype.is_floating_point else "complex" if dtype.is_complex else "integer"


def _plain(module: nn.Module | None) -> bool:
    """A module of torch's own classes (``nn.Linear``, ``nn.Embedding``): what transformers' own API makes when it
    resizes, adds or unties a layer. A quantizer's or an adapter's module is of another class."""
    return module is not None and type(module).__module__.startswith("torch.nn.modules")


def check_saveable(model: PreTrainedModel, state: Mapping[str, Any], quantized: bool = False) -> None:
    """Refuse, naming every module at fault and the remedy, a state that a save would write wrongly.

    The state is compared with the one recorded when modelpatch built the model. Changes made through transformers'
    own API are saved as they are: a plain torch module (``nn.Embedding``, ``nn.Linear``) with plain tensors of the
    same kind of dtype may have been resized (``resize_token_embeddings``), replaced by a new head, or gained or lost
    a bias; what the load did not convert is written under its own name. A module substituted by a tool (a
    quantizer's module class, a tensor subclass such as torchao's, integer weights) has a layout the recorded
    conversions cannot reverse: nothing is written. Tensor subclasses are accepted when ``quantized`` (the model's
    load quantizer serialises them). So is the state compressed-tensors gives the Linear layers it quantizes
    (llm-compressor's ``oneshot``), which the layout writes under their checkpoint names (:mod:`.compressed`).
    """
    problems: dict[str, list[str]] = defaultdict(list)
    remedies: set[str] = set()
    modules = dict(model.named_modules())
    compressed = compressed_modules(model)
    for key, tensor in state.items():
        if _module_of(key) in compressed and isinstance(tensor, torch.Tensor):
            continue
        if not isinstance(tensor, torch.Tensor):
            problems[_module_of(key)].append(f"{key.rpartition('.')[2]} is a {type(tensor).__name__}, not a tensor")
            remedies.add(_REMEDY_SUBSTITUTED)
        elif type(tensor.detach()) is not torch.Tensor and not quantized:
            problems[_module_of(key)].append(
                f"{key.rpartition('.')[2]} is a {type(tensor.detach()).__name__} (a tensor subclass, e.g. quantized)"
            )
            remedies.add(_REMEDY_SUBCLASS)
    record = model_record(model)
    expected: Mapping[str, TensorMeta] | None = None if record is None else record.expected_state
    if expected is not None:
        for key, meta in expected.items():
            if _module_of(key) in compressed:
                continue
            name, module = key.rpartition(".")[2], modules.get(_module_of(key))
            tensor = state.get(key)
            if tensor is None:
                if not _plain(module):
                    problems[_module_of(key)].append(f"{name} is gone")
                    remedies.add(_REMEDY_SUBSTITUTED)
            elif isinstance(tensor, torch.Tensor) and _kind(tensor.dtype) != _kind(meta.dtype):
                problems[_module_of(key)].append(f"{name} is {tensor.dtype}, built as {meta.dtype}")
                remedies.add(_REMEDY_SUBCLASS if _plain(module) else _REMEDY_SUBSTITUTED)
            elif isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != tuple(meta.shape) and not _plain(module):
                problems[_module_of(key)].append(f"{name} is {list(tensor.shape)}, built as {list(meta.shape)}")
                remedies.add(_REMEDY_SUBSTITUTED)
        built_modules = {_module_of(key) for key in expected}
        for key in state.keys() - expected.keys():
            if (
                _module_of(key) in built_modules
                and _module_of(key) not in compressed
                and not _plain(modules.get(_module_of(key)))
            ):
                problems[_module_of(key)].append(f"{key.rpartition('.')[2]} is new")
                remedies.add(_REMEDY_SUBSTITUTED)
    if not problems:
        return
    lines = [
        f"Cannot save {type(model).__name__}: {len(problems)} module(s) changed since modelpatch built it, and their "
        "state cannot be written in a layout that loads back the same model. Nothing was written."
    ]
    for name in sorted(problems):
        module = modules.get(name)
        lines.append(
            f"  - {name or '<root>'} ({type(module).__name__ if module is not None else 'removed'}): "
            + "; ".join(problems[name])
        )
    lines.extend(sorted(remedies))
    raise SaveError("\n".join(lines))


# Only a model's load quantizer serialises quantized tensors (quantized_save.py), whatever the layout saved: tensors
# quantized after the load (torchao's quantize_) are refused by both layouts, so neither is the remedy.
_REMEDY_SUBCLASS = (
    "Quantized tensors (torchao's quantize_ after the load, say) are written only by the quantizer of a model loaded "
    "quantized. Load the model with quantization_config=TorchAoConfig(...) (or another transformers quantization "
    "config) and save that; or save the model before quantizing it, and quantize after each load; or keep torchao's "
    "own format: torch.save(model.state_dict(), path), then model.load_state_dict(torch.load(path), assign=True) on "
    "the model loaded as before. Or dequantize them before saving."
)
_REMEDY_SUBSTITUTED = (
    "A module a tool substituted (a quantizer's or wrapper's class): save with that tool's own format (or torch.save "
    "of the state dict), or put plain modules back (dequantize, merge_and_unload) before saving."
)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = local_part(a), local_part(b)  # a tensor-parallel shard's storage is its local tensor's
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _still_tied(model: PreTrainedModel, keys: tuple[str, str], state: Mapping[str, torch.Tensor]) -> bool:
    """Whether tensors ``keys`` of ``state`` (a tied parameter and its source) are still one tensor.

    They are when they share storage. accelerate's hooks put an offloaded module's weight back on the meta device
    after every forward, so a pair with one side offloaded to disk holds two tensors afterwards though the forward
    reads one value for both: it is still tied while the offloaded side, read from its file, equals the other.
    """
    tensors = [state[key] for key in keys]
    if _shares_storage(*tensors):
        return True
    offloaded = offloaded_weights(model)
    if offloaded is None or not any(tensor.is_meta for tensor in tensors):
        return False
    first, second = (
        offloaded[key] if tensor.is_meta and key in offloaded else tensor
        for key, tensor in zip(keys, tensors, strict=True)
    )
    if first.is_meta or second.is_meta or first.dtype != second.dtype or first.shape != second.shape:
        return False
    with torch.no_grad():
        return torch.equal(first.to(second.device), second)


def untied_pairs(model: PreTrainedModel, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Tied parameters (per the model's tying rules) that are no longer one tensor with their source."""
    return [
        tied
        for tied, source in tied_weight_keys(model).items()
        if tied in state and source in state and not _still_tied(model, (tied, source), state)
    ]


def state_to_save(
    model: PreTrainedModel, state: Mapping[str, torch.Tensor], report: LoadReport | None
) -> dict[str, torch.Tensor]:
    """``state`` minus tied parameters that still share their source's storage and that the source did not store.

    A parameter that was untied since (``lm_head.weight = nn.Parameter(...)``) is kept: dropping it would lose it.
    """
    state = dict(state)
    stored = set(report.checkpoint_keys) | set(report.direct) if report else set()
    untied = set(untied_pairs(model, state))
    for tied in tied_weight_keys(model):
        if tied not in stored and tied not in untied:
            state.pop(tied, None)
    return state


def checkpoint_layout(
    report: LoadReport | None, transforms: Sequence[WeightTransform], runtime: Mapping[str, TensorMeta]
) -> ConversionPlan:
    """Plan the checkpoint layout of the runtime tensors ``runtime`` (metadata only): ``direct`` maps checkpoint keys to
    the runtime keys written unchanged, ``groups`` run on runtime tensors and give checkpoint tensors.

    Keys a load read go back under their checkpoint names and converted groups through their recorded exact reverse.
    Whatever the load did not produce (a model built with ``from_config``, modules restructured since by
    :func:`modelpatch.fuse` or :func:`modelpatch.unfuse`, a new head) is mapped back by running ``transforms`` (the
    model's current ones) backwards.
    """
    layout = ConversionPlan()
    remaining = dict(runtime)
    if report is not None and not report.runtime_layout:
        for runtime_key, checkpoint_key in report.direct.items():
            if runtime_key in remaining:
                remaining.pop(runtime_key)
                layout.direct[checkpoint_key] = runtime_key
        for group in report.groups:
            present = [k for k in group.target_keys() if k in remaining]
            metas = group.target_metas()
            if not present or any(tuple(remaining[k].shape) != tuple(metas[k].shape) for k in present):
                continue  # restructured or resized since the load: planned below with the model's current transforms
            if len(present) != len(group.target_keys()):
                raise ConversionError(
                    f"Cannot save {group.target_keys()} back to {group.sources_summary()}: the model no longer has "
                    "all of these parameters."
                )
            layout.groups.append(group.reverse())
            for key in group.target_keys():
                remaining.pop(key)
    if remaining:
        plan = plan_save(remaining, list(transforms))
        plan.raise_problems()
        layout.direct.update(plan.direct)
        layout.groups.extend(plan.groups)
    return layout


def model_transforms(model: PreTrainedModel) -> Sequence[WeightTransform]:
    """The transforms between ``model``'s checkpoint layout and its runtime layout: those its record holds (set when
    it was restructured), else its load report's, else its classes' conversions (a model built with ``from_config``)."""
    record = model_record(model)
    transforms: Sequence[WeightTransform] | None = None if record is None else record.transforms
    if transforms is None:
        report = get_load_report(model)
        transforms = report.transforms if report is not None else model_conversions(model)
    return transforms


def model_layout(model: PreTrainedModel, state: Mapping[str, torch.Tensor]) -> ConversionPlan:
    """The checkpoint layout of ``model``'s runtime tensors ``state`` (see :func:`checkpoint_layout`), planned with
    :func:`model_transforms`; the Linear layers a tool gave compressed-tensors' state follow their weights
    (:func:`.compressed.compressed_layout`)."""
    metas = {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in state.items()}
    report, transforms = get_load_report(model), model_transforms(model)
    compressed = compressed_modules(model)
    if not compressed:
        return checkpoint_layout(report, transforms, metas)
    record = model_record(model)
    built = None if record is None else record.expected_state
    return compressed_layout(compressed, metas, built, lambda plain: checkpoint_layout(report, transforms, plain))


def reject_wrapped(model: Any) -> None:
    """A PEFT model is not a transformers model: say what to do instead of a bare type error."""
    if type(model).__module__.split(".")[0] == "peft":
        raise SaveError(
            f"{type(model).__name__} is a PEFT model. Merge the adapter first (model = peft_model.merge_and_unload()) "
            "to save a full checkpoint, or save only the adapter with peft_model.save_pretrained(directory)."
        )
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}.")
    injected = sorted(
        name for name, module in model.named_modules() if hasattr(module, "base_layer") and hasattr(module, "merge")
    )
    if injected:
        raise SaveError(
            f"{type(model).__name__} carries PEFT adapter layers ({', '.join(injected[:3])}"
            f"{', ...' if len(injected) > 3 else ''}). "
            "Merge them first (merge_and_unload()) to save a full checkpoint, "
            "or save only the adapter with the PEFT model's save_pretrained."
        )


def config_files(model: PreTrainedModel, *, original_format: bool) -> dict[str, bytes]:
    """``config.json`` (and ``generation_config.json`` for a generative model) as a save of ``model`` writes them."""
    config = copy.deepcopy(model.config)
    config.architectures = [model_class(model).__name__]
    record_file_layout(config, runtime_layout=not original_format)
    if untied_pairs(model, model.state_dict()) and getattr(config, "tie_word_embeddings", False):
        # The head was untied since the model was built: the reload must not tie it back over the saved tensor.
        config.tie_word_embeddings = False
    config_json = config.to_json_string(use_diff=True)
    if not original_format and stored_fusion_config(config) is not None:
        # Stock transformers would load these tensors into a stock model, leaving the fused ones random: the marked
        # model type makes it refuse by name (modelpatch unmarks it when it loads). An unfused model's runtime layout
        # is stock's own (save_original_format=False), which stock loads: it stays unmarked.
        config_json = json.dumps(mark_runtime_layout(json.loads(config_json)), indent=2, sort_keys=True) + "\n"
    files = {"config.json": config_json.encode()}
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and model.can_generate():
        files["generation_config.json"] = (generation_config.to_json_string()).encode()
    return files
