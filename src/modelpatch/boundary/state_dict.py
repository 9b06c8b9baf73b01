"""The state-dict boundary of a model modelpatch built or restructured: its state in the checkpoint's layout.

Inside, a fused model holds its runtime layout (``qkv_proj``, packed experts); outside, callers speak the layout of
the checkpoint it came from (what stock models hold and ``save_pretrained`` writes). Three doors cross that boundary:

* saving: ``model.save_pretrained`` (:func:`~modelpatch.saving.save.original_format_save`);
* loading: ``model.load_state_dict`` (:func:`original_layout_load`) accepts either layout, or a mix, as Trainer's
  ``resume_from_checkpoint`` and ``load_best_model_at_end`` pass it;
* streaming: :func:`iter_original_state_dict` yields the checkpoint's ``(name, tensor)`` pairs one conversion group at
  a time, for a consumer such as an inference engine's ``load_weights(iterable)``.

Every door plans with the same conversion plan (:func:`~modelpatch.saving.save.model_layout`): direct keys and
conversion groups bound to the model's shapes, run forwards or backwards; nothing is converted here by hand.
The two methods are real bound methods of the model (:mod:`.methods`).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from .._torch import copy_state_dict_metadata
from ..conversion.planner import ConversionGroup, TensorMeta
from ..loading.plan import plan_checkpoint_keys
from ..modes.distributed import full_tensor, is_fsdp, refuse_two_shardings, shard_like
from ..saving.contents import model_layout, model_transforms
from ..saving.save import original_format_save, planned_save, save_modes
from ..saving.stages import plan_model_save
from .adapters import install_adapter_guard
from .methods import bind_method
from .peft_merge import merged_model

__all__ = ["OriginalLayoutLoad", "install_state_dict_boundary", "iter_original_state_dict", "original_layout_load"]


def iter_original_state_dict(model: PreTrainedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``model``'s weights in its checkpoint's original layout, without writing files.

    Yields ``(name, tensor)`` pairs under the names and with the values :func:`modelpatch.save_pretrained` writes
    (bitwise), one conversion group at a time: a tensor read unchanged is the model's own (a view, not a copy: do not
    write to it), a converted group (one layer's ``q/k/v`` out of ``qkv_proj``, one layer's experts) is computed when
    its turn comes, so the memory added is bounded by the largest group. The pairs fit an inference engine's
    ``load_weights(iterable)`` (vLLM's shape of weight sync) or any other consumer of a checkpoint's tensors. A tied
    weight comes once, under the name of its source, as a save writes it: a head tied to the embeddings gives
    ``model.embed_tokens.weight`` and no ``lm_head.weight``.

    On a tensor-parallel or FSDP2-sharded model (``fully_shard``) every rank must iterate, to the end and in step:
    each tensor is gathered from its shards when its turn comes (``DTensor.full_tensor()``, a collective; a fused
    ``qkv_proj`` / ``gate_up_proj`` sharded by rows part by part, never whole: ``ShardedTensors.save_group``), so a
    group is gathered only while it is converted and yielded, and every rank receives the full tensors. Weights of
    modules offloaded to disk are read from their files when their turn comes.

    A LoRA model (a ``PeftModel``, or the model it adapts, also after ``merge_adapter()``) yields its merged weights:
    bitwise what ``copy.deepcopy(peft_model).merge_and_unload()`` then this stream would yield, without that copy and
    without changing the model. Each tensor an active adapter touches is computed when its turn comes (the model's
    tensor copied, each layer's ``W + scale · B @ A`` added as PEFT's merge adds it), so one merged tensor (or one
    conversion group's) is added at a time; the names are the original model's, with no ``lora_*`` tensor and no
    ``base_layer.``. Adapters already merged (``merge_adapter()``) are not added twice. See
    :mod:`modelpatch.boundary.peft_merge` for what is refused.

    Raises:
        SaveError: As :func:`modelpatch.save_pretrained`, before anything is yielded: quantized tensor subclasses,
            modules substituted since the build.
        PeftIntegrationError: An adapter with no exact merge here (another PEFT method, DoRA, modules_to_save, ...;
            named), or a sharded LoRA model, before anything is yielded.
        ShardingError: ``model`` is both tensor-parallel and FSDP2-sharded (a 2-D mesh).
    """
    refuse_two_shardings(model, "iter_original_state_dict()")
    merged = merged_model(model)
    if merged is None:
        plan = planned_save(model)  # the stages of a save, but the tensors are yielded instead of written
        fetch: Callable[[str], torch.Tensor] = plan.fetch
    else:  # the save of the merged model's state, each merged tensor computed when fetched
        plan = plan_model_save(merged.model, save_modes(merged.model), original_format=True, state_dict=merged.state)
        fetch = merged.fetch(plan.fetch)
    for checkpoint_key, runtime_key in plan.layout.direct.items():
        yield checkpoint_key, fetch(runtime_key)
    for group in plan.layout.groups:
        # A sharded model's groups as its save mode computes them (a fused tensor gathered part by part).
        yield from (plan.group_tensors(group) if merged is None else group.run(fetch)).items()


