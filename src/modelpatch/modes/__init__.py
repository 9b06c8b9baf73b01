"""Load modes: how a load, and the save of what it loaded, differs (quantization, tensor parallelism, dispatch and
offload, FSDP2), expressed only through the hooks of ``LoadMode`` (``base.py``) that the pipelines call. The package
imports none of its modules (see ``modelpatch.loading``)."""
