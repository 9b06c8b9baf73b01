"""``linear_experts``: transformers' fused 3-D experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) of
qwen2_moe, qwen3_moe, mixtral, olmoe, ... become :class:`LinearExperts`.

Per-expert child names follow the model type's published checkpoint (``gate_proj/up_proj/down_proj``, or
``w1/w3/w2`` for Mixtral), so per-expert checkpoint keys load without conversion and save back unchanged; the model
type's per-expert -> fused converters are dropped for the load.

Some checkpoints store the experts fused, as 3-D ``experts.gate_up_proj`` / ``experts.down_proj`` keys (Qwen3.5-MoE
as published, anything stock transformers saved with ``save_original_format=False``). The spec's transforms split
those into the per-expert keys; the load records the split, so a default save writes the 3-D keys back bitwise.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections import defaultdict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from ...conversion.operations import Chunk, ConversionOperation, Interleave, SplitModulelist, Transpose
from ...conversion.registry import get_checkpoint_conversion_mapping
from ...conversion.transforms import WeightConverter, WeightRenaming, WeightTransform
from ...errors import FusionError, TensorParallelError
from ..generated import make_class
from ..sharding import TensorParallelLayout, TensorParallelShard
from ..source_digest import function_digest
from ..spec import FusionOptions, ModuleFusionSpec
from .modules import ExpertGate, ExpertMLP, LinearExperts

# How the model's TP plan shards the stock fused experts: (the experts module, gate_up_proj, down_proj).
STOCK_EXPERTS_PLAN = ("moe_tp_experts", "packed_colwise", "rowwise")

DEFAULT_CHILD_NAMES = ("gate_proj", "up_proj", "down_proj")

# (gate, up, down) child names of one expert in the published checkpoints of the model types that do not use
# DEFAULT_CHILD_NAMES (transformers 5.23's per-expert -> fused conversions name the same ones).
EXPERT_CHILD_NAMES: Mapping[str, tuple[str, str, str]] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "deepseek_v4",
                "kimi_linear",
                "lfm2_moe",
                "minimax",
                "minimax_m2",
                "minimax_m3_vl",
                "minimax_m3_vl_text",
                "mistral_large4_text",
                "mixtral",
                "phimoe",
            ),
            ("w1", "w3", "w2"),
        ),
        "dots3_note_vision_encoder": ("fc1", "fc3", "fc2"),
    }
)


@dataclasses.dataclass(frozen=True)
class LinearExpertsOptions(FusionOptions):
    """Options of ``fusion_config={"linear_experts": {...}}``.

    Attributes:
        child_names: ``(gate, up, down)`` names of each expert's Linears, for checkpoints that name them otherwise
            than :data:`EXPERT_CHILD_NAMES` says for their model type (default: that table).
    """

    child_names: tuple[str, str, str] | None = None

    def __post_init__(self) -> None:
        names = self.child_names
        if names is None:
            return
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise TypeError(f"child_names must be three names (gate, up, down), got {names!r}.")
        given = tuple(names)
        if len(given) != 3 or not all(isinstance(n, str) and n.isidentifier() for n in given) or len(set(given)) != 3:
            raise ValueError(f"child_names must be three distinct identifiers (gate, up, down), got {given!r}.")
        # A JSON list (from a stored config) and a tuple are the same option.
        object.__setattr__(self, "child_names", given)


def expert_child_names(model_type: str | None) -> tuple[str, str, str]:
    """(gate, up, down) child names of one expert in ``model_type``'s checkpoints."""
    return EXPERT_CHILD_NAMES.get(model_type or "", DEFAULT_CHILD_NAMES)


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How a stock experts class computes, as far as this family knows it.

    Attributes:
        forward: What its forward is (for messages).
        transposed: Its weights are stored ``[E, in, out]`` (``x @ w``), not ``[E, out, in]`` (``linear(x, w)``).
        bias: It holds ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]`` and adds them.
        gate: ``"act"``: ``act_fn(gate) * up`` over the two halves of the gate/up product; ``"chunked"`` /
            ``"interleaved"``: the class's own ``_apply_gate`` on the whole product, whose gate and up columns come
            in two halves / alternate.
        dispatched: Its forward takes the tokens already dispatched to every expert (``[E * T, H]``, Llama 4) and
            runs each expert over its own slice (:meth:`LinearExperts.forward_dispatched`), instead of routing them.
    """

    forward: str
    transposed: bool = False
    bias: bool = False
    gate: str = "act"
    dispatched: bool = False


# The forwards this family reproduces exactly, by a digest of their syntax trees (see ``forward_digest``): each routes
# every token's top-k slots to experts (a slot index equal to the number of experts is padding), computes the expert's
# gated MLP and adds the outputs weighted by the routing weights, in the activations' dtype (Llama 4's: runs each
# expert's gated MLP over the tokens already dispatched to it). Checked against
# transformers 5.23's source, and 5.15's for the two forwards of before 5.18; any other forward (another release's
# edits included) is left unfused.
KNOWN_FORWARDS: Mapping[str, ExpertsLayout] = MappingProxyType(
    {
        "b72644b25fa73ab1": ExpertsLayout(
            "transformers' experts forward (MixtralExperts, Qwen3MoeExperts and 52 more)"
        ),
        "ea43cfd877ba0c93": ExpertsLayout(
            "transformers' experts forward through the class's _apply_gate (DeepseekV4Experts, Glm5NextTextExperts, "
            "HYV4Experts, MiniMaxM3VLExperts, BeamExperts)",
            gate="chunked",
        ),
        # The two above as transformers 5.15-5.17 wrote them: their one-hot mask has no class for a padding slot (an
        # index equal to the number of experts raises there), otherwise the same computation.
        "d4395a57ef82f8e6": ExpertsLayout("transformers' experts forward before 5.18 (MixtralExperts and more)"),
        "0be2624a2d484849": ExpertsLayout(
            "transformers' experts forward through the class's _apply_gate before 5.18 (DeepseekV4Experts and more)",
            gate="chunked",
        ),
        # the same forward without the experts-implementation dispatcher
        "de26a0bb41d25d0f": ExpertsLayout("Step3p7Experts' forward, through its _apply_gate", gate="chunked"),
        "52e3c262c4cc8276": ExpertsLayout("AriaExperts' forward (transposed weights)", transposed=True),
        "8ac1264123e72278": ExpertsLayout(
            "Llama4TextExperts' forward (transposed weights, every expert over the tokens dispatched to it)",
            transposed=True,
            dispatched=True,
        ),
        "2ff5ba2d53b7b2b3": ExpertsLayout(
            "GptOssExperts' forward (transposed weights with biases, gate and up columns interleaved)",
            transposed=True,
            bias=True,
            gate="interleaved",
        ),
    }
)
# Forwards known to compute something the per-expert MLPs do not, and what.
UNKNOWN_FORWARDS: Mapping[str, str] = MappingProxyType(
    {
        "8813924efe89dd09": "it routes some slots to weightless identity ('zero') experts (LongCat-Flash)",
        "052d35834090a2df": "it accumulates the experts' outputs in float32 whatever the weights' dtype (Inkling 2)",
        "1d005de17766c9ea": "it computes every projection in float32 whatever the weights' dtype "
        "(OpenAI privacy filter)",
    }
)
# Experts classes whose forward this family knows but whose checkpoints it cannot split per expert, and why.
UNSPLIT_CHECKPOINTS: Mapping[str, str] = MappingProxyType(
    {
        "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeExperts": "its checkpoint "
        "holds the text and the vision experts as one list (Ernie 4.5 VL's expert groups), which the per-expert keys "
        "of each group do not follow",
    }
)
_WEIGHTS = ("gate_up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "down_proj_bias")
_CARRIED = {*_WEIGHTS, *_BIASES}


# Per class, computed once; a class that goes (one made in a test, say) takes its entry with it.
_DIGESTS: weakref.WeakKeyDictionary[type[nn.Module], str | None] = weakref.WeakKeyDictionary()


def forward_digest(cls: type[nn.Module]) -> str | None:
    """The digest (:func:`~modelpatch.fusions.source_digest.function_digest`) of ``cls.forward`` and of every function
    it wraps (transformers' experts-implementation dispatcher wraps the forward as written): equal for the same code
    whatever its formatting and whatever Python reads it; None when a source cannot be read."""
    if cls not in _DIGESTS:
        _DIGESTS[cls] = function_digest(cls.forward)
    return _DIGESTS[cls]


def forward_layout(cls: type[nn.Module]) -> ExpertsLayout | str:
    """The layout of ``cls``'s forward when this family knows it, else why it does not fuse the class."""
    digest = forward_digest(cls) or ""
    layout = KNOWN_FORWARDS.get(digest)
    if layout is None:
        note = UNKNOWN_FORWARDS.get(digest, "it is not one this family knows computes the same")
        return f"its forward ({cls.__qualname__}.forward): {note}"
    return layout


def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    found = [module._parameters.get(name) for name in _WEIGHTS]
    if all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in found):
        return cast(torch.Tensor, found[0]), cast(torch.Tensor, found[1])
    return None


