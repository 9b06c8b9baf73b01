"""transformers' ``from_pretrained`` keywords: each honoured with stock's meaning (compared with stock) or refused
with the reason; unknown keywords raise ``TypeError`` naming them."""

from __future__ import annotations

import inspect
import json
import logging
import re
import shutil

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

import modelpatch
from modelpatch import CheckpointError
from modelpatch.loading import keywords
from modelpatch.loading import options as options_module
from modelpatch.loading.options import LoadOptions
from support.checkpoints import layers_on_disk
from support.compare import assert_bitwise_equal

# Private keywords of stock from_pretrained (telemetry, backward compatibility): not part of its public interface.
PRIVATE = {
    "cls",
    "pretrained_model_name_or_path",
    "model_args",
    "kwargs",
    "_from_pipeline",
    "_from_auto",
    "_commit_hash",
    "_fast_init",
}


def stock_keywords() -> set[str]:
    """Every keyword transformers' PreTrainedModel.from_pretrained takes: its signature and what it reads from
    kwargs."""
    source = inspect.getsource(PreTrainedModel.from_pretrained.__func__)
    names = set(inspect.signature(PreTrainedModel.from_pretrained).parameters)
    names |= set(re.findall(r'kwargs\.pop\("(\w+)"', source))
    names |= set(re.findall(r'if "(\w+)" in kwargs', source))
    ignored = re.search(r"for name in \[([^\]]*)\]:\s*_ = kwargs\.pop", source)
    names |= set(re.findall(r'"(\w+)"', ignored.group(1)))
    return names - PRIVATE


def test_every_stock_keyword_is_decided():
    # from_pretrained's own parameters, and the keywords it gathers into LoadOptions.
    named = set(inspect.signature(modelpatch.from_pretrained).parameters) | LoadOptions.keywords()
    undecided = stock_keywords() - named - set(keywords.NO_OPS) - set(keywords.REFUSED)
    assert not undecided, f"transformers keywords neither honoured nor refused: {sorted(undecided)}"
    assert {"attn_implementation", "torch_dtype", "revision", "output_loading_info", "low_cpu_mem_usage"} <= (
        named | set(keywords.NO_OPS)
    )


def logits(model, checkpoint):
    with torch.no_grad():
        return model(**checkpoint.inputs()).logits


# ------------------------------------------------------------------------------------------------------- honoured


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attn_implementation(stock_checkpoint, implementation):
    checkpoint = stock_checkpoint("llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, attn_implementation=implementation)
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path, attn_implementation=implementation)
    assert model.config._attn_implementation == stock.config._attn_implementation == implementation
    torch.testing.assert_close(logits(model, checkpoint), logits(stock, checkpoint), rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "no_such_attention"])
def test_unavailable_attn_implementation_fails_as_in_stock(stock_checkpoint, implementation):
    path = stock_checkpoint("llama").path
    with pytest.raises((ImportError, ValueError)) as stock:
        AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation)
    with pytest.raises(stock.type) as ours:
        modelpatch.from_pretrained(AutoModelForCausalLM, path, attn_implementation=implementation)
    assert str(ours.value) == str(stock.value)


def test_attn_implementation_reaches_sub_configs(stock_checkpoint):
    checkpoint = stock_checkpoint("qwen2_vl")
    model = modelpatch.from_pretrained(checkpoint.model_class, checkpoint.path, attn_implementation="eager")
    stock = checkpoint.model_class.from_pretrained(checkpoint.path, attn_implementation="eager")
    assert model.config.vision_config._attn_implementation == stock.config.vision_config._attn_implementation == "eager"
    assert model.config.text_config._attn_implementation == "eager"


def test_experts_implementation(stock_checkpoint):
    checkpoint = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, experts_implementation="eager")
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path, experts_implementation="eager")
    assert model.config._experts_implementation == stock.config._experts_implementation == "eager"
    torch.testing.assert_close(logits(model, checkpoint), logits(stock, checkpoint), rtol=0, atol=0)


def test_torch_dtype_is_a_deprecated_alias_of_dtype(stock_checkpoint, caplog):
    path = stock_checkpoint("llama").path
    options_module._warn_torch_dtype_deprecated.cache_clear()  # warned once per process
    with caplog.at_level(logging.WARNING, logger="modelpatch.loading.load"):
        model = modelpatch.from_pretrained(AutoModelForCausalLM, path, torch_dtype=torch.bfloat16)
    assert "`torch_dtype` is deprecated! Use `dtype` instead!" in caplog.text
    stock = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    assert model.dtype == stock.dtype == torch.bfloat16
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    # dtype wins when both are given, as in stock.
    both = modelpatch.from_pretrained(AutoModelForCausalLM, path, dtype=torch.float16, torch_dtype=torch.bfloat16)
    assert both.dtype == AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16, torch_dtype="bfloat16").dtype
    assert both.dtype == torch.float16


