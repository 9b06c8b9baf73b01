"""save_pretrained: the checkpoint layout (every conversion reversed), the runtime layout, atomicity."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, BertForSequenceClassification

import modelpatch
from modelpatch import CheckpointError
from modelpatch.checkpoint import writer
from modelpatch.state import RECORD_KEY, unmark_runtime_layout
from support.checkpoints import STOCK_CHECKPOINTS
from support.compare import assert_bitwise_equal, bits
from support.files import config_json, read_tensors


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ------------------------------------------------------------------------------------------------- config files


@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "qwen2_vl"])
def test_config_and_generation_config_written_like_stock(stock_checkpoint, tmp_path, name):
    ckpt = stock_checkpoint(name)
    model = modelpatch.from_pretrained(ckpt.model_class, ckpt.path)
    files = modelpatch.save_pretrained(model, tmp_path / "out")
    assert {f.name for f in files} == {p.name for p in ckpt.path.iterdir()}
    # config.json as stock writes it after a stock load (which records the dtype on sub-configs too).
    stock_dir = tmp_path / "stock"
    ckpt.model_class.from_pretrained(ckpt.path).save_pretrained(stock_dir)
    assert config_json(tmp_path / "out") == config_json(stock_dir)
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == json.loads(
        (ckpt.path / "generation_config.json").read_text()
    )


def test_save_writes_modified_weights(stock_checkpoint, tmp_path):
    """The save reads the live parameters (converted and zero-copy ones), never the source file."""
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj[1, 40].fill_(3.0)  # expert 1, a row of up_proj
        model.model.norm.weight.fill_(-2.0)
    modelpatch.save_pretrained(model, tmp_path / "out")
    saved, source = read_tensors(tmp_path / "out"), ckpt.tensors()
    assert torch.equal(saved["model.layers.0.mlp.experts.1.up_proj.weight"][40 - 32], torch.full((64,), 3.0))
    assert torch.equal(saved["model.norm.weight"], torch.full((64,), -2.0))
    changed = {k for k in source if not torch.equal(bits(saved[k]), bits(source[k]))}
    assert changed == {"model.layers.0.mlp.experts.1.up_proj.weight", "model.norm.weight"}


def test_save_over_the_checkpoint_it_was_loaded_from(stock_checkpoint, tmp_path):
    """The model's tensors are views of the old file; replacing that directory in place must still be exact."""
    directory = tmp_path / "ckpt"
    shutil.copytree(stock_checkpoint("qwen2_moe").path, directory)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    modelpatch.save_pretrained(model, directory)
    assert_bitwise_equal(model.state_dict(), expected)  # the old mapping stays valid
    again = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    assert_bitwise_equal(again.state_dict(), expected)


def test_fused_views_of_the_file_saved_over_it(stock_checkpoint, tmp_path):
    """A ``gate_up`` weight kept as a view of the file it was loaded from (the file holds gate and up back to back),
    saved over that file: written in the original layout, exactly, and the live model is unchanged."""
    directory = tmp_path / "ckpt"
    shutil.copytree(stock_checkpoint("llama").path, directory)
    original = read_tensors(directory)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory, fusion_config={"gate_up": True})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    modelpatch.save_pretrained(model, directory)
    assert_bitwise_equal(model.state_dict(), expected)
    assert_bitwise_equal(read_tensors(directory), original)
    assert_bitwise_equal(AutoModelForCausalLM.from_pretrained(directory).state_dict(), original)


