"""The save: ``save_pretrained`` (``save.py``) as stages whose hooks the modes implement, the load's mirror
(``plan.py``, ``stages.py``); the collective writer of sharded models (``sharded.py``); offline conversion
(``convert.py``). The package imports none of its modules (see ``modelpatch.loading``)."""
