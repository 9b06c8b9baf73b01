"""The stage interface of load modes (``loading/modes.py``) and the two-step load (``plan_pretrained`` then
``load_planned``), on a real tiny llama checkpoint written by stock ``save_pretrained``.

A toy mode records the hooks the loader calls and transforms the tensors it reads; what it does shows in the loaded
model's values, compared with the stock model loaded from the same files.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Sequence

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

import modelpatch
from modelpatch import CheckpointError, LoadPlanError, SaveError
from modelpatch.checkpoint import Checkpoint
from modelpatch.conversion.planner import ConversionGroup
from modelpatch.conversion.transforms import WeightTransform
from modelpatch.loading.materialize import set_tensor
from modelpatch.loading.plan import LoadPlan
from modelpatch.modes.base import LoadMode, Metas, TensorSource
from modelpatch.saving.plan import Rows, SavePlan
from modelpatch.saving.save import planned_save
from support.compare import assert_bitwise_equal, assert_same_files, assert_tensor_bitwise_equal

# The hooks in the order modes.py documents them, as one plain load calls them (no fusion to step aside).
DOCUMENTED_ORDER = [
    "update_dtype",
    "prepare_model",
    "plan_parameters",
    "plan",
    "wrap_source",
    "device",
    "after_load",
    "finish",
]


class ScalingMode(LoadMode):
    """Records every hook call in ``log`` (shared between modes) and multiplies every floating tensor it reads by
    ``factor`` after adding ``offset``; counts the tensors read through it."""

    name = "scaling"

    def __init__(self, log: list[str], tag: str = "", *, factor: float = 2.0, offset: float = 0.0) -> None:
        self.log, self.tag, self.factor, self.offset = log, tag, factor, offset
        self.fetched: list[str] = []
        self.saw_meta_model = False
        self.planned: LoadPlan | None = None
        self.finished: PreTrainedModel | None = None

    def _record(self, hook: str) -> None:
        self.log.append(f"{self.tag}{hook}")

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        self._record("update_dtype")
        return dtype

    def prepare_model(self, model: PreTrainedModel, *, dtype: torch.dtype, checkpoint: Checkpoint) -> None:
        self._record("prepare_model")
        self.saw_meta_model = all(p.is_meta for p in model.parameters())

    def plan_parameters(
        self, model: PreTrainedModel, checkpoint: Metas, *, dtype: torch.dtype, transforms: Sequence[WeightTransform]
    ) -> Metas:
        self._record("plan_parameters")
        return checkpoint

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        self._record("plan")
        self.planned = plan

    def wrap_source(self, source: TensorSource) -> TensorSource:
        self._record("wrap_source")

        def fetch(key: str) -> torch.Tensor:
            self.fetched.append(key)
            tensor = source.fetch(key)
            return (tensor + self.offset) * self.factor if tensor.is_floating_point() else tensor

        # New memory, not a view of the file: the loader must not drop pages through it.
        return TensorSource(fetch, lambda key: False)

    def device(self) -> torch.device | None:
        self._record("device")
        return None

    def after_load(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        self._record("after_load")

    def finish(self, model: PreTrainedModel) -> PreTrainedModel:
        self._record("finish")
        self.finished = model
        return model


class RefusingMode(ScalingMode):
    """Refuses the load when it is planned, as a mode that cannot do what it was asked must."""

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        super().plan(model, plan, checkpoint)
        raise ValueError("the refusing mode refuses this load")


def stock_state(checkpoint) -> dict[str, torch.Tensor]:
    return checkpoint.stock().state_dict()


def test_hooks_run_in_the_documented_order_and_the_wrapped_source_feeds_the_model(tiny):
    checkpoint = tiny("llama")
    log: list[str] = []
    mode = ScalingMode(log)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, load_modes=[mode])
    assert log == DOCUMENTED_ORDER
    assert mode.saw_meta_model
    assert mode.finished is model
    # Every tensor the plan reads went through the mode, once; and the model holds what the mode gave.
    assert mode.planned is not None
    assert sorted(mode.fetched) == sorted(mode.planned.conversion.direct[k] for k in mode.planned.loaded_keys())
    expected = {k: v * 2 if v.is_floating_point() else v for k, v in stock_state(checkpoint).items()}
    assert_bitwise_equal(model.state_dict(), expected)


def test_each_mode_wraps_the_previous_modes_source_in_order(tiny):
    checkpoint = tiny("llama")
    log: list[str] = []
    first, second = ScalingMode(log, "a.", factor=1.0, offset=1.0), ScalingMode(log, "b.", factor=3.0)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, load_modes=[first, second])
    assert log == [f"{tag}{hook}" for hook in DOCUMENTED_ORDER for tag in ("a.", "b.")]
    stock = stock_state(checkpoint)
    weight = "model.layers.0.self_attn.q_proj.weight"
    # second.fetch = 3 * first.fetch = 3 * (x + 1): the second mode wraps the first's source.
    assert_tensor_bitwise_equal(model.state_dict()[weight], (stock[weight] + 1.0) * 3.0, weight)


def test_a_mode_refusing_at_plan_time_stops_the_load_before_any_tensor_is_read(tiny):
    checkpoint = tiny("llama")
    log: list[str] = []
    reader, refusing = ScalingMode(log, "reader."), RefusingMode(log, "refusing.")
    with pytest.raises(ValueError, match="the refusing mode refuses this load"):
        modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, load_modes=[reader, refusing])
    assert "reader.plan" in log and "refusing.plan" in log
    assert not any(entry.endswith(("wrap_source", "after_load", "finish")) for entry in log)
    assert reader.fetched == []
    # plan_pretrained runs the same planning hooks, so it refuses the same way.
    log.clear()
    with pytest.raises(ValueError, match="the refusing mode refuses this load"):
        modelpatch.plan_pretrained(AutoModelForCausalLM, checkpoint.path, load_modes=[RefusingMode(log)])
    assert log == DOCUMENTED_ORDER[:4]


def test_load_modes_must_be_load_modes(tiny):
    with pytest.raises(TypeError, match="load_modes must be a list of modelpatch LoadMode instances"):
        modelpatch.from_pretrained(AutoModelForCausalLM, tiny("llama").path, load_modes=[object()])


@pytest.mark.parametrize("fusion_config", [None, {"qkv": True, "gate_up": True}])
def test_plan_then_load_equals_from_pretrained_bitwise(tiny, fusion_config):
    checkpoint = tiny("llama")
    plan = modelpatch.plan_pretrained(AutoModelForCausalLM, checkpoint.path, fusion_config=fusion_config)
    assert all(p.is_meta for p in plan.model.parameters())  # planning read no tensor data
    model = modelpatch.load_planned(plan)
    direct = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, fusion_config=fusion_config)
    assert model is plan.model
    assert_bitwise_equal(model.state_dict(), direct.state_dict())
    assert modelpatch.get_load_report(model).summary() == modelpatch.get_load_report(direct).summary()
    assert model.generation_config.to_dict() == direct.generation_config.to_dict()
    with torch.no_grad():
        assert torch.equal(model(**checkpoint.inputs()).logits, direct(**checkpoint.inputs()).logits)
    with pytest.raises(ValueError, match="a plan loads once"):
        modelpatch.load_planned(plan)


def test_the_two_step_load_runs_the_modes_hooks_split_at_the_plan(tiny):
    checkpoint = tiny("llama")
    log: list[str] = []
    plan = modelpatch.plan_pretrained(AutoModelForCausalLM, checkpoint.path, load_modes=[ScalingMode(log)])
    assert log == DOCUMENTED_ORDER[:4]
    model = modelpatch.load_planned(plan)
    assert log == DOCUMENTED_ORDER
    expected = {k: v * 2 if v.is_floating_point() else v for k, v in stock_state(checkpoint).items()}
    assert_bitwise_equal(model.state_dict(), expected)


class OfferedMode(LoadMode):
    """Takes no group and no tensor (the hooks' defaults), recording what it is offered."""

    def __init__(self) -> None:
        self.groups: list[tuple[str, ...]] = []
        self.placed: list[str] = []

    def run_group(self, group: ConversionGroup, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor] | None:
        self.groups.append(tuple(group.target_keys()))
        return super().run_group(group, fetch)

    def place(self, key: str, value: torch.Tensor) -> bool:
        self.placed.append(key)
        return super().place(key, value)


class NegatingGroups(LoadMode):
    """Converts every group itself, negating its outputs; ``taken`` names the groups it ran."""

    def __init__(self) -> None:
        self.taken: list[tuple[str, ...]] = []

    def run_group(self, group: ConversionGroup, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor] | None:
        self.taken.append(tuple(group.target_keys()))
        return {key: -value for key, value in group.run(fetch).items()}


class PlacingDownProjections(LoadMode):
    """Places every ``down_proj.weight`` itself, plus one, on the model it is planned into."""

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        self.model = model

    def place(self, key: str, value: torch.Tensor) -> bool:
        if not key.endswith("down_proj.weight"):
            return False
        set_tensor(self.model, key, value + 1)
        return True


FUSED = {"qkv": True, "gate_up": True}


def test_modes_taking_no_group_and_no_tensor_leave_the_load_as_it_is(tiny):
    checkpoint = tiny("llama")
    mode = OfferedMode()
    plan = modelpatch.plan_pretrained(AutoModelForCausalLM, checkpoint.path, fusion_config=FUSED, load_modes=[mode])
    model = modelpatch.load_planned(plan)
    direct = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, fusion_config=FUSED)
    assert_bitwise_equal(model.state_dict(), direct.state_dict())
    # Every converted group and every loaded tensor was offered to the mode, once.
    assert mode.groups == [tuple(group.target_keys()) for group in plan.conversion.groups]
    assert sorted(mode.placed) == sorted(plan.loaded_keys())


