"""Helpers of the reliability tests: stock-saved checkpoints, bitwise comparisons, directory snapshots.

Every checkpoint is written by stock transformers' own ``save_pretrained`` (no hub, no mocks); parameters are perturbed
first so that a mix-up (q/k/v, experts, a tied head left random) shows in the values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, PreTrainedModel

VOCAB = 128
SIBLING_MARKERS = (".modelpatch-tmp-", ".modelpatch-old-")


def llama_kwargs(**overrides: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        **overrides,
    }


SPECS: dict[str, tuple[str, type, dict[str, Any], dict[str, Any]]] = {
    # name: (model_type, Auto class, config kwargs, save_pretrained kwargs)
    "llama": ("llama", AutoModelForCausalLM, llama_kwargs(), {}),
    "llama_sharded": ("llama", AutoModelForCausalLM, llama_kwargs(), {"max_shard_size": "40KB"}),
    "llama_bf16": ("llama", AutoModelForCausalLM, llama_kwargs(), {}),
    "qwen2_moe": (
        "qwen2_moe",
        AutoModelForCausalLM,
        llama_kwargs(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     shared_expert_intermediate_size=48),
        {},
    ),
    # BERT's MLM decoder is tied to the word embeddings: a load that forgets to tie gives a random head.
    "bert": (
        "bert",
        AutoModelForMaskedLM,
        {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "max_position_embeddings": 64},
        {},
    ),
}


@dataclass(frozen=True)
class Stock:
    name: str
    path: Path
    model_class: type

    def inputs(self) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(sum(map(ord, self.name)))
        return {"input_ids": torch.randint(0, VOCAB - 8, (2, 12), generator=generator)}

    def reference_logits(self) -> torch.Tensor:
        """Logits of stock transformers' own ``from_pretrained`` of this checkpoint."""
        model = self.model_class.from_pretrained(self.path).eval()
        with torch.no_grad():
            return model(**self.inputs()).logits


def perturb(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.add_(noise.to(param.dtype) * 0.05)


def build_stock(root: Path, name: str) -> Stock:
    model_type, model_class, kwargs, save_kwargs = SPECS[name]
    seed = sum(map(ord, name))
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if name.endswith("bf16") else None
    model = model_class.from_config(AutoConfig.for_model(model_type, **kwargs), **({"dtype": dtype} if dtype else {}))
    perturb(model, seed)
    path = root / name
    model.save_pretrained(path, **save_kwargs)
    return Stock(name, path, model_class)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of ``directory``, read eagerly."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as integers of its item size: comparison that is exact for NaNs and -0.0."""
    tensor = tensor.detach().cpu()
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
    else:  # a standard-strided, aligned copy
        flat = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor).reshape(-1)
    if tensor.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_SAME_SIZE_INT[flat.element_size()])


def assert_tensors_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, dtypes, shapes and bytes."""
    assert sorted(actual) == sorted(expected), (
        f"only in actual: {sorted(actual.keys() - expected.keys())[:5]}; "
        f"only in expected: {sorted(expected.keys() - actual.keys())[:5]}"
    )
    for key, e in expected.items():
        a = actual[key]
        assert (a.dtype, tuple(a.shape)) == (e.dtype, tuple(e.shape)), f"{key}: {a.dtype}{tuple(a.shape)} != ..."
        assert torch.equal(bits(a), bits(e)), f"{key}: values differ"


def tensors_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    try:
        assert_tensors_identical(actual, expected)
    except AssertionError:
        return False
    return True


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``directory`` (and the directory itself) -> (kind, size, mtime_ns): any write shows."""
    directory = Path(directory)
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in [".", *dirs, *files]:
            path = Path(root) / name
            st = path.lstat()
            out[str(path.relative_to(directory))] = (st.st_mode >> 12, st.st_size, st.st_mtime_ns)
    return out


def siblings(directory: Path) -> list[str]:
    """Temporary or previous-version directories a save left next to ``directory``."""
    directory = Path(directory)
    return sorted(
        p.name
        for p in directory.parent.iterdir()
        if p.name.startswith(f".{directory.name}.") and any(m in p.name for m in SIBLING_MARKERS)
    )
