"""Loading and saving: ``from_pretrained``, ``from_config``, ``save_pretrained``."""

from .load import PlannedLoad, from_config, from_pretrained, load_planned, plan_pretrained
from .record import get_load_report
from .report import LoadReport
from .restructure import fuse, patch_model, unfuse
from .save import save_pretrained
from .state_dict import iter_original_state_dict

__all__ = [
    "fuse",
    "patch_model",
    "unfuse",
    "LoadReport",
    "PlannedLoad",
    "plan_pretrained",
    "load_planned",
    "from_config",
    "from_pretrained",
    "get_load_report",
    "iter_original_state_dict",
    "save_pretrained",
]
