"""The state-dict boundary: what stock callers (Trainer, PEFT, torch's distributed checkpoint) see of a restructured
model is its original layout: ``load_state_dict``, ``iter_original_state_dict``, ``get_original_state_dict`` /
``set_original_state_dict``, and PEFT's ``"all-linear"`` refused by name on a fused model."""

from .state_dict import iter_original_state_dict

__all__ = ["iter_original_state_dict"]
