"""The load: ``from_pretrained`` / ``from_config`` (``load.py``), in two steps (``plan_pretrained`` → ``load_planned``),
and what it records on the model (``record.py``). Public names are imported from ``modelpatch`` itself: the package
imports none of its modules, so that importing one of them (or of the other pipelines) never runs another first."""
