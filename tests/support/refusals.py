"""What a refused load says: the :class:`~modelpatch.errors.CheckpointError` a load of a causal LM raises."""

from __future__ import annotations

from os import PathLike
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch.errors import CheckpointError


def refused_load(source: str | PathLike[str], match: str | None = None, **kwargs: Any) -> str:
    """The message of the :class:`CheckpointError` that ``modelpatch.from_pretrained(AutoModelForCausalLM, source,
    **kwargs)`` raises; the test fails where it raises none, or one whose message does not match ``match``."""
    with pytest.raises(CheckpointError, match=match) as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, source, **kwargs)
    return str(info.value)
