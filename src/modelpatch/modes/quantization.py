"""Quantized checkpoints, and quantization at load, done by transformers' own quantizers.

This is the one module of modelpatch that uses transformers' quantizer API (``transformers.quantizers`` and the ops
its quantizers declare), imported through :mod:`modelpatch._transformers`: a transformers upgrade means auditing this
file and that one. What it uses, where stock ``from_pretrained`` uses it:

* ``get_hf_quantizer``: the quantizer stock would use, with its environment checks (on a machine without a GPU the fp8
  quantizer switches itself to dequantizing, with a warning);
* ``update_dtype``, ``preprocess_model`` (module swaps; torchao reads the checkpoint's safetensors metadata there) and
  ``postprocess_model`` (the config's ``quantization_config``; a dequantized model loses it);
* ``update_weight_conversions([], model)``: the tensors that make up one quantized parameter and the transformers op
  that loads them. Its renamings are translated into modelpatch :class:`WeightRenaming` s and each supported op into
  a modelpatch :class:`ConversionOperation` (``Fp8Dequantize`` -> :class:`Fp8BlockDequantize`, ``TorchAoDeserialize``
  -> :class:`TorchAoTensor`); an op without a translation is refused by name;
* ``param_needs_quantization`` and ``get_quantize_ops`` to quantize at load (``get_state_dict_and_metadata``, to
  save, is used by ``quantized_save.py``, the save half).
  Private attributes read: ``pre_quantized``, ``quantization_config.dequantize``, torchao's ``metadata`` and the
  transforms' ``_original_source_patterns`` / ``_original_target_patterns``.

Supported methods: fp8 (block-scaled; dequantized, as stock does on a machine without a GPU), torchao (pre-quantized
safetensors checkpoints, and quantization at load) and compressed-tensors (its tensors load as they are into the
modules its quantizer prepares, as in stock). Every other method is refused by name before any tensor is read.

A quantized checkpoint loads in two stages. Stage one, here: the tensors that make up one quantized parameter
(``q_proj.weight`` + ``q_proj.weight_scale_inv``; ``q_proj._weight_qdata`` + ``q_proj._weight_scale`` + ...) become
that parameter (dequantized, or a torchao tensor). Stage two, the ordinary plan, sees those parameters as the
checkpoint, so the model's conversions and modelpatch's fusions apply to them as to any checkpoint (dequantized fp8
experts are stacked, dequantized q/k/v concatenated) — except where a conversion would have to concatenate or stack
torchao tensors, which is refused by name.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from .. import _transformers
from .._transformers import core_model_loading as hf
from .._transformers import (
    original_patterns,
    quantizer_for,
    weight_conversions_of,
)
from ..checkpoint.pages import release_pages
from ..conversion.operations import ConversionOperation, Fp8BlockDequantize, TorchAoTensor
from ..conversion.planner import ConversionPlan, TensorMeta, format_problems, plan_load
from ..conversion.transforms import WeightConverter, WeightRenaming, WeightTransform
from ..errors import LoadPlanError, ModelPatchError
from ..loading.diagnose import SUPPORTED_METHODS, collapse_lines
from ..loading.materialize import set_tensor
from ..loading.record import QuantizedLoad, ensure_model_record
from .base import LoadMode, Metas, TensorSource
from .quantized_save import plan_quantized_save

if TYPE_CHECKING:
    from .._transformers import HfQuantizer
    from ..checkpoint import Checkpoint
    from ..loading.plan import LoadPlan
    from ..saving.plan import SavePlan

# Checkpoint dtypes that are plain numbers; anything else a quantized checkpoint stores (float8, packed integers)
# only means something with its companions.
_PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _method_of(settings: Any) -> str | None:
    """The ``quant_method`` of a quantization config (a dict from config.json or a transformers config object)."""
    if settings is None:
        return None
    if isinstance(settings, Mapping):
        method = settings.get("quant_method")
        if method is None and (settings.get("load_in_8bit") or settings.get("load_in_4bit")):
            method = "bitsandbytes"  # old bitsandbytes configs name the method only by these flags
    else:
        method = getattr(settings, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def _refusal(message: str, method: str | None) -> LoadPlanError:
    return LoadPlanError(f"{message} Nothing was loaded.", {"quantization": [str(method)]})


@contextmanager
def _quantizer_refusals(method: str | None, what: str, hint: str = "") -> Iterator[None]:
    """Whatever transformers' quantizer raises about its settings or the checkpoint (it checks them with asserts,
    ``ValueError``, ``TypeError``, ``KeyError``, ...) as a :class:`LoadPlanError` saying ``what`` it was doing."""
    try:
        yield
    except ModelPatchError:
        raise
    except Exception as exc:
        detail = f"no {exc.args[0]!r} in its settings" if isinstance(exc, KeyError) and exc.args else str(exc)
        raise _refusal(f"transformers' {method} quantizer {what}: {detail.rstrip('.')}.{hint}", method) from exc


def _supported_or_refused(settings: Any, where: str) -> str | None:
    method = _method_of(settings)
    if settings is not None and method not in SUPPORTED_METHODS:
        raise _refusal(
            f"{where} asks for quantization method {method!r} (quant_method): the checkpoint would be quantized with "
            f"it, and modelpatch does not support {method!r}. modelpatch loads {', '.join(SUPPORTED_METHODS)} "
            "checkpoints through transformers' quantizers (and quantizes at load with torchao); load this one with "
            "stock transformers, or a full-precision checkpoint with modelpatch.",
            method,
        )
    return method


@dataclass
class Quantization(LoadMode):
    """The load mode of a quantized checkpoint or of quantization at load: transformers' quantizer of one load and
    the stage-one plan modelpatch derives from it."""

    name = "quantization"
    quantizes = True

    quantizer: HfQuantizer
    method: str
    source: str  # where the settings come from, for messages: "the quantization_config of .../config.json", ...
    stage: ConversionPlan | None = None  # stage one; its outputs are the checkpoint as stage two sees it
    # The tensors each quantized parameter is made of besides itself (``weight`` -> ``weight_scale_inv``), for messages.
    companions: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def dequantizes(self) -> bool:
        return bool(getattr(self.quantizer.quantization_config, "dequantize", False))

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.quantizer.update_dtype(dtype)

    def prepare_model(self, model: PreTrainedModel, *, dtype: torch.dtype, checkpoint: Checkpoint) -> None:
        """The quantizer's module swaps and checkpoint reading, on the meta model (headers and metadata only)."""
        files = [str(f) for f in checkpoint.files] or None
        with self._refusals(f"cannot prepare {type(model).__name__} for this checkpoint"):
            self.quantizer.preprocess_model(
                model=model, dtype=dtype, device_map=None, checkpoint_files=files, use_kernels=False
            )

    def _refusals(self, what: str) -> AbstractContextManager[None]:
        """:func:`_quantizer_refusals` of a failure that the checkpoint and its settings not going together explain."""
        return _quantizer_refusals(
            self.method,
            f"{what} (with {self.source})",
            f" The checkpoint's files are not what its quantization settings describe (settings meant for another "
            f"checkpoint, or a full-precision checkpoint under a {self.method} quantization_config?): remove the "
            "quantization_config, or load the checkpoint those settings were written with.",
        )

    # --- stage one -------------------------------------------------------------------------------------------------

    def plan_parameters(
        self, model: PreTrainedModel, checkpoint: Metas, *, dtype: torch.dtype, transforms: Sequence[WeightTransform]
    ) -> Metas:
        """Stage one (:meth:`plan_checkpoint`), then :meth:`check_conversions` of the load's ``transforms``."""
        parameters = self.plan_checkpoint(model, checkpoint, dtype)
        self.check_conversions(transforms)
        return parameters

    def plan_checkpoint(
        self, model: PreTrainedModel, checkpoint: Mapping[str, TensorMeta], dtype: torch.dtype
    ) -> dict[str, TensorMeta]:
        """Group the tensors of each quantized parameter; return the checkpoint as stage two sees it.

        Raises LoadPlanError naming every key whose tensors do not make up a parameter (a scale without its weight,
        a weight that does not divide into its scale grid). Reads no tensor data. Quantizing at load, the checkpoint
        is full precision and is returned as it is.
        """
        if not self.quantizer.pre_quantized:
            return dict(checkpoint)
        plan = plan_load(checkpoint, self._transforms(model, dtype))
        if any(plan.problems.values()):
            lines = [
                f"The {self.method} quantized tensors of the checkpoint do not make up {type(model).__name__}'s "
                "parameters; nothing was loaded."
            ]
            lines.extend(format_problems(plan.problems, collapse_lines))
            raise LoadPlanError("\n".join(lines), {k: list(v) for k, v in plan.problems.items() if v})
        # A group with none of its companions is a tensor the checkpoint did not quantize (a norm): read it directly.
        # Unless it is stored quantized (float8, packed integers): without its scales its values mean nothing, and
        # reading it as it is gives a model that runs and is wrong.
        kept, unscaled = [], []
        for group in plan.groups:
            if all(source is None for source in group.sources[1:]):
                key = group.source_keys()[0]
                if checkpoint[key].dtype not in _PLAIN_DTYPES:
                    unscaled.append(key)
                plan.direct[group.target_keys()[0]] = key
            else:
                kept.append(group)
        if unscaled:
            raise self._unscaled(unscaled, model)
        plan.groups = kept
        self.stage = plan
        return dict(plan.outputs)

    def _unscaled(self, keys: Sequence[str], model: PreTrainedModel) -> LoadPlanError:
        """The refusal of quantized weights stored without the tensors that give them their values (their scales)."""
        companions = sorted({name for names in self.companions.values() for name in names})
        lines = collapse_lines(keys)
        return LoadPlanError(
            f"The {self.method} checkpoint stores {len(keys)} quantized weight(s) without their scales (none of "
            f"the tensors that go with them, {', '.join(companions)}, is in it): loaded as they are, they would make "
            f"{type(model).__name__} compute something else. Nothing was loaded.\n"
            + "\n".join(f"  - {line}" for line in lines)
            + "\nThe checkpoint is incomplete: download it again, or add the missing scale tensors.",
            {"quantized weights without scales": list(keys)},
        )

    def _transforms(self, model: PreTrainedModel, dtype: torch.dtype) -> list[WeightTransform]:
        """The quantizer's own conversions (what it adds to a model with none), in modelpatch's vocabulary."""
        transforms: list[WeightTransform] = []
        with self._refusals("cannot tell which tensors make up the quantized parameters"):
            conversions = weight_conversions_of(self.quantizer, model)
        for transform in conversions:
            sources, targets = original_patterns(transform)
            if any("*" in pattern for pattern in [*sources, *targets]):
                raise self._untranslatable(f"{type(transform).__name__} {sources} -> {targets}")
            if isinstance(transform, hf.WeightConverter):
                transforms.append(self._converter(sources, targets, transform.operations, dtype))
            elif isinstance(transform, hf.WeightRenaming) and len(sources) == len(targets) == 1:
                # transformers' patterns end at a name boundary (`scale` does not match `scale_inv`).
                boundary = r"(?!\w)" if re.search(r"[A-Za-z0-9]$", sources[0]) else ""
                transforms.append(WeightRenaming(sources[0] + boundary, targets[0]))
            else:
                raise self._untranslatable(f"{type(transform).__name__} {sources} -> {targets}")
        return transforms

    def _converter(
        self, sources: Sequence[str], targets: Sequence[str], operations: Sequence[Any], dtype: torch.dtype
    ) -> WeightConverter:
        """``[weight, weight_scale_inv, ...] -> weight``: the parameter's tensors, the first required."""
        if len(targets) != 1 or len(operations) != 1:
            raise self._untranslatable(f"WeightConverter {sources} -> {targets} with {operations}")
        (operation,) = operations
        self.companions[sources[0]] = tuple(sources[1:])
        translated: ConversionOperation
        if isinstance(operation, _transformers.Fp8Dequantize):
            translated = Fp8BlockDequantize(dtype=dtype, companions=len(sources) - 1)
        elif isinstance(operation, _transformers.TorchAoDeserialize):
            translated = TorchAoTensor(metadata=dict(getattr(self.quantizer, "metadata", None) or {}))
        else:
            raise self._untranslatable(type(operation).__name__)
        patterns = [rf"(?<![^.]){re.escape(name)}$" for name in sources]
        return WeightConverter(patterns, targets[0], [translated], optional=patterns[1:])

    def _untranslatable(self, what: str) -> LoadPlanError:
        return _refusal(
            f"transformers' {self.method} quantizer loads this checkpoint with {what}, which modelpatch does not "
            "translate into its own conversions (a transformers version modelpatch was not written for?).",
            self.method,
        )

    def quantized_keys(self) -> set[str]:
        """What stage two must not convert: quantized tensors stage one built (torchao's, not dequantized ones) and
        tensors loaded as they are whose values mean something only with their companions (float8, packed)."""
        if self.stage is None:
            return set()
        built = set() if self.dequantizes else {key for group in self.stage.groups for key in group.target_keys()}
        return built | {key for key, meta in self.stage.outputs.items() if meta.dtype not in _PLAIN_DTYPES}

    def check_conversions(self, transforms: Sequence[WeightTransform]) -> None:
        """Refuse, naming them, stage-two conversions that would concatenate or stack quantized tensors.

        Checked before stage two is validated, so that this is the error rather than the keys it leaves missing.
        """
        quantized = self.quantized_keys()
        if not quantized or not transforms:
            return
        offending = [
            f"{sorted(set(group.source_keys()) & quantized)} -> {group.target_keys()} "
            f"({', '.join(type(op).__name__ for op in group.operations)})"
            for group in plan_load(self.stage.outputs, transforms).groups  # type: ignore[union-attr]
            if set(group.source_keys()) & quantized
        ]
        if offending:
            raise LoadPlanError(
                f"The {self.method} checkpoint stores quantized tensors that a conversion of this load would combine, "
                "and modelpatch cannot concatenate or stack quantized tensors; nothing was loaded.\n"
                + "\n".join(f"  - {line}" for line in collapse_lines(offending))
                + "\nHint: load without the fusion that needs them (fusion_config={name: False}), or quantize at load "
                "instead: load a full-precision checkpoint with quantization_config=...",
                {"quantized tensors converted": offending},
            )

    def wrap_source(self, source: TensorSource) -> TensorSource:
        """Stage two's source over the checkpoint's: a quantized parameter is built from its tensors when stage two
        asks for it, one at a time."""
        if self.stage is None:
            return source
        read, file_mapped = source.fetch, source.file_mapped
        groups = {group.target_keys()[0]: group for group in self.stage.groups}
        direct = self.stage.direct

        def fetch(key: str) -> torch.Tensor:
            group = groups.get(key)
            if group is None:
                return read(direct[key])
            sources = {k: read(k) for k in group.source_keys()}
            (tensor,) = group.run(sources.__getitem__).values()
            # Dequantized weights are new memory: the file pages they came from are done with. A torchao tensor
            # may hold views of them, which must stay.
            if self.dequantizes:
                for source_key, source in sources.items():
                    if file_mapped(source_key):
                        release_pages(source)
            return tensor

        return TensorSource(fetch, lambda key: key in direct and file_mapped(direct[key]))

    # --- after the tensors are in place ----------------------------------------------------------------------------

    def after_load(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Quantize at load (a full-precision checkpoint and ``quantization_config=``): every loaded parameter the
        quantizer wants, with its own op, after modelpatch's conversions and fusions (a fused ``qkv_proj`` is one
        quantized Linear)."""
        if self.quantizer.pre_quantized:
            return
        operation = self.quantizer.get_quantize_ops()
        for key in plan.loaded_keys():
            if self.quantizer.param_needs_quantization(model, key):
                produced = operation.convert(
                    {key: model.get_parameter(key)}, model=model, full_layer_name=key, missing_keys=set()
                )
                for name, tensor in produced.items():  # an embedding untied from its head gives the head back
                    set_tensor(model, name, tensor)

    def finish(self, model: PreTrainedModel) -> PreTrainedModel:
        """What stock does last: the quantizer on the model, then its post-processing (config, dequantized state)."""
        model.hf_quantizer = self.quantizer
        self.quantizer.postprocess_model(model)
        ensure_model_record(model).quantization = QuantizedLoad(self.method, self.dequantizes)
        return model

    def plan_save(self, plan: SavePlan) -> None:
        """A save writes the quantizer's serialisation, or is refused by name (``quantized_save.py``)."""
        plan_quantized_save(plan)


