"""The fusion tests' names for what :mod:`support` provides (tests written before ``tests/support`` import them here).

New tests import from :mod:`support` directly.
"""

from support.checkpoints import EXPERT_NAMES, MOE_3D, VISION, CheckpointFactory, TinyCheckpoint, perturb
from support.compare import ATOL, assert_outputs_close, assert_outputs_equal, assert_same_files, module_types
from support.files import checkpoint_shapes
from support.fusions import check_fused_roundtrip
from support.models import MOE, TEXT, VOCAB

__all__ = [
    "ATOL",
    "EXPERT_NAMES",
    "MOE",
    "MOE_3D",
    "TEXT",
    "VISION",
    "VOCAB",
    "CheckpointFactory",
    "TinyCheckpoint",
    "assert_outputs_close",
    "assert_outputs_equal",
    "assert_same_files",
    "check_fused_roundtrip",
    "checkpoint_shapes",
    "module_types",
    "perturb",
]
