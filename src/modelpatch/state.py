"""What modelpatch persists in ``config.json``: its versioned record (whose in-memory half, on the models it builds,
is :mod:`modelpatch.loading.record`).

Kept in one module so that every path that writes it (``from_pretrained``, ``from_config``, ``fuse`` / ``unfuse`` /
``patch_model``, the savers) and every path that reads it (loads, ``save_pretrained``, the command line) agree, and
so that a change of format is made, and migrated, in one place.

The config.json record is one key, ``"modelpatch"``, holding an object with a format ``version`` (like PEFT's
``peft_version`` or torchao's config ``version``)::

    "modelpatch": {"version": 1, "fusion_config": {"qkv": true}, "runtime_layout": true}

* ``fusion_config``: the fusions the model was saved with; a later modelpatch load applies them again.
* ``runtime_layout``: the tensors are in the runtime (fused, converted) layout and load without conversion. It
  describes the *files*, so it never stays on an in-memory config.

The key is written only when there is something to record, and stock transformers ignores it: a checkpoint
modelpatch writes in the original layout loads in stock transformers exactly as its tensors say.

Migration. Format version 0 (modelpatch before the record was versioned) used two flat keys,
``modelpatch_fusion_config`` and ``modelpatch_runtime_layout``; a config that has them and no record reads as version 0
with the same meaning. Every write produces the current version and removes the old keys, so loading an old
checkpoint and saving it again (or ``modelpatch convert``) migrates it. A record of a newer version than this module
knows, or one that is malformed, is a :class:`~modelpatch.errors.CheckpointError` naming the key: reading it as
something else would load the wrong tensors.

The in-memory half is one ``ModelRecord`` per model (``loading/record.py``), carrying the same
:data:`RECORD_VERSION`: what a save needs to write the model back exactly and the load report. It lives in the loading
layer because its fields are that layer's types, which this module, below every layer, cannot name.

transformers 5.23 acts on a plain ``fusion_config`` key itself (applying its own patch-embedding fusion, rejecting
names it does not know), so modelpatch reads that key for compatibility but never writes it, and removes it from the
configs of the models it builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from transformers import PretrainedConfig

from .errors import CheckpointError

RECORD_KEY = "modelpatch"
RECORD_VERSION = 1
"""The format version :func:`write_record` writes; :func:`read_record` reads it and every older one."""

# Format version 0: flat keys, read (and removed on the next write) by the migration below.
V0_FUSION_CONFIG_KEY = "modelpatch_fusion_config"
V0_RUNTIME_LAYOUT_KEY = "modelpatch_runtime_layout"
TRANSFORMERS_FUSION_CONFIG_KEY = "fusion_config"


@dataclass(frozen=True)
class ConfigRecord:
    """modelpatch's record in one config, as read (whatever its format version) or to be written.

    Attributes:
        fusion_config: The stored fusion config, as stored (``fusions/apply.py`` validates it), or None.
        runtime_layout: Whether the checkpoint's tensors are in the runtime layout.
        version: The format version it was read from (0: the flat keys before the record was versioned); records
            are always written in :data:`RECORD_VERSION`.
    """

    fusion_config: Any = None
    runtime_layout: bool = False
    version: int = RECORD_VERSION

    def to_json(self) -> dict[str, Any] | None:
        """The value of the ``"modelpatch"`` key in the current format; None when there is nothing to record."""
        fields = {"fusion_config": self.fusion_config, "runtime_layout": self.runtime_layout}
        present = {name: value for name, value in fields.items() if value not in (None, False)}
        return {"version": RECORD_VERSION, **present} if present else None


def read_record(config: PretrainedConfig) -> ConfigRecord:
    """modelpatch's record in ``config``: the versioned ``"modelpatch"`` key, else the version-0 flat keys.

    Without either, an empty record; its fusion config is transformers' own ``fusion_config`` key when there is one.

    Raises:
        CheckpointError: The record is malformed, of a version newer than :data:`RECORD_VERSION`, or stored in both
            formats at once (each named).
    """
    record = _read_own(config)
    if record.fusion_config is None and getattr(config, TRANSFORMERS_FUSION_CONFIG_KEY, None) is not None:
        return ConfigRecord(getattr(config, TRANSFORMERS_FUSION_CONFIG_KEY), record.runtime_layout, record.version)
    return record


def _read_own(config: PretrainedConfig) -> ConfigRecord:
    """The record modelpatch wrote, in whichever format version, without transformers' ``fusion_config`` key."""
    raw = getattr(config, RECORD_KEY, None)
    old_keys = [key for key in (V0_FUSION_CONFIG_KEY, V0_RUNTIME_LAYOUT_KEY) if getattr(config, key, None) is not None]
    if raw is None:
        return _migrate_v0(config)
    if old_keys:
        raise CheckpointError(
            f"config.json holds modelpatch's record both as {RECORD_KEY!r} and as {', '.join(map(repr, old_keys))} "
            f"(its format before version 1); they may disagree. Remove {', '.join(map(repr, old_keys))}."
        )
    return _parse(raw)


def _migrate_v0(config: PretrainedConfig) -> ConfigRecord:
    """Version 0: ``modelpatch_fusion_config`` and ``modelpatch_runtime_layout``, with the meanings they have now."""
    return ConfigRecord(
        fusion_config=getattr(config, V0_FUSION_CONFIG_KEY, None),
        runtime_layout=bool(getattr(config, V0_RUNTIME_LAYOUT_KEY, False)),
        version=0,
    )


