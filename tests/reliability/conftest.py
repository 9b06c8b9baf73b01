"""Fixtures of the reliability tests: stock-saved tiny checkpoints (once per session) and process-wide state guards."""

from __future__ import annotations

import pytest
import torch
from reliability_support import Stock, build_stock
from transformers import PreTrainedModel

from modelpatch.conversion import registry as conversion_registry
from modelpatch.fusions import registry as fusion_registry


class StockFactory:
    def __init__(self, root):
        self.root = root
        self._built: dict[str, Stock] = {}

    def __call__(self, name: str) -> Stock:
        if name not in self._built:
            self._built[name] = build_stock(self.root, name)
        return self._built[name]


@pytest.fixture(scope="session")
def stock(tmp_path_factory: pytest.TempPathFactory) -> StockFactory:
    """``stock("llama")`` -> a :class:`Stock` checkpoint written by stock ``save_pretrained`` (built once)."""
    return StockFactory(tmp_path_factory.mktemp("reliability_stock"))


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Undo what a failing test could leave behind process-wide, so that one failure does not cascade.

    transformers' init contexts swap ``torch``'s default dtype, ``PreTrainedModel.tie_weights`` and
    ``torch.linspace`` process-wide; registries are global too.
    """
    dtype, tie_weights, linspace = torch.get_default_dtype(), PreTrainedModel.tie_weights, torch.linspace
    conversions = dict(conversion_registry._mappings)
    with fusion_registry._lock:
        fusions = dict(fusion_registry._fusions)
    yield
    torch.set_default_dtype(dtype)
    PreTrainedModel.tie_weights = tie_weights
    torch.linspace = linspace
    conversion_registry._mappings.clear()
    conversion_registry._mappings.update(conversions)
    with fusion_registry._lock:
        fusion_registry._fusions.clear()
        fusion_registry._fusions.update(fusions)
