"""torch.compile smoke tests: models built inside a patch scope compile and match eager outputs.

Llama's forward builds a module on every call (``self.layers[: n]`` slices a ``ModuleList``), so these also check that
the ``nn.Module.__new__`` dispatcher is traceable by dynamo, including with ``fullgraph=True``.
"""

from __future__ import annotations

import pytest
import torch

import modelpatch
from support.patching import MarkedLlamaAttention, MarkedLlamaMLP, WrappedLlamaAttention, input_ids, llama_config


def _compile_available() -> bool:
    try:
        return hasattr(torch, "compile") and torch._dynamo.is_dynamo_supported()
    except Exception:  # noqa: BLE001 - any failure to import dynamo means no compile
        return False


pytestmark = [
    pytest.mark.skipif(not _compile_available(), reason="torch.compile is not available on this platform"),
    pytest.mark.slow,
]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("mapping", "fullgraph"),
    [
        ({"LlamaAttention": MarkedLlamaAttention, "LlamaMLP": MarkedLlamaMLP}, False),
        ({"LlamaAttention": WrappedLlamaAttention, "LlamaMLP": MarkedLlamaMLP}, True),
    ],
    ids=["subclass", "wrapper-fullgraph"],
)
def test_patched_model_runs_under_torch_compile(mapping, fullgraph):
    from transformers import LlamaForCausalLM

    modelpatch.register_patch_mapping(mapping)
    torch.manual_seed(0)
    with modelpatch.apply_patches():
        model = LlamaForCausalLM(llama_config()).eval()
    assert {type(layer.self_attn) for layer in model.model.layers} == {mapping["LlamaAttention"]}

    ids = input_ids()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
        # Run both inside a scope (the dispatcher is installed and active) and outside it.
        with modelpatch.apply_patches():
            inside = compiled(ids).logits
        outside = compiled(ids).logits
    torch.testing.assert_close(inside, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outside, eager, rtol=1e-5, atol=1e-5)
    # Compiling did not change the model's classes.
    assert {type(layer.self_attn) for layer in model.model.layers} == {mapping["LlamaAttention"]}
