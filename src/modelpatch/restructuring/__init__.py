"""Restructuring a model in memory: ``fuse``, ``unfuse`` and ``patch_model`` (``restructure.py``), planned first, then
executed through the load's fill stage. The package imports none of its modules (see ``modelpatch.loading``)."""