def test_sharded_save_roundtrip(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    files = modelpatch.save_pretrained(model, tmp_path / "out", max_shard_size="20KB")
    assert len([f for f in files if f.suffix == ".safetensors"]) > 3
    assert_bitwise_equal(read_tensors(tmp_path / "out"), ckpt.tensors())
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert_bitwise_equal(stock.state_dict(), model.state_dict())


# -------------------------------------------------------------------------------------------------- atomicity


def test_failed_save_leaves_previous_checkpoint_intact(stock_checkpoint, tmp_path, monkeypatch):
    ckpt = stock_checkpoint("llama_sharded")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    out = tmp_path / "out"
    modelpatch.save_pretrained(model, out, max_shard_size="40KB")
    (out / "tokenizer.json").write_text("{}")
    before = _snapshot(out)

    real_save_file = writer.save_file
    calls = []

    def failing_save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:  # two shards written, then the disk "fills up"
            raise OSError("No space left on device")
        return real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", failing_save_file)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    with pytest.raises(CheckpointError, match="No space left"):
        modelpatch.save_pretrained(model, out, max_shard_size="40KB")
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary leftovers


def test_save_that_cannot_be_reversed_fails_before_writing(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    out = tmp_path / "out"
    modelpatch.save_pretrained(model, out)
    before = _snapshot(out)
    del model.model.layers[1].mlp.experts.down_proj  # the model no longer has a converted parameter
    with pytest.raises(
        modelpatch.SaveError, match=r"model.layers.1.mlp.experts \(Qwen2MoeExperts\): down_proj is gone"
    ):
        modelpatch.save_pretrained(model, out)
    assert _snapshot(out) == before


def test_save_rejects_bad_targets(stock_checkpoint, tmp_path):
    model = modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        modelpatch.save_pretrained(model, tmp_path / "file")
    with pytest.raises(CheckpointError, match="max_shard_size"):
        modelpatch.save_pretrained(model, tmp_path / "out", max_shard_size="lots")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        modelpatch.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- runtime layout


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral", "qwen2_vl"])
def test_runtime_layout_save_and_reload(stock_checkpoint, tmp_path, name):
    ckpt = stock_checkpoint(name)
    model = modelpatch.from_pretrained(ckpt.model_class, ckpt.path)
    runtime_dir = tmp_path / "runtime"
    modelpatch.save_pretrained(model, runtime_dir, save_original_format=False)

    assert config_json(runtime_dir)[RECORD_KEY] == {"version": 1, "runtime_layout": True}
    assert_bitwise_equal(read_tensors(runtime_dir), model.state_dict())

    reloaded = modelpatch.from_pretrained(ckpt.model_class, runtime_dir)
    report = modelpatch.get_load_report(reloaded)
    assert report.runtime_layout and not report.groups
    assert_bitwise_equal(reloaded.state_dict(), model.state_dict())
    with torch.no_grad():
        assert torch.equal(reloaded(**ckpt.inputs()).logits, model(**ckpt.inputs()).logits)

    # Back to the original layout: bitwise the stock checkpoint, and the marker is gone from config.json.
    original_dir = tmp_path / "original"
    modelpatch.save_pretrained(reloaded, original_dir)
    assert_bitwise_equal(read_tensors(original_dir), ckpt.tensors())
    assert RECORD_KEY not in config_json(original_dir)
    runtime_config = config_json(runtime_dir)
    del runtime_config[RECORD_KEY]
    assert unmark_runtime_layout(runtime_config) is None  # unfused: stock's own runtime layout, left unmarked
    assert config_json(original_dir) == runtime_config


@pytest.mark.parametrize("stock_method", [False, True])
def test_stock_transformers_refuses_a_runtime_layout_by_name(tiny, tmp_path, stock_method):
    """Stock would load the fused tensors into a stock model and leave q/k/v/gate/up random: it must refuse."""
    ckpt = tiny("llama")
    model = ckpt.load({"qkv": True, "gate_up": True})
    runtime_dir = tmp_path / "runtime"
    if stock_method:
        model.save_pretrained(runtime_dir, save_original_format=False)
    else:
        modelpatch.save_pretrained(model, runtime_dir, save_original_format=False)
    assert "model.layers.0.self_attn.qkv_proj.weight" in read_tensors(runtime_dir)
    with pytest.raises(ValueError, match=r"modelpatch runtime-layout checkpoint.*modelpatch.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(runtime_dir)
    # A concrete class only warns about another model type: the mark in dtype stops it, quoted in the error.
    for stock_entry in (
        AutoConfig.from_pretrained,
        type(model).from_pretrained,
        type(model).config_class.from_pretrained,
    ):
        with pytest.raises(Exception, match=r"modelpatch runtime-layout checkpoint"):
            stock_entry(runtime_dir)
    reloaded = modelpatch.from_pretrained(AutoModelForCausalLM, runtime_dir)
    assert modelpatch.get_load_report(reloaded).runtime_layout
    assert_bitwise_equal(reloaded.state_dict(), model.state_dict())


def test_an_unfused_runtime_layout_stays_loadable_by_stock(stock_checkpoint, tmp_path):
    """Without fusions the runtime layout is stock's own (3-D experts, as stock's save_original_format=False writes):
    stock loads it, so it is not marked."""
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    assert unmark_runtime_layout(config_json(tmp_path / "runtime")) is None
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "runtime")
    assert_bitwise_equal(stock.state_dict(), model.state_dict())


def test_convert_with_fusion_none_turns_a_runtime_layout_back(tiny, tmp_path):
    from modelpatch.cli.main import main

    ckpt = tiny("llama")
    model = ckpt.load({"qkv": True, "gate_up": True})
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    assert main(["convert", str(tmp_path / "runtime"), str(tmp_path / "back"), "--fusion", "none"]) == 0
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert_bitwise_equal(stock.state_dict(), ckpt.stock().state_dict())


def test_runtime_layout_of_moe_holds_fused_experts(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    keys = set(load_file(str(tmp_path / "runtime" / "model.safetensors")))
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert not any(".experts.0." in k for k in keys)


# ----------------------------------------------------------------------------------- models never loaded


def _moe_config(name):
    return STOCK_CHECKPOINTS[name].config()


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral", "qwen3_moe", "olmoe", "qwen2_vl", "llama_tied"])
def test_from_config_saves_in_checkpoint_layout(stock_checkpoint, tmp_path, name):
    """A model built with from_config has no load record: its save runs the model type's transforms backwards."""
    ckpt = stock_checkpoint(name)
    torch.manual_seed(0)
    model = modelpatch.from_config(ckpt.model_class, AutoConfig.from_pretrained(ckpt.path))
    assert modelpatch.get_load_report(model) is None
    modelpatch.save_pretrained(model, tmp_path / "out")

    saved = read_tensors(tmp_path / "out")
    reference = ckpt.tensors()
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {k: (v.shape, v.dtype) for k, v in reference.items()}

    stock = ckpt.model_class.from_pretrained(tmp_path / "out")
    assert_bitwise_equal(stock.state_dict(), model.state_dict())
    mine = modelpatch.from_pretrained(ckpt.model_class, tmp_path / "out")
    assert_bitwise_equal(mine.state_dict(), model.state_dict())
    # Stock's own save of the same model writes the same bytes.
    stock_dir = tmp_path / "stock"
    model.save_pretrained(stock_dir)
    assert (stock_dir / "model.safetensors").read_bytes() == (tmp_path / "out" / "model.safetensors").read_bytes()


def test_from_config_applies_registered_patches(stock_checkpoint):
    class TaggedMLP(torch.nn.Module):
        def __init__(self, config, *args, **kwargs):
            super().__init__()
            self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, x):
            return self.proj(x)

    modelpatch.register_patch_mapping({"LlamaMLP": TaggedMLP})
    model = modelpatch.from_config(AutoModelForCausalLM, _moe_config("llama"), dtype=torch.bfloat16)
    assert type(model.model.layers[0].mlp) is TaggedMLP
    assert model.dtype == torch.bfloat16
    modelpatch.clear_patch_mapping()
    model = modelpatch.from_config(AutoModelForCausalLM, _moe_config("llama"))
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_task_head_model_saves_a_loadable_checkpoint(stock_checkpoint, tmp_path):
    """A BertForSequenceClassification loaded from a BertModel checkpoint, with a fresh head, saved and reloaded."""
    path = stock_checkpoint("bert_base").path
    model = modelpatch.from_pretrained(BertForSequenceClassification, path, new_parameters=["^classifier"])
    modelpatch.save_pretrained(model, tmp_path / "out")
    stock = BertForSequenceClassification.from_pretrained(tmp_path / "out")
    assert_bitwise_equal(stock.state_dict(), model.state_dict())
    again = modelpatch.from_pretrained(BertForSequenceClassification, tmp_path / "out")
    assert_bitwise_equal(again.state_dict(), model.state_dict())


def test_an_untied_head_is_saved_and_reloads_untied(stock_checkpoint, tmp_path):
    """Untie the head, change it, save: both save paths keep it, and stock and modelpatch reload it as saved."""
    ckpt = stock_checkpoint("llama_tied")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.25)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    expected = model(ids).logits
    modelpatch.save_pretrained(model, tmp_path / "modelpatch")
    model.save_pretrained(tmp_path / "stock_method")
    for directory in ("modelpatch", "stock_method"):
        for reloaded in (
            AutoModelForCausalLM.from_pretrained(tmp_path / directory),
            modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / directory),
        ):
            torch.testing.assert_close(reloaded.lm_head.weight, model.lm_head.weight, atol=0, rtol=0)
            torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- transformers' own API


