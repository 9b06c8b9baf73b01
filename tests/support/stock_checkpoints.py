"""The loader tests' names for what :mod:`support` provides (tests written before ``tests/support`` import them here).

New tests import from :mod:`support` directly.
"""

from support.checkpoints import STOCK_CHECKPOINTS, CheckpointFactory, TinyCheckpoint
from support.compare import assert_bitwise_equal, bits, tied_groups
from support.files import config_json, read_tensors, rewrite_checkpoint

# The names these helpers had here.
StockCheckpoint = TinyCheckpoint
assert_tensors_identical = assert_bitwise_equal

__all__ = [
    "STOCK_CHECKPOINTS",
    "CheckpointFactory",
    "StockCheckpoint",
    "TinyCheckpoint",
    "assert_bitwise_equal",
    "assert_tensors_identical",
    "bits",
    "config_json",
    "read_tensors",
    "rewrite_checkpoint",
    "tied_groups",
]