def experts_sizes(module: nn.Module, layout: ExpertsLayout) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a stock experts module of ``layout``."""
    gate_up, _ = cast(tuple[torch.Tensor, torch.Tensor], _weights(module))
    experts, rows, columns = gate_up.shape
    hidden, double = (rows, columns) if layout.transposed else (columns, rows)
    return experts, hidden, double // 2


def experts_layout(module: nn.Module) -> ExpertsLayout | str:
    """The layout of a stock experts module, or why the per-expert MLPs would not compute what it computes."""
    weights = _weights(module)
    if weights is None:
        return "it holds no 3-D gate_up_proj and down_proj parameters"
    state = [name for name, _ in (*module.named_parameters(), *module.named_buffers()) if name not in _CARRIED]
    if state:
        return f"it holds {', '.join(state)} besides its experts' weights, which the per-expert MLPs have no place for"
    layout = forward_layout(type(module))
    if isinstance(layout, str):
        return layout
    if (unsplit := UNSPLIT_CHECKPOINTS.get(f"{type(module).__module__}.{type(module).__qualname__}")) is not None:
        return unsplit
    if not layout.bias and (unused := [name for name in _BIASES if module._parameters.get(name) is not None]):
        return f"it holds {', '.join(unused)}, which its forward does not add"
    experts, hidden, intermediate = experts_sizes(module, layout)
    gate_up, down = weights
    expected = [(experts, hidden, 2 * intermediate), (experts, intermediate, hidden)]
    if not layout.transposed:
        expected = [(e, b, a) for e, a, b in expected]
    biases = [module._parameters.get(name) for name in _BIASES] if layout.bias else [None, None]
    bias_sizes = (2 * intermediate, hidden) if layout.bias else (None, None)
    if [tuple(gate_up.shape), tuple(down.shape)] != expected or any(
        size is not None and (b is None or tuple(b.shape) != (experts, size))
        for b, size in zip(biases, bias_sizes, strict=True)
    ):
        return (
            f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not the layout its forward reads"
        )
    if layout.gate == "act" and not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    return layout


def _legacy_names(config: PretrainedConfig) -> dict[str, list[tuple[str, str, list[ConversionOperation]]]]:
    """The model type's conversions of the 3-D experts weights from another checkpoint name (Aria's ``experts.fc1``,
    GraniteMoE's ``input_linear``, Inkling's interleaved ``w13_weight``), as ``{weight: [(checkpoint key pattern,
    runtime prefix of the experts, the operations it applies on the way)]}``: renamings, and one-to-one converters
    of transposes and interleavings (permutations, reversed exactly).

    The family's filter drops those conversions with the model type's other experts conversions (they target the
    experts' 3-D names); the family's own converters read those checkpoint names instead, so the save writes them
    back.
    """
    found: dict[str, list[tuple[str, str, list[ConversionOperation]]]] = defaultdict(list)
    for model_type in dict.fromkeys((config.model_type, config.get_text_config().model_type)):
        for transform in get_checkpoint_conversion_mapping(model_type) or []:
            sources, targets = transform.source_patterns, transform.target_patterns
            if len(sources) != 1 or len(targets) != 1:
                continue
            if type(transform) is WeightRenaming:
                operations: list[ConversionOperation] = []
            elif isinstance(transform, WeightConverter) and all(
                type(op) in (Interleave, Transpose) and not getattr(op, "check_dims", False)
                for op in transform.operations
            ):
                operations = list(transform.operations)
            else:
                continue
            if match := re.fullmatch(r"((?:\w+\.)*)(gate_up_proj|down_proj)", targets[0]):
                found[match[2]].append((sources[0], match[1], operations))
    return found


def expert_gate(module: nn.Module, layout: ExpertsLayout) -> ExpertGate | None:
    """The :class:`ExpertGate` of a stock experts module whose forward gates through its own ``_apply_gate``: that
    function with the module's plain attributes and activation (tensors are the experts' weights, carried apart)."""
    if layout.gate == "act":
        return None
    state = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
    state.update(module._modules)
    apply_gate = cast(Any, type(module))._apply_gate  # the known forwards that gate through it (see KNOWN_FORWARDS)
    return ExpertGate(apply_gate, state, interleaved=layout.gate == "interleaved")


class LinearExpertsFusionSpec(ModuleFusionSpec):
    filtered_conversion_patterns = (
        r"experts\.gate_up_proj$",
        r"experts\.down_proj$",
        r"experts\.gate_up_proj_bias$",
        r"experts\.down_proj_bias$",
    )
    options_class = LinearExpertsOptions

    def child_names(self, model_type: str | None) -> tuple[str, str, str]:
        """The experts' child names: the ``child_names`` option, else the model type's entry of the table."""
        options = self.options
        if isinstance(options, LinearExpertsOptions) and options.child_names is not None:
            return options.child_names
        return expert_child_names(model_type)

    def is_fusable(self, module: nn.Module) -> bool:
        return isinstance(experts_layout(module), ExpertsLayout)

    def is_candidate(self, module: nn.Module) -> bool:
        """Every module holding 3-D ``gate_up_proj`` and ``down_proj`` parameters is an experts module this family is
        about, whether it knows its forward or not: one it leaves as it is is reported with the reason, and
        ``strict`` refuses it by name."""
        return _weights(module) is not None

    def unfusable_reason(self, module: nn.Module) -> str | None:
        found = experts_layout(module)
        return None if isinstance(found, ExpertsLayout) else found

    def make_transforms(self, config: PretrainedConfig, modules: Mapping[str, nn.Module]) -> list[WeightTransform]:
        """3-D expert keys -> per-expert keys: ``<experts>.gate_up_proj [E, 2I, H]`` is chunked into its gate rows
        (the first half, as transformers' experts read them) and up rows and split per expert; ``<experts>.down_proj
        [E, H, I]`` is split per expert.

        Per-expert keys match none of these patterns, so per-expert checkpoints load unchanged. The converters are
        ``alternative``: a model with nothing recorded (``from_config``) still saves per expert, the published layout.
        Patterns are anchored on the experts' attribute name at a key segment boundary and at the key's end, so
        ``shared_experts.*`` or ``gate_up_proj_bias`` / ``_scale_inv`` keys never match.
        """
        # The experts are built with the text config, which is what the fused class reads its child names from.
        gate, up, down = self.child_names(config.get_text_config().model_type)
        groups: dict[tuple[str, ExpertsLayout], set[int]] = defaultdict(set)
        for name, module in modules.items():
            layout = cast(ExpertsLayout, experts_layout(module))  # discovery fused only modules of a known layout
            groups[name.rpartition(".")[2], layout].add(experts_sizes(module, layout)[0])
        anchors = [anchor for anchor, _ in groups]
        if len(set(anchors)) != len(anchors):
            raise FusionError(
                f"linear_experts: experts named {sorted(a for a in anchors if anchors.count(a) > 1)[0]!r} come in "
                "different layouts in one model, which their checkpoint keys cannot tell apart; load without the "
                "linear_experts fusion."
            )
        legacy = _legacy_names(config)
        transforms: list[WeightTransform] = []
        for (anchor, layout), found in sorted(groups.items(), key=lambda item: item[0][0]):
            # The number of experts is declared (always one per model in transformers), so a 3-D tensor holding more
            # experts is a plan error rather than unused per-expert keys; the model's shapes catch any other misfit.
            split = SplitModulelist(dim=0, count=found.pop() if len(found) == 1 else None)
            # [E, in, out] weights become [E, out, in] first; interleaved gate/up rows (columns, stored) two halves.
            transpose = [Transpose(dim0=1, dim1=2)] if layout.transposed else []
            halves = [Interleave(dim=1)] if layout.gate == "interleaved" else []
            own = rf"(?<![^.]){re.escape(anchor)}\."
            for weight, operations, targets in (
                ("gate_up_proj", [*transpose, *halves, Chunk(dim=1), split], (f"{gate}.weight", f"{up}.weight")),
                ("down_proj", [*transpose, split], (f"{down}.weight",)),
                *(
                    (
                        ("gate_up_proj_bias", [*halves, Chunk(dim=1), split], (f"{gate}.bias", f"{up}.bias")),
                        ("down_proj_bias", [split], (f"{down}.bias",)),
                    )
                    if layout.bias
                    else ()
                ),
            ):
                sources: list[tuple[str, str, list[ConversionOperation]]] = [(rf"{own}{weight}$", f"{anchor}.", [])]
                sources += [entry for entry in legacy.get(weight, []) if entry[1].endswith(f"{anchor}.")]
                transforms += [
                    WeightConverter(
                        source, [f"{prefix}*.{t}" for t in targets], [*first, *operations], alternative=True
                    )
                    for source, prefix, first in sources
                ]
        return transforms

    def finish_module(self, module: nn.Module) -> None:
        """Lay the loaded experts' weights out for the grouped forward (:meth:`LinearExperts.pack`), releasing the
        checkpoint pages they were read from."""
        # Called on fused modules only, whose class derives from LinearExperts (see make_fused_class), once they hold
        # the tensors just loaded or converted, which nothing else references yet.
        cast(LinearExperts, module).pack(release_sources=True)

    def tensor_parallel_layout(
        self, module: nn.Module, rules: Mapping[str, str], ranks: int
    ) -> TensorParallelLayout | None:
        """Stock shards fused experts as gate_up packed-colwise, down rowwise, outputs summed over the ranks by the
        experts module (its ``moe_tp_experts`` rule, kept): per-expert Linears get the same shards (gate and up
        colwise, down rowwise) and run on their local tensors."""
        styles = (rules.get(""), rules.get("gate_up_proj"), rules.get("down_proj"))
        if styles == (None, None, None):
            return None
        if styles != STOCK_EXPERTS_PLAN:
            raise TensorParallelError(
                f"the TP plan shards these experts as {styles} (experts, gate_up_proj, down_proj); modelpatch's "
                f"linear_experts follow the {STOCK_EXPERTS_PLAN} plan only. Load without the linear_experts fusion."
            )
        expert = cast(LinearExperts, module)[0]
        if not isinstance(expert, ExpertMLP):
            raise TensorParallelError(f"these experts hold {type(expert).__name__}s, not modelpatch ExpertMLPs.")
        gate, up, down = expert.names
        return TensorParallelLayout(
            frozenset({"gate_up_proj", "down_proj"}),
            {
                f"*.{gate}": TensorParallelShard("colwise", local=True),
                f"*.{up}": TensorParallelShard("colwise", local=True),
                f"*.{down}": TensorParallelShard("rowwise", local=True),
            },
        )

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        spec = self
        known = forward_layout(original_cls)
        if isinstance(known, str):
            raise FusionError(
                f"linear_experts cannot fuse {original_cls.__module__}.{original_cls.__qualname__}: {known}; "
                "leave it as it is."
            )

        def __init__(self, config, *args, **kwargs):
            # Build the original without dispatch (it is the class being replaced) on meta to read its sizes.
            reference = object.__new__(original_cls)
            with torch.device("meta"):
                original_cls.__init__(reference, config, *args, **kwargs)
            layout = experts_layout(reference)
            if not isinstance(layout, ExpertsLayout):  # discovery fuses only known layouts; a direct build may not
                raise FusionError(
                    f"linear_experts cannot fuse this {original_cls.__qualname__}: {layout}; leave it as it is."
                )
            experts, hidden, intermediate = experts_sizes(reference, layout)
            LinearExperts.__init__(
                self,
                experts,
                hidden,
                intermediate,
                getattr(reference, "act_fn", None) if layout.gate == "act" else None,
                spec.child_names(getattr(config, "model_type", None)),
                device=None,
                dtype=cast(torch.Tensor, reference.gate_up_proj).dtype,
                bias=layout.bias,
                gate_fn=expert_gate(reference, layout),
            )
            # What LoRA on these experts needs to read and write stock PEFT's adapter of the stock module
            # (integrations/peft_experts.py): its layout, and whether PEFT takes its 3-D weights as [E, in, out].
            self.stock_layout = layout
            self.stock_is_transposed = bool(getattr(reference, "is_transposed", False))

        namespace: dict[str, Any] = {"__init__": __init__}
        if known.dispatched:
            namespace["forward"] = LinearExperts.forward_dispatched
        return make_class("Linear", original_cls, namespace, base=LinearExperts, spec=self)