@pytest.mark.parametrize("fusion_config", [None, {"qkv": True, "gate_up": True}])
def test_resized_token_embeddings_are_saved_as_stock_saves_them(tiny, tmp_path, fusion_config):
    """resize_token_embeddings (config vocab_size updated), then stock model.save_pretrained, then a stock reload."""
    ckpt = tiny("llama")
    model = ckpt.load(fusion_config)
    model.resize_token_embeddings(600, mean_resizing=False)
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 600
    reloaded = ckpt.model_class.from_pretrained(tmp_path / "out")
    stock = ckpt.model_class.from_pretrained(ckpt.path)
    stock.resize_token_embeddings(600, mean_resizing=False)
    with torch.no_grad():  # the new rows are random: take the fused model's
        stock.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight)
        stock.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight)
    assert_bitwise_equal(reloaded.state_dict(), stock.state_dict())


def test_a_new_head_and_an_untied_head_are_saved(tiny, tmp_path):
    ckpt = tiny("llama")
    model = ckpt.load({"qkv": True, "gate_up": True})
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    model.save_pretrained(tmp_path / "out")
    saved = read_tensors(tmp_path / "out")
    assert torch.equal(saved["lm_head.bias"], model.lm_head.bias.detach())
    assert torch.equal(saved["lm_head.weight"], model.lm_head.weight.detach())


