"""The files of a checkpoint directory, named and read without torch: the layouts' file names, a shard index's
``weight_map``, and the bound on a safetensors header.

Kept apart from :mod:`~modelpatch.checkpoint.checkpoint` (which maps tensors, and so imports torch) for the code that
must run before torch is imported: the checkpoint prefetch starts at the top of ``from_pretrained``, while torch and
transformers are still being imported.
"""

from __future__ import annotations

from pathlib import Path

from modelpatch.errors import CheckpointError

from .json_file import MAX_INDEX_BYTES, read_json

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"

MAX_HEADER_BYTES = 100_000_000
"""Upper bound on a safetensors file's JSON header length; the safetensors reference implementation uses the same."""


def read_weight_map(index_path: Path, fd: int | None = None) -> dict[str, str]:
    """The ``weight_map`` of shard index ``index_path`` (read from ``fd``, which is then closed, when given), read
    with the bounds of :func:`~modelpatch.checkpoint.json_file.read_json` before it is parsed.

    Raises:
        CheckpointError: naming the index, when it is too large, nests too deeply, is not JSON or has no
            ``weight_map`` of tensor key to shard file name.
    """
    index = read_json(index_path, MAX_INDEX_BYTES, fd)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index_path}: 'weight_map' must be a JSON object of tensor key to shard file name")
    return weight_map
