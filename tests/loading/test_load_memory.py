"""Zero-copy loading, dtype handling and the progress bar.

Zero-copy is checked against the kernel's own view of the process: a parameter read without conversion must lie
inside the memory mapping of its checkpoint file (``/proc/self/maps``), and converted parameters must not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch.fusions.linear_experts.modules import _GROUPED_MM
from modelpatch.loading import materialize
from support.compare import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges where ``path`` is memory-mapped into this process."""
    target = str(Path(path).resolve())
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def mapped_in(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(lo <= start and end <= hi for lo, hi in ranges)


def test_unconverted_parameters_are_views_of_the_mapped_file(stock_checkpoint):
    ckpt = stock_checkpoint("llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    ranges = file_mappings(ckpt.path / "model.safetensors")
    assert ranges, "the checkpoint file is memory-mapped while the model uses it"
    params = dict(model.named_parameters())
    assert len(params) == 21
    for name, param in params.items():
        assert mapped_in(param, ranges), f"{name} was copied"


def test_zero_copy_across_shards(stock_checkpoint):
    ckpt = stock_checkpoint("llama_sharded")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    ranges = [r for file in ckpt.files for r in file_mappings(file)]
    assert all(mapped_in(p, ranges) for p in model.parameters())


def test_converted_parameters_are_materialised_and_the_rest_stays_mapped(stock_checkpoint):
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    ranges = file_mappings(ckpt.path / "model.safetensors")
    converted = set(modelpatch.get_load_report(model).converted)
    assert converted
    for name, param in model.named_parameters():
        assert mapped_in(param, ranges) == (name not in converted), name
        assert param.is_contiguous()


def test_a_fused_weight_the_file_holds_back_to_back_is_a_view_of_it(stock_checkpoint):
    """``gate_up``: stock ``save_pretrained`` writes ``gate_proj`` right before ``up_proj``, so their concatenation
    along dim 0 is already in the file and is kept as a view of it. ``qkv`` is not (the file has k, o, q, v): copied.
    Either way the model computes what stock's does, and writing to it leaves the file as it was."""
    ckpt = stock_checkpoint("llama")
    before = (ckpt.path / "model.safetensors").read_bytes()
    fusions = {"qkv": True, "gate_up": True}
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, fusion_config=fusions)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    ranges = file_mappings(ckpt.path / "model.safetensors")
    for layer, stock_layer in zip(model.model.layers, stock.model.layers, strict=True):
        gate_up, qkv = layer.mlp.gate_up_proj.weight, layer.self_attn.qkv_proj.weight
        assert mapped_in(gate_up, ranges) and not mapped_in(qkv, ranges)
        stock_mlp = stock_layer.mlp
        assert torch.equal(gate_up, torch.cat([stock_mlp.gate_proj.weight, stock_mlp.up_proj.weight]))
    with torch.no_grad():
        assert torch.equal(model(**ckpt.inputs()).logits, stock(**ckpt.inputs()).logits)
        model.model.layers[0].mlp.gate_up_proj.weight.zero_()
    assert (ckpt.path / "model.safetensors").read_bytes() == before
    again = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, fusion_config=fusions)
    assert torch.equal(
        again.model.layers[0].mlp.gate_up_proj.weight[: stock.config.intermediate_size],
        stock.model.layers[0].mlp.gate_proj.weight,
    )


def test_a_fused_weight_cast_at_load_is_copied(stock_checkpoint):
    ckpt = stock_checkpoint("llama_bf16")
    fusions = {"gate_up": True}
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, fusion_config=fusions, dtype=torch.float32)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    ranges = file_mappings(ckpt.path / "model.safetensors")
    for layer, stock_layer in zip(model.model.layers, stock.model.layers, strict=True):
        gate_up = layer.mlp.gate_up_proj.weight
        assert gate_up.dtype == torch.float32 and not mapped_in(gate_up, ranges)
        assert torch.equal(gate_up, torch.cat([stock_layer.mlp.gate_proj.weight, stock_layer.mlp.up_proj.weight]))