def test_a_tool_substituted_module_is_still_refused_with_its_remedy(tiny, tmp_path):
    ckpt = tiny("llama")
    model = ckpt.load()

    class Wrapped(torch.nn.Module):  # a tool's wrapper, not a torch.nn class
        def __init__(self, inner):
            super().__init__()
            self.weight = torch.nn.Parameter(inner.weight.detach()[:8].clone())

    model.model.layers[0].mlp.down_proj = Wrapped(model.model.layers[0].mlp.down_proj)
    with pytest.raises(modelpatch.SaveError, match=r"(?s)down_proj \(Wrapped\): weight is \[8, 64\].*that tool's own"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shared", [True, False])
def test_a_marian_load_saves_back_its_checkpoint(tmp_path, shared):
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        pad_token_id=63,
        decoder_start_token_id=63,
        share_encoder_decoder_embeddings=shared,
    )
    torch.manual_seed(0)
    MarianMTModel(config).save_pretrained(tmp_path / "source")
    model = modelpatch.from_pretrained(MarianMTModel, tmp_path / "source")
    model.save_pretrained(tmp_path / "out")
    assert_bitwise_equal(read_tensors(tmp_path / "out"), read_tensors(tmp_path / "source"))


# ------------------------------------------------------------------------------------ one version per directory