def test_the_last_mode_taking_a_group_or_a_tensor_decides_how_it_lands(tiny):
    checkpoint = tiny("llama")
    first, last = NegatingGroups(), NegatingGroups()
    plan = modelpatch.plan_pretrained(
        AutoModelForCausalLM, checkpoint.path, fusion_config=FUSED, load_modes=[first, last, PlacingDownProjections()]
    )
    model = modelpatch.load_planned(plan)
    direct = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, fusion_config=FUSED).state_dict()
    grouped = {key for group in plan.conversion.groups for key in group.target_keys()}
    assert grouped and first.taken == [] and len(last.taken) == len(plan.conversion.groups)
    expected = {
        key: -value if key in grouped else value + 1 if key.endswith("down_proj.weight") else value
        for key, value in direct.items()
    }
    assert_bitwise_equal(model.state_dict(), expected)


def test_errors_are_raised_when_planning(tiny, tmp_path):
    source = tiny("llama")
    directory = tmp_path / "incomplete"
    shutil.copytree(source.path, directory)
    (weights,) = directory.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(LoadPlanError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        modelpatch.plan_pretrained(AutoModelForCausalLM, directory)
    with pytest.raises(ValueError, match="Pass either device or device_map, not both"):
        modelpatch.plan_pretrained(AutoModelForCausalLM, source.path, device="cpu", device_map="cpu")


def test_a_checkpoint_changed_since_it_was_planned_is_refused(tiny, tmp_path):
    source = tiny("llama")
    directory = tmp_path / "changing"
    shutil.copytree(source.path, directory)
    plan = modelpatch.plan_pretrained(AutoModelForCausalLM, directory)
    (weights,) = directory.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"changed since it was planned .*model\.norm\.weight"):
        modelpatch.load_planned(plan)
    assert not plan.loaded