@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}, torch.device("cpu")])
def test_single_device_map(stock_checkpoint, device_map):
    checkpoint = stock_checkpoint("llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, device_map=device_map)
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map=device_map)
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    assert hasattr(model, "hf_device_map") == hasattr(stock, "hf_device_map")
    assert_bitwise_equal(model.state_dict(), stock.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("device_map", ["cuda:0", 0, {"": "cuda:0"}])
def test_single_gpu_device_map(stock_checkpoint, device_map):
    checkpoint = stock_checkpoint("llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, device_map=device_map)
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map=device_map)
    assert {p.device for p in model.parameters()} == {torch.device("cuda:0")}
    assert_bitwise_equal(model.state_dict(), stock.state_dict())


def test_bad_device_map(stock_checkpoint):
    with pytest.raises(ValueError, match="device_map names no device: -1"):
        modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path, device_map=-1)


def test_output_loading_info_like_stock(stock_checkpoint):
    path = stock_checkpoint("llama").path
    model, info = modelpatch.from_pretrained(
        AutoModelForSequenceClassification, path, new_parameters=[r"^score\."], output_loading_info=True
    )
    stock, stock_info = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True)
    assert info == stock_info
    assert info["missing_keys"] == {"score.weight"} and info["unexpected_keys"] == {"lm_head.weight"}
    assert isinstance(model, PreTrainedModel)
    plain, plain_info = modelpatch.from_pretrained(AutoModelForCausalLM, path, output_loading_info=True)
    assert plain_info == AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)[1]


def test_low_cpu_mem_usage_is_accepted_and_changes_nothing(stock_checkpoint):
    path = stock_checkpoint("llama").path
    for value in (True, False):
        model = modelpatch.from_pretrained(AutoModelForCausalLM, path, low_cpu_mem_usage=value)
        assert_bitwise_equal(model.state_dict(), AutoModelForCausalLM.from_pretrained(path).state_dict())


def test_config_object(stock_checkpoint):
    path = stock_checkpoint("llama").path
    config = AutoConfig.from_pretrained(path)
    config.output_hidden_states = True
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, config=config, attn_implementation="eager")
    stock = AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation="eager")
    assert model.config.output_hidden_states and stock.config.output_hidden_states
    assert config._attn_implementation is None and model.config is not config  # the caller's config is not changed
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    with pytest.raises(TypeError, match=r"'output_attentions'.*set them on that config"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, config=config, output_attentions=True)


def test_config_path(stock_checkpoint, tmp_path):
    path = stock_checkpoint("llama").path
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    raw = json.loads((path / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps({**raw, "output_attentions": True}))
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, config=config_dir, attn_implementation="eager")
    # The concrete class: stock Auto classes read the config from the checkpoint path even when config= is a path.
    stock = LlamaForCausalLM.from_pretrained(path, config=str(config_dir), attn_implementation="eager")
    assert model.config.output_attentions and stock.config.output_attentions


def test_config_overrides_like_stock(stock_checkpoint):
    path = stock_checkpoint("llama").path
    model = modelpatch.from_pretrained(
        AutoModelForSequenceClassification,
        path,
        new_parameters=[r"^score\."],
        num_labels=5,
        output_attentions=True,
        attn_implementation="eager",
    )
    stock = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=5, output_attentions=True, attn_implementation="eager"
    )
    assert model.config.num_labels == stock.config.num_labels == 5
    assert model.config.id2label == stock.config.id2label
    assert model.score.weight.shape == stock.score.weight.shape == (5, 64)
    assert model.config.output_attentions and stock.config.output_attentions


def test_unknown_keyword_is_a_type_error_naming_it(stock_checkpoint):
    path = stock_checkpoint("llama").path
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'no_such_option'"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, no_such_option=1)
    # Download options transformers' config loader would swallow are not config attributes either.
    with pytest.raises(TypeError, match="'user_agent'"):
        modelpatch.AutoModelForCausalLM.from_pretrained(path, user_agent="me")


def test_generation_config(stock_checkpoint):
    path = stock_checkpoint("llama").path
    generation_config = GenerationConfig(max_new_tokens=3, do_sample=False)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, generation_config=generation_config)
    stock = AutoModelForCausalLM.from_pretrained(path, generation_config=generation_config)
    assert model.generation_config.max_new_tokens == stock.generation_config.max_new_tokens == 3


