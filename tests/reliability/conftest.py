"""Fixtures of the reliability tests: stock-saved tiny checkpoints (once per session) and process-wide state guards."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from support.checkpoints import CheckpointFactory


@pytest.fixture(scope="session")
def stock(stock_checkpoint: CheckpointFactory) -> CheckpointFactory:
    """``stock("llama")``: the root ``stock_checkpoint`` fixture under the name the reliability tests use."""
    return stock_checkpoint


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