class RoundTripMode(ScalingMode):
    """Doubles every floating tensor at load and halves each on its way out when the model is saved (both exact in
    binary); notes each runtime key its save hook was called for."""

    def __init__(self, log: list[str], *, refuse: str | None = None) -> None:
        super().__init__(log)
        self.saved: list[str] = []
        self.refuse = refuse

    def plan_save(self, plan: SavePlan) -> None:
        self._record("plan_save")
        if self.refuse is not None:
            raise SaveError(self.refuse)

    def save_tensor(self, plan: SavePlan, key: str, tensor: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        self.saved.append(key)
        return tensor / self.factor if tensor.is_floating_point() else tensor


def test_a_save_runs_the_save_hooks_of_the_modes_the_model_was_loaded_with(tiny, tmp_path):
    checkpoint = tiny("llama")
    log: list[str] = []
    mode = RoundTripMode(log)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, load_modes=[mode])
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert log[-1] == "plan_save"
    # The per-tensor hook saw every tensor the save wrote, once, and its halved tensors are the checkpoint's: the save
    # wrote the files it was loaded from.
    assert sorted(mode.saved) == sorted(load_file(next((tmp_path / "saved").glob("*.safetensors"))))
    assert_same_files(tmp_path / "saved", checkpoint.path)
    # A copy of the model shares the modes that loaded it.
    mode.saved.clear()
    modelpatch.save_pretrained(copy.deepcopy(model), tmp_path / "copied")
    assert log[-1] == "plan_save" and mode.saved
    assert_same_files(tmp_path / "copied", checkpoint.path)


def test_every_door_of_a_save_runs_the_per_tensor_hook(tiny, tmp_path):
    """The stream, stock ``model.save_pretrained`` and a fused model's reverse conversions read the tensors through
    the same hook: each tensor leaves the model transformed, before its group is converted back."""
    checkpoint = tiny("llama")
    mode = RoundTripMode([])
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, checkpoint.path, fusion_config={"qkv": True}, load_modes=[mode]
    )
    streamed = dict(modelpatch.iter_original_state_dict(model))
    layout = planned_save(model).layout
    runtime = [*layout.direct.values(), *(key for group in layout.groups for key in group.source_keys())]
    assert any("qkv_proj" in key for key in runtime)
    assert sorted(mode.saved) == sorted(runtime)  # each once, fused ones before their reverse split them
    assert_bitwise_equal(streamed, load_file(next(checkpoint.path.glob("*.safetensors"))))
    mode.saved.clear()
    model.save_pretrained(tmp_path / "stock")
    assert mode.saved
    assert_bitwise_equal(load_file(next((tmp_path / "stock").glob("*.safetensors"))), streamed)


def test_a_mode_refusing_in_the_save_plan_leaves_nothing_written(tiny, tmp_path):
    checkpoint = tiny("llama")
    mode = RoundTripMode([])
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, load_modes=[mode])
    mode.refuse = "the scaling mode refuses this save"
    target = tmp_path / "refused"
    with pytest.raises(SaveError, match="the scaling mode refuses this save"):
        modelpatch.save_pretrained(model, target)
    assert not target.exists() and not list(tmp_path.iterdir())
    assert mode.saved == []  # refused before any tensor was read
    with pytest.raises(SaveError, match="the scaling mode refuses this save"):
        next(modelpatch.iter_original_state_dict(model))
    assert mode.saved == []