def test_use_safetensors(stock_checkpoint, tmp_path):
    path = stock_checkpoint("llama").path
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, use_safetensors=True)
    assert_bitwise_equal(model.state_dict(), AutoModelForCausalLM.from_pretrained(path).state_dict())
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(path / "config.json", pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="has no model.safetensors.index.json or model.safetensors"):
        modelpatch.from_pretrained(AutoModelForCausalLM, pickled, use_safetensors=True, allow_pickle=True)
    with pytest.raises(ValueError, match="use_safetensors=False is not supported"):
        modelpatch.from_pretrained(AutoModelForCausalLM, pickled, use_safetensors=False, allow_pickle=True)


def test_download_options_mean_nothing_for_local_directories(stock_checkpoint):
    path = stock_checkpoint("llama").path
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, path, revision="v9", token="secret", local_files_only=True, cache_dir="/nonexistent"
    )
    assert_bitwise_equal(model.state_dict(), AutoModelForCausalLM.from_pretrained(path).state_dict())


def test_offload_buffers_reaches_accelerate(stock_checkpoint, tmp_path):
    checkpoint = stock_checkpoint("llama")
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    for offload_buffers in (False, True):
        model = modelpatch.from_pretrained(
            AutoModelForCausalLM,
            checkpoint.path,
            device_map=layers_on_disk(),
            offload_folder=tmp_path / str(offload_buffers),
            offload_buffers=offload_buffers,
        )
        hooks = [module._hf_hook for module in model.modules() if hasattr(module, "_hf_hook")]
        assert hooks and {getattr(hook, "offload_buffers", False) for hook in hooks} >= {offload_buffers}
        torch.testing.assert_close(logits(model, checkpoint), logits(stock, checkpoint), atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------------------- remote code


def test_trust_remote_code(stock_checkpoint, tmp_path):
    path = stock_checkpoint("llama").path
    # No code ships with the checkpoint: nothing to trust, transformers' own class loads (as in stock).
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, trust_remote_code=True)
    assert_bitwise_equal(model.state_dict(), AutoModelForCausalLM.from_pretrained(path).state_dict())

    custom = tmp_path / "custom"
    shutil.copytree(path, custom)
    raw = json.loads((custom / "config.json").read_text())
    auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (custom / "config.json").write_text(json.dumps({**raw, "auto_map": auto_map}))
    with pytest.raises(ValueError, match=r"trust_remote_code=True asks for the modeling code.*'llama' implementation"):
        modelpatch.from_pretrained(AutoModelForCausalLM, custom, trust_remote_code=True)
    modelpatch.from_pretrained(AutoModelForCausalLM, custom)  # the built-in llama, as stock without trust

    (custom / "config.json").write_text(json.dumps({**raw, "model_type": "my_custom", "auto_map": auto_map}))
    with pytest.raises(CheckpointError, match="'my_custom', a custom model whose code ships with the checkpoint"):
        modelpatch.from_pretrained(AutoModelForCausalLM, custom, trust_remote_code=True)


# ------------------------------------------------------------------------------------------------------- refused


REFUSED_VALUES = {
    "key_mapping": {"^old": "new"},
    "state_dict": {},
    "gguf_file": "model.gguf",
    "variant": "fp16",
    "ignore_mismatched_sizes": True,
    "weights_only": False,
    "disable_mmap": True,
    "proxies": {"https": "proxy:3128"},
    "tqdm_class": object,
    "mirror": "https://mirror",
    "from_tf": True,
    "from_flax": True,
    "device_mesh": object(),
    "use_kernels": True,
    "kernel_config": object(),
    "allow_all_kernels": True,
    "adapter_kwargs": {"revision": "x"},
    "adapter_name": "mine",
}


def test_every_refused_keyword_is_tested():
    assert set(REFUSED_VALUES) == set(keywords.REFUSED)


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_refused_keyword_names_itself_and_why(stock_checkpoint, name):
    with pytest.raises(ValueError) as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path, **{name: REFUSED_VALUES[name]})
    assert str(info.value).startswith(f"{name}=") and keywords.REFUSED[name].reason in str(info.value)


def test_refused_keywords_accept_the_values_modelpatch_honours(stock_checkpoint):
    path = stock_checkpoint("llama").path
    accepted = {name: refusal.accepted[-1] for name, refusal in keywords.REFUSED.items()}
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, **accepted)
    assert_bitwise_equal(model.state_dict(), AutoModelForCausalLM.from_pretrained(path).state_dict())
