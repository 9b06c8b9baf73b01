"""Discovery and application of the projection fusions (``qkv``, ``gate_up``) on composite transformers models.

A fusion never changes what a model computes, follows modules rather than names (each tower and layer size gets its
own converter, scoped to its module paths), and steps aside where it cannot apply: the candidates it leaves are said
once at INFO with the reason, ``strict`` turns that into an error, and a load that loads unfused never fails for it.

The tiny models are the zoo sweep's (``benchmarks/zoo.py``: every size shrunk from the type's default config), written
by stock ``save_pretrained``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import modelpatch
from modelpatch import FusionError, register_fusion
from modelpatch.fusions import QKVFusionSpec
from modelpatch.fusions.generated import fused_origin
from modelpatch.fusions.projections import FusedLinear
from support.compare import assert_outputs_close, assert_same_files
from support.files import read_tensors

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "zoo.py"
if "zoo" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("zoo", _PATH)
    sys.modules["zoo"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["zoo"])
zoo = sys.modules["zoo"]

FUSIONS = {"qkv": True, "gate_up": True}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``class name -> directory`` of a tiny model of it written by stock ``save_pretrained`` (once per module)."""
    made: dict[str, Path] = {}

    def write(name: str) -> Path:
        if name not in made:
            torch.manual_seed(0)
            with zoo._quiet():
                model = zoo._build(getattr(transformers, name))
            made[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(made[name])
        return made[name]

    return write


def _inputs(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """Inputs of a tower for its main input: token ids, an image, or audio features."""
    generator = torch.Generator().manual_seed(0)
    config = model.config
    if model.main_input_name == "input_ids":
        return {"input_ids": torch.randint(0, 64, (1, 8), generator=generator)}
    if model.main_input_name == "pixel_values":
        size = config.image_size
        return {"pixel_values": torch.randn(1, config.num_channels, size, size, generator=generator)}
    return {"input_features": torch.randn(1, config.num_mel_bins, 3000, generator=generator)}


def _towers(model: nn.Module) -> dict[str, transformers.PreTrainedModel]:
    return {name: m for name, m in model.named_children() if isinstance(m, transformers.PreTrainedModel)}


def _outputs(tower: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return tower(**inputs).last_hidden_state


def _fused(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if fused_origin(module) is not None]


# model class: (towers whose every q/k/v and gate/up candidate fuses, towers left with a reason)
COMPOSITES = {
    "Gemma3Model": (["vision_tower", "language_model"], []),  # vision q/k/v 64/64/64 beside text 64/32/32
    "PaliGemmaModel": (["vision_tower", "language_model"], []),  # a vision-language model
    "Qwen2AudioModel": (["language_model"], ["audio_tower"]),  # audio: k_proj without a bias, left with the reason
    "Aimv2Model": (["vision_model", "text_model"], []),  # encoder-only towers (CLIP-like)
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_composite_models_fuse_every_tower_bitwise(written, tmp_path, name, caplog):
    """Every tower whose projections can fuse is fused with its own sizes; each tower's outputs equal stock's; the
    save is the stock checkpoint, bit for bit, and stock loads it back to the same state."""
    path, cls = written(name), getattr(transformers, name)
    stock = cls.from_pretrained(path).eval()
    with caplog.at_level(logging.INFO, logger="modelpatch.fusions.apply"):
        model = modelpatch.from_pretrained(cls, path, fusion_config=FUSIONS).eval()
    fused_towers, unfused_towers = COMPOSITES[name]
    fused = _fused(model)
    for tower in fused_towers:
        assert any(path.startswith(f"{tower}.") for path in fused), f"nothing fused in {tower}"
    for tower in unfused_towers:
        assert not any(path.startswith(f"{tower}.") for path in fused)
        assert "as it is: k_proj has no bias while the others have one" in caplog.text
    # Towers of other sizes got other fused layers, each the concatenation of its own projections.
    sizes = {m.part_sizes for m in model.modules() if isinstance(m, FusedLinear)}
    assert len(sizes) >= 2
    for tower_name, tower in _towers(stock).items():
        inputs = _inputs(tower)
        torch.testing.assert_close(
            _outputs(getattr(model, tower_name), inputs), _outputs(tower, inputs), atol=1e-5, rtol=0
        )
    saved = tmp_path / "saved"
    modelpatch.save_pretrained(model, saved)
    assert_same_files(saved, path)
    reloaded = cls.from_pretrained(saved)
    for key, tensor in stock.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], tensor), key


def test_a_checkpoint_storing_the_projections_fused_loads_unfused_with_the_reason(written, tmp_path, caplog):
    """gte's checkpoint stores q/k/v as one ``qkv_proj`` that transformers' conversion splits: the fusion's converter
    cannot follow it, so the attention stays as it is, said once at INFO, and the load and save are stock's."""
    if not hasattr(transformers, "GteModel"):
        pytest.skip(f"transformers {transformers.__version__} has no GteModel")
    path = written("GteModel")
    with caplog.at_level(logging.INFO, logger="modelpatch.fusions.apply"):
        model = modelpatch.from_pretrained(transformers.GteModel, path, fusion_config=FUSIONS)
    assert _fused(model) == []
    assert (
        "Fusion 'qkv' found nothing to fuse in GteModel: it leaves GteAttention at layers.0.self_attn, "
        "layers.1.self_attn as it is: its q_proj comes from the model's conversion of ['attention.qkv_proj']"
    ) in caplog.text
    assert caplog.text.count("GteAttention at") == 1
    stock = transformers.GteModel.from_pretrained(path)
    for key, tensor in stock.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert_same_files(tmp_path / "saved", path)


def test_a_model_with_nothing_fusable_loads_unfused_saying_why(written, caplog):
    """BigBird rebuilds its self-attention at run time: not fused, with the reason, and the load is stock's."""
    path = written("BigBirdModel")
    with caplog.at_level(logging.INFO, logger="modelpatch.fusions.apply"):
        model = modelpatch.from_pretrained(transformers.BigBirdModel, path, fusion_config=FUSIONS)
    assert _fused(model) == []
    assert "Fusion 'qkv' found nothing to fuse in BigBirdModel: it leaves BigBirdBlockSparseAttention at" in caplog.text
    assert "set_attention_type rebuilds its self-attention at run time" in caplog.text
    assert "Fusion 'gate_up' found nothing to fuse in BigBirdModel (no candidate module)." in caplog.text
    # A short input makes BigBird switch to full attention; the save still writes the checkpoint it loaded.
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    modelpatch.save_pretrained(model, path.parent / "bigbird-saved")
    assert_same_files(path.parent / "bigbird-saved", path)


def test_strict_refuses_naming_the_modules_and_reasons(written):
    path = written("Qwen2AudioModel")
    with pytest.raises(FusionError) as raised:
        modelpatch.from_pretrained(transformers.Qwen2AudioModel, path, fusion_config={"qkv": {"strict": True}})
    message = str(raised.value)
    assert "Fusion 'qkv' (strict) would leave 2 module(s) of Qwen2AudioModel unfused" in message
    assert "Qwen2AudioAttention at audio_tower.layers.0.self_attn, audio_tower.layers.1.self_attn" in message
    assert "k_proj has no bias while the others have one" in message


def test_projections_with_state_the_fusion_does_not_know_stay_and_are_saved(written, tmp_path):
    """Qwen2-Audio's audio attention has biases on q_proj and v_proj but none on k_proj: one fused Linear cannot hold
    that, so it stays as it is and its bias tensors are in the save (bitwise the checkpoint)."""
    path = written("Qwen2AudioModel")
    model = modelpatch.from_pretrained(transformers.Qwen2AudioModel, path, fusion_config={"qkv": True})
    attention = model.audio_tower.layers[0].self_attn
    assert fused_origin(attention) is None and type(attention.q_proj) is nn.Linear
    assert fused_origin(model.language_model.layers[0].self_attn) is not None
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert_same_files(tmp_path / "saved", path)
    assert "audio_tower.layers.0.self_attn.q_proj.bias" in read_tensors(tmp_path / "saved")


def test_one_class_in_two_layouts_fuses_where_it_can(written):
    """Sam2's memory attention: the self-attentions fuse, the cross-attentions of the same class (keys of another
    input size) stay stock instances of it."""
    model = modelpatch.from_pretrained(
        transformers.Sam2VideoModel, written("Sam2VideoModel"), fusion_config={"qkv": True}
    )
    layer = model.memory_attention.layers[0]
    assert type(layer.cross_attn_image).__module__.startswith("transformers.")
    assert fused_origin(layer.self_attn) is not None
    assert type(layer.self_attn).__mro__[1] is type(layer.cross_attn_image)


class _NoConversions(QKVFusionSpec):
    """A fusion whose converters do not fit the checkpoint: it makes none."""

    prefix = "UnconvertedQKVFused"

    def make_transforms(self, config, modules):
        return []


def test_a_fusion_the_checkpoint_does_not_plan_into_steps_aside(tiny, caplog):
    """The fused model's keys are not in the checkpoint, while the stock model's are: the load is the stock model's,
    said at INFO; ``strict`` refuses instead, naming why."""
    register_fusion("unconverted_qkv", _NoConversions())
    ckpt = tiny("llama")
    with caplog.at_level(logging.INFO, logger="modelpatch.loading.load"):
        model = ckpt.load({"unconverted_qkv": True})
    assert _fused(model) == []
    assert "Loading LlamaForCausalLM without fusions: the checkpoint does not load into the fused model" in caplog.text
    assert "model.layers.{0..1}.self_attn.qkv_proj.weight" in caplog.text
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())
    with pytest.raises(FusionError, match=r"Fusions \['unconverted_qkv'\] \(strict\): the checkpoint does not load"):
        ckpt.load({"unconverted_qkv": {"strict": True}})


def test_a_fusion_spec_pattern_that_is_no_regex_is_refused_by_name():
    """A user's spec with a broken ``target_modules_patterns`` entry: a FusionError naming it, not re's error."""
    from modelpatch.fusions.apply import discover
    from support.patching import llama_config

    class Broken(QKVFusionSpec):
        target_modules_patterns = ("layers.(",)

    with torch.device("meta"):
        model = transformers.LlamaModel(llama_config(num_hidden_layers=1))
    with pytest.raises(FusionError, match=r"target_modules_patterns entry 'layers\.\(' is not a valid regular"):
        discover(model, {"qkv": Broken()})
