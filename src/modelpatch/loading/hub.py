"""Where a checkpoint comes from: a local directory, or a Hugging Face Hub repository resolved into the local cache.

A path that is a directory is used as it is (``subfolder`` inside it). Anything else is a hub repo id, resolved the
way transformers' ``from_pretrained`` resolves one, through huggingface_hub:

* the revision (branch, tag, ``refs/pr/N`` or commit) is resolved to one commit first, so every file of a load comes
  from the same repository state and, once cached, is served with no call to the hub;
* only the files a load reads are fetched: ``config.json``, ``generation_config.json`` when the repository has one,
  and the weights (the safetensors index and the shards it names, or ``model.safetensors``; pickle files only with
  ``allow_pickle``), tried in the order the checkpoint reader opens a directory, so the snapshot reads as it would
  as a local directory;
* ``HF_HUB_OFFLINE=1`` or ``local_files_only=True`` serve files from the cache only.

The result is the snapshot directory (``.../models--org--name/snapshots/<commit>/[subfolder]``), whose files are
symlinks into the repository's ``blobs/``: the checkpoint reader follows those, and no others.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, is_offline_mode
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import validate_repo_id

from ..checkpoint.checkpoint import PICKLE_INDEX, PICKLE_SINGLE, SAFE_INDEX, SAFE_SINGLE, read_weight_map
from ..errors import CheckpointError

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"

# What huggingface_hub raises for a repository, revision or file it cannot serve: HTTP errors and missing entries
# (OSError, EntryNotFoundError), invalid names (ValueError).
_HUB_ERRORS = (OSError, EntryNotFoundError, ValueError)


@dataclass(frozen=True)
class HubOptions:
    """Where and how to look for a checkpoint; the meanings of transformers' ``from_pretrained`` keywords.

    Attributes:
        revision: Branch, tag, ``refs/pr/N`` or commit of a hub repository (default: its main branch). Ignored for
            a local directory, as in transformers.
        subfolder: The checkpoint's folder inside the directory or repository.
        cache_dir: The huggingface_hub cache to use instead of ``HF_HUB_CACHE``.
        token: Hub token (``True``: the one saved by ``hf auth login``).
        local_files_only: Never download: use the cache only (also forced by ``HF_HUB_OFFLINE=1``).
        force_download: Download the files again even if they are cached.
    """

    revision: str | None = None
    subfolder: str = ""
    cache_dir: str | os.PathLike[str] | None = None
    token: bool | str | None = None
    local_files_only: bool = False
    force_download: bool = False


def resolve_checkpoint(
    path_or_repo_id: str | os.PathLike[str],
    options: HubOptions = HubOptions(),
    *,
    weights: bool = True,
    allow_pickle: bool = False,
    safetensors_only: bool = False,
) -> Path:
    """The local directory holding ``config.json`` (and, with ``weights``, the files a load reads) of a checkpoint.

    Args:
        path_or_repo_id: A local checkpoint directory or a hub repo id (``"org/name"``).
        options: Revision, subfolder, cache and download settings.
        weights: Also resolve the weight files (False: ``config.json`` alone, for ``config=`` sources).
        allow_pickle: ``pytorch_model.bin`` checkpoints may be used when a repository has no safetensors weights.
        safetensors_only: Refuse checkpoints without safetensors weights (``use_safetensors=True``).

    Raises:
        CheckpointError: Neither a checkpoint directory nor a hub repository that can be resolved; the message names
            the repository, revision and file, and says what to do (download it, pass a token, go online).
    """
    local = Path(path_or_repo_id)
    if local.is_dir():
        directory = local / options.subfolder if options.subfolder else local
        if not (directory / CONFIG_NAME).is_file():
            raise CheckpointError(f"{directory} has no config.json, so it is not a transformers checkpoint directory.")
        if weights and safetensors_only and not any((directory / name).is_file() for name in (SAFE_INDEX, SAFE_SINGLE)):
            raise CheckpointError(f"{directory} has no {SAFE_INDEX} or {SAFE_SINGLE}, and use_safetensors=True.")
        return directory

    repo_id = str(path_or_repo_id)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        message = f"{repo_id!r} is not a local directory, nor a hub repo id ('name' or 'org/name')."
        raise CheckpointError(message) from None
    repository = _HubRepository(repo_id, options)
    return repository.resolve(weights=weights, allow_pickle=allow_pickle, safetensors_only=safetensors_only)


class _HubRepository:
    """One hub repository at one resolved commit, fetched file by file into the cache."""

    def __init__(self, repo_id: str, options: HubOptions) -> None:
        self.repo_id = repo_id
        self.options = options
        # As in transformers: offline mode turns every lookup into a cache lookup.
        self.local_files_only = options.local_files_only or is_offline_mode()
        if options.force_download and self.local_files_only:
            raise ValueError(f"force_download=True cannot download {repo_id}: {self._offline_reason()}.")
        self.cache_dir = Path(options.cache_dir if options.cache_dir is not None else constants.HF_HUB_CACHE)
        self.revision = options.revision or constants.DEFAULT_REVISION
        _check_revision(repo_id, self.revision)
        self._not_cached: list[str] = []  # optional files the cache lacks while the hub could not be asked

    def resolve(self, *, weights: bool, allow_pickle: bool, safetensors_only: bool) -> Path:
        commit = self._resolve_revision()
        directory = self._confined(self._fetch(CONFIG_NAME, commit).parent)
        if weights:
            self._fetch_optional(GENERATION_CONFIG_NAME, commit)
            use_pickle = allow_pickle and not safetensors_only
            self._fetch_weights(commit, allow_pickle=use_pickle, hint_pickle=not safetensors_only)
        logger.info("%s (revision %s) resolved to %s", self.repo_id, self.revision, directory)
        return directory

    def _confined(self, directory: Path) -> Path:
        """``directory`` (the snapshot folder, or a subfolder of it), refused when links take it out of this
        repository's folder of the cache: its files, and the blobs they may link to, would be another repository's."""
        folder = self.cache_dir / repo_folder_name(repo_id=self.repo_id, repo_type="model")
        target = directory.resolve()
        if not target.is_relative_to(folder.resolve()):
            raise CheckpointError(
                f"{directory}: the snapshot folder of {self._where()} resolves through a symlink to {target}, "
                f"outside {folder} (another repository's files, or none of the cache's). Nothing was read. The cache "
                f"is damaged or was tampered with: delete {directory} and download the repository again."
            )
        return directory

    def _resolve_revision(self) -> str:
        """The commit ``revision`` names, as a ``ResolvedRevision`` (its name in messages, its commit in downloads)."""
        try:
            return HfApi().resolve_revision(
                self.repo_id,
                revision=self.options.revision,
                cache_dir=self.cache_dir,
                local_files_only=self.local_files_only,
                token=self.options.token,
            )
        except RevisionResolutionError:
            raise CheckpointError(
                f"{self.repo_id!r} is not a local directory, and revision {self.revision!r} of the hub repository "
                f"{self.repo_id} is not in the cache {self.cache_dir}: {self._cache_only_reason()}. "
                f"{self._download_hint()}"
            ) from None
        except _HUB_ERRORS as exc:
            raise self._error(exc, None) from exc

    def _download(self, filename: str, commit: str) -> Path:
        return Path(
            hf_hub_download(
                self.repo_id,
                filename,
                subfolder=self.options.subfolder or None,
                revision=commit,
                cache_dir=self.cache_dir,
                token=self.options.token,
                local_files_only=self.local_files_only,
                force_download=self.options.force_download,
            )
        )

    def _fetch(self, filename: str, commit: str) -> Path:
        """The cached path of ``filename`` (inside ``subfolder``) at ``commit``, downloaded if needed."""
        try:
            return self._download(filename, commit)
        except _HUB_ERRORS as exc:
            raise self._error(exc, filename) from exc

    def _fetch_optional(self, filename: str, commit: str) -> Path | None:
        """Like :meth:`_fetch`, or None when the repository has no such file.

        Offline, a file missing from the cache counts as absent, as in transformers (the cache cannot tell a file
        that does not exist from one never downloaded).
        """
        try:
            return self._download(filename, commit)
        except LocalEntryNotFoundError:
            self._not_cached.append(filename)
            return None
        except EntryNotFoundError:
            return None
        except _HUB_ERRORS as exc:
            raise self._error(exc, filename) from exc

    def _fetch_weights(self, commit: str, *, allow_pickle: bool, hint_pickle: bool) -> None:
        """The first weight file found, in the order the checkpoint reader opens a directory, and the shards it names.

        ``hint_pickle``: say that a pickle-only checkpoint needs ``allow_pickle`` (not when safetensors are required).
        """
        candidates = [SAFE_INDEX, SAFE_SINGLE, *((PICKLE_INDEX, PICKLE_SINGLE) if allow_pickle else ())]
        for name in candidates:
            path = self._fetch_optional(name, commit)
            if path is not None:
                if name in (SAFE_INDEX, PICKLE_INDEX):
                    for shard in _shard_names(path):
                        self._fetch(shard, commit)
                return
        sentences = [f"No weights in {self._where()}: looked for {', '.join(candidates)}."]
        if hint_pickle and not allow_pickle:
            sentences.append(f"A checkpoint with only {PICKLE_SINGLE} needs allow_pickle=True.")
        if self._not_cached:
            sentences.append(
                f"Not in the cache {self.cache_dir} ({self._cache_only_reason()}): {', '.join(self._not_cached)}. "
                + self._download_hint()
            )
        raise CheckpointError(" ".join(sentences))

    def _where(self, filename: str | None = None) -> str:
        subfolder = f", subfolder {self.options.subfolder!r}" if self.options.subfolder else ""
        return f"{filename + ' of ' if filename else ''}{self.repo_id} (revision {self.revision!r}{subfolder})"

    def _offline_reason(self) -> str:
        return "HF_HUB_OFFLINE=1 is set" if is_offline_mode() else "local_files_only=True was passed"

    def _cache_only_reason(self) -> str:
        """Why only the cache was searched."""
        return self._offline_reason() if self.local_files_only else "the hub could not be reached"

    def _download_hint(self) -> str:
        download = f"hf download {self.repo_id} --revision {self.revision}"
        if self.local_files_only:
            how = "unset HF_HUB_OFFLINE" if is_offline_mode() else "drop local_files_only=True"
            return f"Download it first ({download}), or {how} to let the load download it."
        return f"Check the connection to {constants.ENDPOINT}, or fill the cache from a machine online ({download})."

    def _error(self, exc: Exception, filename: str | None) -> CheckpointError:
        """One message naming the repository, revision and file, and what to do about ``exc``."""
        where = self._where(filename)
        if isinstance(exc, GatedRepoError):
            return CheckpointError(
                f"{self.repo_id} is a gated hub repository: request access on its page, then pass token=... or log "
                "in with `hf auth login`."
            )
        if isinstance(exc, RepositoryNotFoundError):
            return CheckpointError(
                f"{self.repo_id!r} is not a local directory, nor a hub repository you can access (if it is private, "
                "pass token=... or log in with `hf auth login`)."
            )
        if isinstance(exc, RevisionNotFoundError):
            return CheckpointError(f"The hub repository {self.repo_id} has no revision {self.revision!r}.")
        if isinstance(exc, LocalEntryNotFoundError):
            return CheckpointError(
                f"{where} is not in the cache {self.cache_dir}: {self._cache_only_reason()}. {self._download_hint()}"
            )
        if isinstance(exc, EntryNotFoundError):
            return CheckpointError(f"{where} does not exist on the hub.")
        return CheckpointError(f"Could not fetch {where}: {exc}")


def _check_revision(repo_id: str, revision: str) -> None:
    """Refuse a revision with path syntax: huggingface_hub joins a revision onto the cache's ``refs/`` folder and
    reads the file it names as the commit (``../../models--org--other/refs/main``, ``/etc/hostname``).

    Branch and tag names may contain ``/`` (``refs/pr/1``, ``feature/x``), as in git; git refuses the rest too.
    """
    parts = revision.split("/")
    bad = [
        reason
        for reason, found in (
            ("an empty part (a leading, trailing or doubled '/')", not revision or "" in parts),
            ("a '.' or '..' part", any(part in (".", "..") for part in parts)),
            ("a backslash", "\\" in revision),
            ("a control character", any(ord(c) < 32 or ord(c) == 127 for c in revision)),
        )
        if found
    ]
    if bad:
        raise CheckpointError(
            f"revision {revision!r} of {repo_id} is not a branch, tag or commit name: it has {' and '.join(bad)}, "
            "which would make it a path inside (or outside) the cache rather than a name. Pass a branch, a tag, "
            "refs/pr/N or a 40-character commit hash."
        )


def _shard_names(index: Path) -> list[str]:
    """The shard file names an index maps keys to (read with bounds; the checkpoint reader validates the names)."""
    return sorted(set(read_weight_map(index).values()))
