"""Streamed conversion (``modelpatch convert``) writes, byte for byte, what a load followed by a save writes.

The reference is the conversion as it was done before streaming: ``from_pretrained`` of the source, then
``save_pretrained`` of that model. Sources are tiny checkpoints written by stock transformers' ``save_pretrained``.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

import modelpatch
from modelpatch.saving.convert import plan_conversion
from support.compare import module_types
from support.models import sized_config

STREAMED = "Converted"
THROUGH_A_MODEL = "converting through a loaded model"


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _assert_same_files(actual: Path, expected: Path) -> None:
    got, want = _files(actual), _files(expected)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs"


def _convert(
    source: Path,
    destination: Path,
    model_class: type,
    *,
    fusion_config=None,
    dtype="auto",
    runtime_format=False,
    max_shard_size="50GB",
    recorded_fusions=None,
) -> list[Path]:
    with plan_conversion(model_class, source, fusion_config=fusion_config, dtype=dtype) as conversion:
        return conversion.write(
            destination, runtime_format=runtime_format, max_shard_size=max_shard_size, recorded_fusions=recorded_fusions
        )


def _convert_as_load_and_save(source: Path, destination: Path, model_class: type, **options) -> list[Path]:
    """:func:`_convert` ``source`` into ``destination`` with ``options``, and assert that it wrote the files a load
    of ``source`` with the same options and a save of that model write (into ``destination`` + ``_reference``)."""
    files = _convert(source, destination, model_class, **options)
    reference = destination.with_name(f"{destination.name}_reference")
    _load_and_save(source, reference, model_class, **options)
    _assert_same_files(destination, reference)
    return files


def _load_and_save(source: Path, destination: Path, model_class: type, **options) -> list[Path]:
    """The conversion as it was done before streaming (``options``: :func:`_convert`'s, but ``recorded_fusions``)."""
    model = modelpatch.from_pretrained(
        model_class,
        source,
        fusion_config=options.get("fusion_config"),
        dtype=options.get("dtype", "auto"),
        unexpected_keys="error",
    )
    return modelpatch.save_pretrained(
        model,
        destination,
        save_original_format=not options.get("runtime_format", False),
        max_shard_size=options.get("max_shard_size", "50GB"),
    )


def _streamed(caplog) -> bool:
    messages = [record.getMessage() for record in caplog.records if record.name == "modelpatch.saving.convert"]
    return any(m.startswith(STREAMED) for m in messages) and not any(THROUGH_A_MODEL in m for m in messages)


CASES = {
    # name: (tiny checkpoint, fusions)
    "llama qkv+gate_up": ("llama", {"qkv": True, "gate_up": True}),
    "qwen2_moe all": ("qwen2_moe", {"qkv": True, "gate_up": True, "linear_experts": True}),
    "qwen2_moe linear_experts": ("qwen2_moe", {"linear_experts": True}),
    "qwen2_vl patch_embeddings": ("qwen2_vl", {"patch_embeddings": True, "qkv": True}),
    # Experts stored as 3-D tensors: the original layout of the model type (per expert) is what comes back.
    "qwen2_moe_3d linear_experts": ("qwen2_moe_3d", {"linear_experts": True}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("max_shard_size", ["50GB", "20KB"])
def test_to_the_runtime_layout_and_back_is_what_load_and_save_write(tiny, tmp_path, caplog, case, max_shard_size):
    name, fusions = CASES[case]
    ckpt = tiny(name)
    caplog.set_level(logging.INFO, logger="modelpatch.saving.convert")

    runtime = tmp_path / "runtime"
    files = _convert_as_load_and_save(
        ckpt.path, runtime, ckpt.model_class, fusion_config=fusions, runtime_format=True, max_shard_size=max_shard_size
    )
    assert _streamed(caplog)
    assert sorted(files) == sorted(runtime.iterdir())
    if max_shard_size == "20KB":
        assert (runtime / "model.safetensors.index.json").is_file()

    # Back: the runtime layout is loaded with its recorded fusions and written in the original layout.
    caplog.clear()
    back = tmp_path / "back"
    _convert_as_load_and_save(runtime, back, ckpt.model_class, max_shard_size=max_shard_size)
    assert _streamed(caplog)

    if name.endswith("_3d"):
        return
    # The original layout again, tensor for tensor (stock's own file may differ in sharding and metadata).
    restored = {}
    for path in back.glob("*.safetensors"):
        restored.update(load_file(path))
    original = {}
    for path in ckpt.path.glob("*.safetensors"):
        original.update(load_file(path))
    assert restored.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(restored[key].view(torch.uint8), tensor.view(torch.uint8)), key


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_dtype_change_and_an_original_layout_target(tiny, tmp_path, caplog, dtype):
    """Loading in another dtype casts before the conversion runs backwards: what the save of that model writes."""
    ckpt = tiny("qwen2_moe")
    caplog.set_level(logging.INFO, logger="modelpatch.saving.convert")
    fusions = {"qkv": True, "gate_up": True, "linear_experts": True}
    _convert_as_load_and_save(
        ckpt.path, tmp_path / "out", ckpt.model_class, fusion_config=fusions, dtype=dtype, max_shard_size="30KB"
    )
    assert _streamed(caplog)


def test_tied_embeddings_stream_and_an_untied_source_goes_through_a_model(stock_checkpoint, tmp_path, caplog):
    """A tied head the checkpoint does not store is left out as a save leaves it out; a checkpoint storing only the
    head fills the embedding by tying (transformers' swap at load), which only the loaded model can give."""
    ckpt = stock_checkpoint("llama_tied")
    caplog.set_level(logging.INFO, logger="modelpatch.saving.convert")
    _convert_as_load_and_save(
        ckpt.path, tmp_path / "out", ckpt.model_class, fusion_config={"qkv": True}, runtime_format=True
    )
    assert _streamed(caplog)

    head_only = tmp_path / "head_only"
    shutil.copytree(ckpt.path, head_only)
    tensors = load_file(head_only / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, head_only / "model.safetensors", metadata={"format": "pt"})
    caplog.clear()
    _convert_as_load_and_save(head_only, tmp_path / "out2", ckpt.model_class)
    assert any(
        THROUGH_A_MODEL in r.getMessage() and "model.embed_tokens.weight" in r.getMessage() for r in caplog.records
    )


def _record(directory: Path):
    return json.loads((directory / "config.json").read_text()).get("modelpatch")


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "through a model"])
def test_an_original_layout_target_records_the_fusions_asked_for(stock_checkpoint, tmp_path, caplog, streamed):
    """A runtime-layout source turned back into the original layout kept its fusion record in config.json: a later
    modelpatch load fused the checkpoint again, though `modelpatch convert RT DST --fusion none` asked for none."""
    ckpt = stock_checkpoint("llama_tied")
    runtime = tmp_path / "runtime"
    _convert(ckpt.path, runtime, ckpt.model_class, fusion_config={"qkv": True, "gate_up": True}, runtime_format=True)
    source = ckpt.path
    if not streamed:  # a head stored alone: its tied embedding is filled at load, which only a loaded model gives
        source = tmp_path / "head_only"
        shutil.copytree(ckpt.path, source)
        for directory in (source, runtime):
            with safe_open(directory / "model.safetensors", "pt") as file:
                metadata = file.metadata()
            tensors = load_file(directory / "model.safetensors")
            tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
            save_file(tensors, directory / "model.safetensors", metadata=metadata)
    caplog.set_level(logging.INFO, logger="modelpatch.saving.convert")

    _convert(runtime, tmp_path / "none", ckpt.model_class, recorded_fusions={})
    assert _streamed(caplog) is streamed
    _load_and_save(source, tmp_path / "stock_reference", ckpt.model_class, fusion_config={})
    _assert_same_files(tmp_path / "none", tmp_path / "stock_reference")
    assert _record(tmp_path / "none") is None
    reloaded = modelpatch.from_pretrained(ckpt.model_class, tmp_path / "none")
    assert module_types(reloaded) == module_types(ckpt.model_class.from_pretrained(source))  # not fused again

    _convert(runtime, tmp_path / "qkv", ckpt.model_class, recorded_fusions={"qkv": True})
    assert _record(tmp_path / "qkv") == {"version": 1, "fusion_config": {"qkv": True}}
    _convert(runtime, tmp_path / "kept", ckpt.model_class)  # not given: the source's fusions stay recorded
    assert _record(tmp_path / "kept") == {"version": 1, "fusion_config": {"qkv": True, "gate_up": True}}

    with plan_conversion(ckpt.model_class, runtime) as conversion:
        with pytest.raises(ValueError, match="original layout only"):
            conversion.write(tmp_path / "refused", runtime_format=True, recorded_fusions={})
        with pytest.raises(modelpatch.FusionError, match="Unknown fusion 'qvk'"):
            conversion.write(tmp_path / "refused", recorded_fusions={"qvk": True})
    assert not (tmp_path / "refused").exists()


def test_a_failed_conversion_leaves_the_previous_destination(tiny, tmp_path, monkeypatch):
    """A source file rewritten while it is read is refused, and DST keeps its previous checkpoint."""
    ckpt = tiny("llama")
    source = tmp_path / "src"
    shutil.copytree(ckpt.path, source)
    destination = tmp_path / "dst"
    _convert(source, destination, ckpt.model_class)
    before = _files(destination)
    with plan_conversion(ckpt.model_class, source, fusion_config={"qkv": True}) as conversion:
        with (source / "model.safetensors").open("ab") as f:
            f.write(b"\0" * 8)  # rewritten in place after its header was planned
        with pytest.raises(modelpatch.CheckpointError, match="model.safetensors"):
            conversion.write(destination, runtime_format=True)
    assert _files(destination) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


PEAK_SCRIPT = """
import json, sys
from transformers import LlamaForCausalLM
from modelpatch.saving.convert import plan_conversion

def status(name):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(name + ":"))

fusions, runtime_format = json.loads(sys.argv[3])
with plan_conversion(LlamaForCausalLM, sys.argv[1], fusion_config=fusions) as conversion:
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    conversion.write(sys.argv[2], runtime_format=runtime_format)
print(before, status("VmHWM"))
"""


def _peak_growth(source: Path, destination: Path, fusions: dict | None, runtime_format: bool) -> int:
    """How far the resident memory of a fresh process peaks, while it converts, above where it was once planned."""
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(source), str(destination), json.dumps([fusions, runtime_format])],
        capture_output=True,
        text=True,
        check=True,
    )
    before_kib, after_kib = map(int, result.stdout.split()[-2:])
    return (after_kib - before_kib) * 1024


def test_memory_holds_a_group_not_the_checkpoint(tmp_path):
    """Converting a 170 MB checkpoint into the runtime layout and back raises the peak resident memory by far less
    than its size: no tensor of it passes through the process, since the fused q/k/v and gate/up are their parts'
    bytes one after the other and the way back writes row ranges of the fused tensors, all copied file to file
    (~1 MB of growth is seen). A conversion computing one layer's fused gate/up in memory would grow by 13 MB
    (2 x 2048 x 768 fp32) and its source pages; one holding the model by all 170 MB."""
    config = sized_config("llama", vocab=256, hidden=768, intermediate=2048, layers=6, heads=8, kv_heads=8)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "src")
    size = sum(p.stat().st_size for p in (tmp_path / "src").glob("*.safetensors"))
    assert size > 150e6
    grown = _peak_growth(tmp_path / "src", tmp_path / "runtime", {"qkv": True, "gate_up": True}, True)
    assert grown < 8e6, (grown, size)
    grown = _peak_growth(tmp_path / "runtime", tmp_path / "back", None, False)
    assert grown < 8e6, (grown, size)
