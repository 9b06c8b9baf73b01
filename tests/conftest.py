"""Shared test fixtures: every test starts and ends with an empty global patch registry."""

from __future__ import annotations

import pytest
import transformers

import modelpatch

transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _clean_patch_registry():
    modelpatch.clear_patch_mapping()
    yield
    modelpatch.clear_patch_mapping()