def _changed_model(ckpt, fusion_config):
    """A modelpatch load of ``ckpt`` whose weights all differ from the checkpoint's, and its logits."""
    model = modelpatch.from_pretrained(ckpt.model_class, ckpt.path, fusion_config=fusion_config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
        expected = model(**ckpt.inputs()).logits
    return model, expected


@pytest.mark.parametrize("fusion_config", [None, {"qkv": True, "gate_up": True}])
@pytest.mark.parametrize("old_shards, new_shards", [("40KB", "50GB"), ("50GB", "40KB")])
def test_model_save_pretrained_over_the_other_shard_layout_leaves_one_version(
    stock_checkpoint, tmp_path, fusion_config, old_shards, new_shards
):
    """``model.save_pretrained`` (stock's writer, fed the original layout) over a checkpoint of the other shard layout:
    the previous version's entry file is gone, and stock and modelpatch both load the new version."""
    ckpt = stock_checkpoint("llama")
    out = tmp_path / "out"
    previous = modelpatch.from_pretrained(ckpt.model_class, ckpt.path)
    modelpatch.save_pretrained(previous, out, max_shard_size=old_shards)
    (out / "tokenizer.json").write_text("{}")
    model, expected = _changed_model(ckpt, fusion_config)
    model.save_pretrained(out, max_shard_size=new_shards)
    weights = sorted(p.name for p in out.iterdir() if p.name.startswith("model"))
    if new_shards == "50GB":
        assert weights == ["model.safetensors"]
    else:
        assert "model.safetensors" not in weights and "model.safetensors.index.json" in weights
        assert set(weights) - {"model.safetensors.index.json"} == set(
            json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()
        )
    assert (out / "tokenizer.json").read_text() == "{}"
    for reloaded in (ckpt.model_class.from_pretrained(out), modelpatch.from_pretrained(ckpt.model_class, out)):
        with torch.no_grad():
            torch.testing.assert_close(reloaded(**ckpt.inputs()).logits, expected, atol=1e-5, rtol=0)


def test_a_modelpatch_save_over_an_older_pickle_checkpoint_leaves_one_version(stock_checkpoint, tmp_path):
    """A ``pytorch_model.bin`` left by an older save is a previous version of the weights, not a user file."""
    ckpt = stock_checkpoint("llama")
    out = tmp_path / "out"
    shutil.copytree(ckpt.path, out)
    torch.save(ckpt.tensors(), out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    model, _ = _changed_model(ckpt, None)
    modelpatch.save_pretrained(model, out)
    assert not (out / "pytorch_model.bin").exists()


def _both_entry_files(ckpt, tmp_path, single_from):
    """``ckpt`` saved sharded, with the ``model.safetensors`` of directory ``single_from`` beside its index."""
    out = tmp_path / "both"
    modelpatch.save_pretrained(modelpatch.from_pretrained(ckpt.model_class, ckpt.path), out, max_shard_size="40KB")
    shutil.copy(single_from / "model.safetensors", out / "model.safetensors")
    return out


def test_a_load_finding_two_versions_names_both_entry_files(stock_checkpoint, tmp_path):
    """A ``model.safetensors`` of another version beside an index (left by an older stock save): stock would read
    the one, modelpatch the other; refused, naming both."""
    ckpt = stock_checkpoint("llama")
    model, _ = _changed_model(ckpt, None)
    modelpatch.save_pretrained(model, tmp_path / "other")
    out = _both_entry_files(ckpt, tmp_path, tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"two checkpoints of different versions.*index.json.*model.safetensors"):
        modelpatch.from_pretrained(ckpt.model_class, out)


def test_a_stale_index_beside_a_single_file_is_named_as_such(stock_checkpoint, tmp_path):
    """An index whose shards a later save of one file removed: the error names the single file beside it."""
    ckpt = stock_checkpoint("llama")
    out = _both_entry_files(ckpt, tmp_path, ckpt.path)
    for shard in out.glob("model-*.safetensors"):
        shard.unlink()
    with pytest.raises(CheckpointError, match=r"does not exist.*also holds model.safetensors.*stale"):
        modelpatch.from_pretrained(ckpt.model_class, out)


def test_a_single_file_holding_the_index_tensors_loads(stock_checkpoint, tmp_path):
    """Both layouts of the same tensors (a repository uploaded twice): one version, loaded."""
    ckpt = stock_checkpoint("llama")
    out = _both_entry_files(ckpt, tmp_path, ckpt.path)
    loaded = modelpatch.from_pretrained(ckpt.model_class, out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**ckpt.inputs()).logits, ckpt.reference_logits(), atol=1e-5, rtol=0)