def test_writing_to_a_loaded_parameter_never_touches_the_file(stock_checkpoint):
    ckpt = stock_checkpoint("mistral")
    before = (ckpt.path / "model.safetensors").read_bytes()
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    with torch.no_grad():
        model.model.norm.weight.fill_(7.0)
        model.lm_head.weight.zero_()
    assert (ckpt.path / "model.safetensors").read_bytes() == before
    fresh = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    assert not torch.equal(fresh.model.norm.weight, model.model.norm.weight)


def test_parameters_are_trainable_like_stock(stock_checkpoint):
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {
        n: p.requires_grad for n, p in stock.named_parameters()
    }
    model.train()
    loss = model(**ckpt.inputs(), labels=ckpt.inputs()["input_ids"]).loss
    loss.backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None
    assert model.model.embed_tokens.weight.grad is not None


# --------------------------------------------------------------------------------------------------------- dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", torch.float16])
def test_explicit_dtype_casts_like_stock(stock_checkpoint, dtype):
    ckpt = stock_checkpoint("qwen2_moe")  # float32 on disk
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, dtype=dtype)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch_dtype)
    assert model.dtype == torch_dtype
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    assert_bitwise_equal(dict(model.named_buffers()), dict(stock.named_buffers()))
    assert model.config.dtype == torch_dtype
    with torch.no_grad():
        assert torch.equal(model(**ckpt.inputs()).logits, stock(**ckpt.inputs()).logits)
    # A cast cannot be a view of the float32 file.
    ranges = file_mappings(ckpt.path / "model.safetensors")
    assert not any(mapped_in(p, ranges) for p in model.parameters())


@pytest.mark.parametrize("dtype", [None, "auto"])
def test_auto_dtype_keeps_the_checkpoint_dtype_zero_copy(stock_checkpoint, dtype):
    """None means "auto" exactly as in stock transformers 5 from_pretrained: a bf16 checkpoint loads as bf16."""
    ckpt = stock_checkpoint("llama_bf16")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, dtype=dtype)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path, **({} if dtype is None else {"dtype": dtype}))
    assert model.dtype == stock.dtype == torch.bfloat16
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    ranges = file_mappings(ckpt.path / "model.safetensors")
    assert all(mapped_in(p, ranges) for p in model.parameters())


def test_auto_dtype_without_dtype_in_config_uses_the_checkpoint_dtype(stock_checkpoint, tmp_path):
    import json
    import shutil

    directory = tmp_path / "nodtype"
    shutil.copytree(stock_checkpoint("llama_bf16").path, directory)
    config = json.loads((directory / "config.json").read_text())
    del config["dtype"]
    (directory / "config.json").write_text(json.dumps(config))
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory, dtype="auto")
    stock = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    assert model.dtype == stock.dtype == torch.bfloat16


def test_upcast_bf16_checkpoint_to_float32(stock_checkpoint):
    ckpt = stock_checkpoint("llama_bf16")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, dtype=torch.float32)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    assert model.dtype == torch.float32
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    assert model.config.dtype == stock.config.dtype == torch.float32


def test_explicit_cpu_device(stock_checkpoint):
    ckpt = stock_checkpoint("gpt2")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, device="cpu")
    assert {p.device for p in model.parameters()} | {b.device for b in model.buffers()} == {torch.device("cpu")}
    ranges = file_mappings(ckpt.path / "model.safetensors")
    assert mapped_in(model.transformer.wte.weight, ranges)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device(stock_checkpoint):
    ckpt = stock_checkpoint("qwen2_moe")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, device="cuda")
    assert {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()} == {"cuda"}
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    assert_bitwise_equal(model.state_dict(), stock.state_dict())


# -------------------------------------------------------------------------------------------------- progress bar


def test_progress_bar_only_on_large_loads(stock_checkpoint, capsys, monkeypatch):
    ckpt = stock_checkpoint("llama")
    modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    assert "Loading weights" not in capsys.readouterr().err
    monkeypatch.setattr(materialize, "PROGRESS_BAR_MIN_BYTES", 0)
    modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    assert "Loading weights" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- released source pages