def _parse(raw: Any) -> ConfigRecord:
    where = f"config.json key {RECORD_KEY!r}"
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must be an object with a 'version', got {raw!r}.")
    version = raw.get("version")
    if type(version) is not int or version < 1:
        raise CheckpointError(f"{where} must have an integer 'version' of at least 1, got {version!r}.")
    if version > RECORD_VERSION:
        raise CheckpointError(
            f"{where} is in format version {version}, written by a newer modelpatch; this one reads versions up to "
            f"{RECORD_VERSION}. Upgrade modelpatch to load this checkpoint."
        )
    unknown = sorted(set(raw) - {field.name for field in fields(ConfigRecord)})
    if unknown:
        raise CheckpointError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))} for version {version}.")
    runtime_layout = raw.get("runtime_layout", False)
    if not isinstance(runtime_layout, bool):
        raise CheckpointError(f"{where}: 'runtime_layout' must be true or false, got {runtime_layout!r}.")
    return ConfigRecord(raw.get("fusion_config"), runtime_layout, version)


def write_record(config: PretrainedConfig, record: ConfigRecord) -> None:
    """Store ``record`` in ``config`` in the current format version, replacing modelpatch's record in any format."""
    for key in (RECORD_KEY, V0_FUSION_CONFIG_KEY, V0_RUNTIME_LAYOUT_KEY):
        config.__dict__.pop(key, None)
    value = record.to_json()
    if value is not None:
        setattr(config, RECORD_KEY, value)


def stored_fusion_config(config: PretrainedConfig) -> Any:
    """The fusion config a checkpoint's config carries: modelpatch's record, else transformers' own key."""
    return read_record(config).fusion_config


def is_runtime_layout(config: PretrainedConfig) -> bool:
    """Whether the checkpoint ``config`` was read from stores its tensors in the runtime layout."""
    return read_record(config).runtime_layout


def record_fusion_config(config: PretrainedConfig, fusion_config: dict[str, Any]) -> None:
    """Leave on an in-memory ``config`` only what describes the model: its fusions, in modelpatch's record.

    The file-layout flag and transformers' own ``fusion_config`` key are removed, so that stock transformers'
    ``model.save_pretrained`` (and Trainer) write a config.json that stock transformers loads correctly.
    """
    config.__dict__.pop(TRANSFORMERS_FUSION_CONFIG_KEY, None)
    enabled = any(value is not False for value in fusion_config.values())
    write_record(config, ConfigRecord(dict(fusion_config) if enabled else None))


def record_file_layout(config: PretrainedConfig, runtime_layout: bool) -> None:
    """Mark the copy of a model's config that a save writes with the layout of the tensors written beside it (an
    older record is migrated to the current version on the way)."""
    write_record(config, ConfigRecord(_read_own(config).fusion_config, runtime_layout))


RUNTIME_LAYOUT_MARK = (
    " (a modelpatch runtime-layout checkpoint: load it with modelpatch.from_pretrained, or turn it back into the "
    "original layout with `modelpatch convert SRC DST --fusion none`)"
)
"""Appended to ``model_type`` in the config.json of a runtime-layout save, so that stock transformers refuses it by
name (an unknown model type) instead of loading it with randomly initialised fused weights.

A concrete class's ``from_pretrained`` (``LlamaForCausalLM``) only warns about another model type, so the mark also
stands in ``dtype``: every stock config looks its ``dtype`` string up in torch, and fails quoting it. The real value
follows the mark, as JSON, and :func:`unmark_runtime_layout` puts it back."""

_DTYPE_KEY = "dtype"


def mark_runtime_layout(config_json: dict[str, Any]) -> dict[str, Any]:
    """The config.json object of a runtime-layout save: its ``model_type`` and ``dtype`` marked with
    :data:`RUNTIME_LAYOUT_MARK` (the real ``dtype`` kept after the mark)."""
    marked = dict(config_json)
    marked["model_type"] = f"{marked['model_type']}{RUNTIME_LAYOUT_MARK}"
    marked[_DTYPE_KEY] = f"{RUNTIME_LAYOUT_MARK.strip()} {json.dumps(marked.get(_DTYPE_KEY))}"
    return marked


def unmark_runtime_layout(config_json: dict[str, Any]) -> dict[str, Any] | None:
    """The config.json object with its real ``model_type`` (and ``dtype``) when it carries
    :data:`RUNTIME_LAYOUT_MARK`, else None."""
    model_type = config_json.get("model_type")
    if not isinstance(model_type, str) or not model_type.endswith(RUNTIME_LAYOUT_MARK):
        return None
    unmarked = {**config_json, "model_type": model_type.removesuffix(RUNTIME_LAYOUT_MARK)}
    dtype = config_json.get(_DTYPE_KEY)
    prefix = f"{RUNTIME_LAYOUT_MARK.strip()} "
    if isinstance(dtype, str) and dtype.startswith(prefix):  # saves before the dtype mark carry a real dtype
        try:
            unmarked[_DTYPE_KEY] = json.loads(dtype.removeprefix(prefix))
        except ValueError as exc:
            raise CheckpointError(
                f"config.json's {_DTYPE_KEY!r} holds a malformed modelpatch mark: {dtype!r}."
            ) from exc
    return unmarked