def quantizer_api_supported() -> bool:
    """Whether this transformers' quantizers have the API modelpatch drives (5.23's): conversions are rewritten
    knowing the model's parameters. Earlier 5.x releases rewrite them without the model, with other semantics."""
    return "model" in inspect.signature(_transformers.HfQuantizer.update_weight_conversions).parameters


def load_quantization(
    config: PretrainedConfig, quantization_config: Any, *, device_map: Any = None
) -> Quantization | None:
    """The quantization of one load (from ``config.quantization_config`` or the ``quantization_config`` argument),
    or None. Refuses, naming the method, everything modelpatch does not load, before any tensor is read."""
    stored = getattr(config, "quantization_config", None) or getattr(
        config.get_text_config(decoder=True), "quantization_config", None
    )
    method = _supported_or_refused(stored, "config.json")
    method = _supported_or_refused(quantization_config, "quantization_config=") or method
    if method is None:
        return None
    config_file = Path(config.name_or_path) / "config.json" if config.name_or_path else Path("config.json")
    source = f"the quantization_config of {config_file}"
    if quantization_config is not None:
        source = "quantization_config=" + (f" and {source}" if stored is not None else "")
    if not quantizer_api_supported():
        import transformers

        raise _refusal(
            f"A {method} checkpoint: transformers {transformers.__version__}'s quantizers rewrite weight conversions "
            "without the model "
            "(HfQuantizer.update_weight_conversions(conversions)); modelpatch loads quantized checkpoints with the "
            "API of transformers 5.23 (update_weight_conversions(conversions, model)). Upgrade transformers.",
            method,
        )
    if device_map is not None and method == "torchao":
        raise _refusal(
            "device_map with a torchao model: modelpatch does not dispatch torchao tensors across devices; pass "
            "device= instead.",
            method,
        )
    with _quantizer_refusals(method, "refuses this load", f" Check {source}."):
        quantizer = quantizer_for(config, quantization_config, device_map)
    quantization = Quantization(quantizer, method, source)
    if method == "compressed-tensors" and getattr(quantizer.quantization_config, "dequantize", False):
        # Refused from the settings, whatever ops this transformers release would use to dequantize at load.
        raise quantization._untranslatable("CompressedTensorsDequantize (dequantize=True)")
    if method == "fp8" and not quantization.dequantizes:
        raise _refusal(
            "fp8 kept in float8 (transformers' FP8Linear, on a GPU): modelpatch loads fp8 checkpoints dequantized "
            "only. Pass quantization_config=FineGrainedFP8Config(dequantize=True).",
            method,
        )
    return quantization