def mapping_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    target, total, inside = str(Path(path).resolve()), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=5)
            if "-" in first[0] and len(first) >= 5 and ":" in first[3]:  # a mapping header line
                inside = len(first) == 6 and first[5].rstrip("\n") == target
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_pages_of_converted_sources_are_released(stock_checkpoint, monkeypatch, tmp_path):
    """Per-expert source pages do not stay resident once fused (the MoE load's peak memory depends on it)."""
    import shutil

    ckpt = stock_checkpoint("qwen2_moe_wide")  # 128 KiB per expert tensor: page effects at the edges are small
    released_dir, kept_dir = tmp_path / "released", tmp_path / "kept"
    shutil.copytree(ckpt.path, released_dir)
    shutil.copytree(ckpt.path, kept_dir)
    expert_bytes = sum(t.numel() * t.element_size() for k, t in ckpt.tensors().items() if ".experts." in k)

    released = modelpatch.from_pretrained(AutoModelForCausalLM, released_dir)
    monkeypatch.setattr(materialize, "release_pages", lambda tensor: None)
    kept = modelpatch.from_pretrained(AutoModelForCausalLM, kept_dir)
    assert mapping_rss(kept_dir / "model.safetensors") >= 0.9 * expert_bytes
    assert mapping_rss(released_dir / "model.safetensors") <= 0.2 * expert_bytes
    assert_bitwise_equal(released.state_dict(), kept.state_dict())


@pytest.mark.skipif(_GROUPED_MM is None, reason=f"torch {torch.__version__} has no grouped product: nothing is packed")
def test_pages_of_experts_packed_at_load_are_released(stock_checkpoint, monkeypatch, tmp_path):
    """``linear_experts`` loads a per-expert checkpoint without conversion, then packs the experts' weights into two
    3-D tensors (a copy): the file pages they were read from do not stay resident (the fused MoE load's peak memory
    depends on it), and what is dropped is read again from the file if touched."""
    import shutil

    from modelpatch.fusions.linear_experts import modules

    ckpt = stock_checkpoint("qwen2_moe_wide")
    released_dir, kept_dir = tmp_path / "released", tmp_path / "kept"
    shutil.copytree(ckpt.path, released_dir)
    shutil.copytree(ckpt.path, kept_dir)
    expert_bytes = sum(t.numel() * t.element_size() for k, t in ckpt.tensors().items() if ".experts." in k)
    fusions = {"linear_experts": True}

    released = modelpatch.from_pretrained(AutoModelForCausalLM, released_dir, fusion_config=fusions)
    monkeypatch.setattr(modules, "release_pages", lambda tensor: None)
    kept = modelpatch.from_pretrained(AutoModelForCausalLM, kept_dir, fusion_config=fusions)
    assert all(layer.mlp.experts._packed is not None for layer in released.model.layers)
    assert mapping_rss(kept_dir / "model.safetensors") >= 0.9 * expert_bytes
    assert mapping_rss(released_dir / "model.safetensors") <= 0.2 * expert_bytes
    assert_bitwise_equal(released.state_dict(), kept.state_dict())


def test_released_pages_are_read_again_when_a_parameter_views_them(stock_checkpoint):
    """A converter whose output is a view of its source (no copy): dropping the pages loses nothing."""
    from modelpatch import Chunk, Concatenate, Patcher, WeightConverter

    ckpt = stock_checkpoint("llama")
    split_and_join = WeightConverter(
        ["gate_proj.weight", "up_proj.weight"],
        ["gate_proj.weight", "up_proj.weight"],
        [Concatenate(dim=0), Chunk(dim=0)],
    )
    identity = WeightConverter("model.norm.weight", "model.norm.weight", [])
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, ckpt.path, patcher=Patcher(extra_weight_conversions=[identity, split_and_join])
    )
    assert len(modelpatch.get_load_report(model).groups) == 3
    assert mapped_in(model.model.norm.weight, file_mappings(ckpt.path / "model.safetensors"))
    assert_bitwise_equal(model.state_dict(), AutoModelForCausalLM.from_pretrained(ckpt.path).state_dict())
