"""The record modelpatch keeps on each model it builds, loads or restructures: what a save needs to write the model
back exactly (the transforms it runs backwards, the state as built, how a quantized, tensor-parallel or offloaded load
left it) and the load report.

One :class:`ModelRecord` per model, under one attribute (:data:`MODEL_RECORD_ATTRIBUTE`), carrying the config
record's format version (:data:`~modelpatch.state.RECORD_VERSION`: one record, two halves). It is a plain dataclass in
the model's ``__dict__``, so models deepcopy and pickle with it. The small values a load leaves for its save
(:class:`QuantizedLoad`) live here with it; the modules whose types the record holds read it through the accessors
here (:func:`get_load_report`, :func:`offloaded_weights`), so that none of them imports this module back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from ..state import RECORD_VERSION

if TYPE_CHECKING:
    from ..conversion.planner import TensorMeta
    from ..conversion.transforms import WeightTransform
    from ..modes.base import LoadMode
    from ..modes.offload import OffloadedWeights
    from .plan import LoadPlan
    from .report import LoadReport

MODEL_RECORD_ATTRIBUTE = "_modelpatch_record"
"""The one attribute holding a model's :class:`ModelRecord`."""
REPORT_ALIAS_ATTRIBUTE = "modelpatch_report"
"""The public attribute naming the same :class:`LoadReport` as ``record.report`` (documented, kept as an alias)."""


@dataclass(frozen=True)
class QuantizedLoad:
    """What a save needs to know of a model loaded with a quantizer (kept on the model).

    ``dequantized``: the weights were dequantized at load (fp8 without a GPU): the model holds plain tensors and its
    config no longer has a ``quantization_config``, as in stock.
    """

    method: str
    dequantized: bool


@dataclass
class ModelRecord:
    """What modelpatch records on a model it builds, loads or restructures; what its saves and restructurings read.

    Attributes:
        report: The :class:`~modelpatch.loading.report.LoadReport` of a loaded model (None for a ``from_config``
            one); public as ``model.modelpatch_report`` and :func:`~modelpatch.get_load_report`.
        transforms: The transforms a save runs backwards, as a tuple; None for a loaded model never restructured,
            whose save runs its report's.
        base_transforms: The same without fusions: what :func:`~modelpatch.unfuse` goes back to.
        expected_state: Runtime key -> ``TensorMeta`` (shape, dtype) as built: what a save checks the model against.
        quantization: How a quantized load left the model (``QuantizedLoad``): what a save must respect.
        tensor_parallel_parts: For a tensor-parallel load, parameter -> global part sizes of the fused projections
            sharded part by part (a save gathers them); None otherwise.
        offloaded: The weights of modules a ``device_map`` offloaded to disk (``OffloadedWeights``): what a save
            reads back.
        load_modes: The load modes (``LoadMode``) the model was loaded with, in order: a save calls their save
            hooks (``saving/plan.py``'s ``SaveMode``: gathering shards, reading offloaded weights back, serialising).
        version: The format version of the record, :data:`RECORD_VERSION` (the config record's: one record, two
            halves).
    """

    report: LoadReport | None = None
    transforms: tuple[WeightTransform, ...] | None = None
    base_transforms: tuple[WeightTransform, ...] | None = None
    expected_state: dict[str, TensorMeta] | None = None
    quantization: QuantizedLoad | None = None
    tensor_parallel_parts: dict[str, tuple[int, ...]] | None = None
    offloaded: OffloadedWeights | None = None
    load_modes: tuple[LoadMode[LoadPlan], ...] = ()
    version: int = RECORD_VERSION


def model_record(model: nn.Module) -> ModelRecord | None:
    """The record modelpatch keeps on ``model``, or None for a model it never built nor restructured.

    Read with ``getattr`` so that a wrapper forwarding attributes to its model (a PEFT model) answers with its model's.

    Raises:
        TypeError: The attribute holds something else, or a record of another format version (a model pickled by
            another modelpatch): guessing its meaning could save wrong tensors.
    """
    record = getattr(model, MODEL_RECORD_ATTRIBUTE, None)
    return None if record is None else _checked(model, record)


def ensure_model_record(model: nn.Module) -> ModelRecord:
    """``model``'s record, created empty on the model itself (never on a wrapper's model) when it has none."""
    record = model.__dict__.get(MODEL_RECORD_ATTRIBUTE)
    if record is None:
        record = ModelRecord()
        # Straight into __dict__: nn.Module.__setattr__ would search its parameters, buffers and modules first.
        object.__setattr__(model, MODEL_RECORD_ATTRIBUTE, record)
    return _checked(model, record)


def _checked(model: nn.Module, record: Any) -> ModelRecord:
    if not isinstance(record, ModelRecord) or record.version != RECORD_VERSION:
        raise TypeError(
            f"{type(model).__name__}.{MODEL_RECORD_ATTRIBUTE} holds a {type(record).__name__} of version "
            f"{getattr(record, 'version', None)!r}, not a modelpatch record of format version {RECORD_VERSION} "
            "(a model pickled by another modelpatch version?). Load the model again."
        )
    return record


def record_report(model: nn.Module, report: LoadReport) -> None:
    """Record the load report of ``model``, also under its public alias ``model.modelpatch_report``."""
    ensure_model_record(model).report = report
    object.__setattr__(model, REPORT_ALIAS_ATTRIBUTE, report)


def get_load_report(model: nn.Module) -> LoadReport | None:
    """The :class:`~modelpatch.loading.report.LoadReport` of a model loaded by modelpatch, or None."""
    record = model_record(model)
    return None if record is None else record.report


def offloaded_weights(model: nn.Module) -> OffloadedWeights | None:
    """The offloaded weights of a model modelpatch dispatched with modules on ``"disk"``, else None."""
    record = model_record(model)
    return None if record is None else record.offloaded
