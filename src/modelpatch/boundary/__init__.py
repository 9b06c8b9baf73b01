"""The state-dict boundary: what stock callers (Trainer, PEFT, torch's distributed checkpoint) see of a restructured
model is its original layout: ``load_state_dict`` and ``iter_original_state_dict`` (``state_dict.py``),
``get_original_state_dict`` / ``set_original_state_dict`` (``distributed_checkpoint.py``), and PEFT's ``"all-linear"``
refused by name on a fused model (``adapters.py``). The package imports none of its modules (see
``modelpatch.loading``)."""