def _keeping_metadata(
    target: collections.OrderedDict[str, Any], source: Mapping[str, Any]
) -> collections.OrderedDict[str, Any]:
    """``target`` carrying ``source``'s metadata (torch reads module versions from it), if it has one."""
    copy_state_dict_metadata(target, source)
    return target


def _quoted(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _names_any(patterns: set[str], keys: Iterable[str]) -> bool:
    """Whether a key of ``patterns`` (``*`` for an index, as :attr:`ConversionPlan.unbuilt` names them) is one of
    ``keys``."""
    compiled = [re.compile(re.escape(pattern).replace(r"\*", r"\d+")) for pattern in patterns]
    return any(pattern.fullmatch(key) for pattern in compiled for key in keys)


class OriginalLayoutLoad:
    """``model.load_state_dict`` of a model modelpatch built: torch's method, fed the model's own layout.

    The state dict may hold the model's runtime keys, the checkpoint's original keys, or both (a Trainer checkpoint, a
    stock model's ``state_dict()``, a shard of either). Original keys read unchanged are renamed; a conversion group
    (a layer's ``q/k/v``) runs forwards into its runtime tensor, its parts the dict does not hold taken from the
    model's current values, so a partial dict changes exactly what it names, as torch's ``strict=False`` does.
    ``strict``, ``assign`` and the returned missing / unexpected keys mean what they mean in torch, with keys in the
    names the caller used: the original names when the dict is in the original layout.

    Keys in neither layout are planned as a load of a checkpoint holding them plans them, with the model's
    transforms: a stock MoE model's ``state_dict()`` (transformers' in-memory 3-D experts) loads into per-expert Linear
    experts (``linear_experts``) exactly as a load of a 3-D checkpoint fills them. Keys nothing turns into the model's
    parameters are unexpected, as in torch.

    On an FSDP2-sharded model (``fully_shard``) the dict holds whole tensors, as a single process's ``state_dict()``
    or a checkpoint gives them, on every rank: each rank converts them and keeps its own shard of each parameter
    (``DTensor`` values are taken as they are). A group the dict gives only part of reads the other parts from the
    model, gathered (a collective): every rank must then load the same keys.
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def __call__(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        model = self.model
        stock_load = type(model).load_state_dict
        refuse_two_shardings(model, "load_state_dict()")
        own = model.state_dict()
        if all(key in own for key in state_dict):  # the model's own layout: torch's method as is
            return stock_load(model, self._shards(state_dict, own), strict=strict, assign=assign)
        layout = model_layout(model, own)
        runtime = _keeping_metadata(collections.OrderedDict(), state_dict)
        used: set[str] = set()
        missing_original: list[str] = []  # parts of a group the dict converts partly
        errors: list[str] = []
        for key, tensor in state_dict.items():
            if key in own:
                runtime[key] = tensor
                used.add(key)
        for checkpoint_key, runtime_key in layout.direct.items():
            if checkpoint_key not in own and checkpoint_key in state_dict:
                self._take(runtime, runtime_key, state_dict[checkpoint_key], checkpoint_key, errors)
                used.add(checkpoint_key)
        for group in layout.groups:
            given = [key for key in group.target_keys() if key not in own and key in state_dict]
            if not given:
                continue
            missing_original += [key for key in group.target_keys() if key not in given]
            for runtime_key, tensor in self._convert(group, own, state_dict, given, errors).items():
                self._take(runtime, runtime_key, tensor, ", ".join(given), errors)
            used.update(given)
        others = [key for key in state_dict if key not in used and key not in own]
        for group in self._other_layout(own, state_dict, others, errors) if others else ():
            with torch.no_grad():
                converted = group.run(lambda key: state_dict[key].detach())
            for runtime_key, tensor in converted.items():
                self._take(runtime, runtime_key, tensor, ", ".join(group.source_keys()), errors)
            used.update(group.source_keys())
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t" + "\n\t".join(errors))
        result = stock_load(model, self._shards(runtime, own), strict=False, assign=assign)
        original = any(key not in own for key in used)
        missing = [*self._names(result.missing_keys, layout, original), *missing_original]
        unexpected = [*result.unexpected_keys, *(key for key in state_dict if key not in used)]
        if strict and (missing or unexpected):
            lines = []
            if missing:
                lines.append(f"Missing key(s) in state_dict: {_quoted(missing)}.")
            if unexpected:
                lines.append(f"Unexpected key(s) in state_dict: {_quoted(unexpected)}.")
            raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t" + "\n\t".join(lines))
        return result._replace(missing_keys=missing, unexpected_keys=unexpected)

    def _shards(self, state_dict: Mapping[str, Any], own: Mapping[str, Any]) -> Mapping[str, Any]:
        """On an FSDP2-sharded model, ``state_dict`` with each whole tensor cut to this rank's shard of the parameter
        it loads into (torch's method copies shard into shard); else ``state_dict`` itself."""
        if not is_fsdp(self.model):
            return state_dict
        shards = collections.OrderedDict(
            (key, shard_like(value, own[key]) if key in own and isinstance(value, torch.Tensor) else value)
            for key, value in state_dict.items()
        )
        return _keeping_metadata(shards, state_dict)

    @staticmethod
    def _take(runtime: dict[str, Any], key: str, tensor: Any, source: str, errors: list[str]) -> None:
        if key in runtime:
            errors.append(f"{source} and {key} give the same parameter {key} twice (original and runtime layout).")
        runtime[key] = tensor

    @staticmethod
    def _convert(
        group: ConversionGroup,
        own: Mapping[str, torch.Tensor],
        state_dict: Mapping[str, Any],
        given: list[str],
        errors: list[str],
    ) -> dict[str, torch.Tensor]:
        """The runtime tensors of ``group`` (a runtime -> checkpoint group of the layout) with the checkpoint tensors
        ``given`` from ``state_dict`` and the others the model's current ones."""
        with torch.no_grad():
            # (The model's current tensors, whole: gathered from their shards on an FSDP2-sharded model.)
            current = group.run(lambda key: full_tensor(own[key]).detach())
            parts: dict[str, torch.Tensor] = {}
            for key, tensor in current.items():
                if key not in given:
                    parts[key] = tensor
                    continue
                value = state_dict[key]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(tensor.shape):
                    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    errors.append(
                        f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                        f"the shape in current model is {list(tensor.shape)}."
                    )
                    return {}
                # One dtype per group, the model's: the converted tensor is copied into the model's anyway.
                parts[key] = value.detach().to(device=tensor.device, dtype=tensor.dtype)
            return group.reverse().run(parts.__getitem__)

    def _other_layout(
        self, own: Mapping[str, torch.Tensor], state_dict: Mapping[str, Any], keys: list[str], errors: list[str]
    ) -> list[ConversionGroup]:
        """The groups (checkpoint -> runtime) that turn ``keys`` of ``state_dict``, in neither the model's layout nor
        its checkpoint's, into parameters of the model, planned as a load of a checkpoint holding them plans them,
        with the model's transforms: a stock MoE model's ``state_dict()`` holds transformers' in-memory 3-D experts
        (``mlp.experts.gate_up_proj``), which ``linear_experts`` splits per expert as it does at a load of a 3-D
        checkpoint. Keys no group turns into the model's parameters stay unexpected; keys whose groups would, but do
        not fit the model's shapes, are size mismatches in ``errors``."""
        metas = {
            key: TensorMeta(tuple(state_dict[key].shape), state_dict[key].dtype)
            for key in keys
            if isinstance(state_dict[key], torch.Tensor)
        }
        expected = {key: TensorMeta(tuple(tensor.shape), tensor.dtype) for key, tensor in own.items()}
        transforms = model_transforms(self.model)
        plan, _ = plan_checkpoint_keys(self.model, metas, transforms, expected, prefixes=False)
        groups = []
        for group in plan.groups:
            targets = group.target_metas()
            if not all(key in own for key in targets):
                continue  # not the model's parameters (another model's layer, say): unexpected keys
            wrong = [key for key, meta in targets.items() if tuple(meta.shape) != tuple(own[key].shape)]
            if wrong:
                sources = group.source_keys()
                shapes = [list(metas[key].shape) for key in sources]
                errors.append(
                    f"size mismatch for {', '.join(sources)}: copying a param with shape "
                    f"{shapes[0] if len(shapes) == 1 else shapes} from checkpoint gives {wrong[0]} "
                    f"{list(targets[wrong[0]].shape)}{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''}, "
                    f"the shape in current model is {list(own[wrong[0]].shape)}."
                )
                continue
            groups.append(group)
        # Keys matched by a converter whose group could not be built (neither converted nor read as they are).
        placed = {*plan.direct.values(), *(key for group in plan.groups for key in group.source_keys())}
        for key in (key for key in metas if key not in placed):
            # Planned alone, the key's own converter says which parameters it is for.
            alone, _ = plan_checkpoint_keys(self.model, {key: metas[key]}, transforms, expected, prefixes=False)
            if _names_any(alone.unbuilt, own):
                errors.append(
                    f"size mismatch for {key}: copying a param with shape {list(metas[key].shape)} from checkpoint, "
                    f"which does not convert into the current model's parameters: {'; '.join(alone.problem_lines())}"
                )
        return groups

    @staticmethod
    def _names(missing: list[str], layout: Any, original: bool) -> list[str]:
        """Missing runtime keys in the caller's names: the checkpoint's when the dict was in the original layout."""
        if not original:
            return list(missing)
        to_checkpoint: dict[str, list[str]] = {runtime: [key] for key, runtime in layout.direct.items()}
        for group in layout.groups:
            for runtime in group.source_keys():
                to_checkpoint[runtime] = group.target_keys()
        names: dict[str, None] = {}
        for key in missing:
            names.update(dict.fromkeys(to_checkpoint.get(key, [key])))
        return list(names)


def install_state_dict_boundary(model: PreTrainedModel) -> None:
    """Make ``model.save_pretrained`` write and ``model.load_state_dict`` accept the original layout, and refuse stock
    PEFT's ``"all-linear"``, whose adapter would carry fused names out (:mod:`.adapters`). Instance attributes, each a
    bound method of the model (:func:`.methods.bind_method`): transformers' classes are untouched."""
    bind_method(model, "save_pretrained", original_format_save)
    bind_method(model, "load_state_dict", original_layout_load)
    install_adapter_guard(model)


def original_layout_load(
    model: PreTrainedModel, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    """``model.load_state_dict`` of a model modelpatch built (bound to it): :class:`OriginalLayoutLoad`."""
    return OriginalLayoutLoad(model)(state_dict, strict=strict, assign=assign)
