"""Fixtures of the reliability tests: stock-saved tiny checkpoints (once per session) and process-wide state guards."""

from __future__ import annotations

import pytest
import torch
from reliability_support import Stock, build_stock
from transformers import PreTrainedModel


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
    ``torch.linspace`` process-wide (the registries are restored by the root conftest).
    """
    dtype, tie_weights, linspace = torch.get_default_dtype(), PreTrainedModel.tie_weights, torch.linspace
    yield
    torch.set_default_dtype(dtype)
    PreTrainedModel.tie_weights = tie_weights
    torch.linspace = linspace
