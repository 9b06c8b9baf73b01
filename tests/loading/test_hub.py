"""Loading by hub repo id from a real huggingface_hub cache layout, offline (no test reaches the network).

The cache is built on disk the way huggingface_hub lays it out: ``models--org--name/blobs/<sha256>`` holding the
files of stock ``save_pretrained`` checkpoints, ``snapshots/<commit>/`` of relative symlinks into ``../../blobs/``,
and ``refs/<name>`` holding commits. Every load is compared bitwise with stock ``from_pretrained`` of the same repo id
from the same cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch.cli.main import main as cli_main
from support.compare import assert_bitwise_equal
from support.refusals import refused_load

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
REPO = "org/tiny"


def add_snapshot(
    cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = (), subfolder: str = ""
) -> Path:
    """Put the files of checkpoint directory ``source`` in ``cache`` as huggingface_hub does; the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit / subfolder
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache that HF_HUB_CACHE points at, with the hub offline (the constants are read at import)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def two_revisions(offline_cache, stock_checkpoint) -> Path:
    """``org/tiny``: main -> commit A, a sharded checkpoint; tag v1 -> commit B, a single-file one (other weights)."""
    sharded = add_snapshot(offline_cache, REPO, stock_checkpoint("llama_sharded").path, COMMIT_A, ("main",))
    assert len(list(sharded.glob("*.safetensors"))) > 1 and all(p.is_symlink() for p in sharded.iterdir())
    add_snapshot(offline_cache, REPO, stock_checkpoint("llama").path, COMMIT_B, ("v1",))
    return offline_cache


def assert_same_as_stock(model, stock) -> None:
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    assert model.config.name_or_path == stock.config.name_or_path
    assert model.generation_config.to_dict() == stock.generation_config.to_dict()


def test_sharded_symlinked_snapshot_loads_like_stock(two_revisions):
    model = modelpatch.from_pretrained(AutoModelForCausalLM, REPO)
    stock = AutoModelForCausalLM.from_pretrained(REPO)
    assert_same_as_stock(model, stock)
    assert model.modelpatch_report.source == two_revisions / "models--org--tiny" / "snapshots" / COMMIT_A
    assert model.config.name_or_path == REPO


def test_drop_in_auto_class_and_plan_by_repo_id(two_revisions):
    model = modelpatch.AutoModelForCausalLM.from_pretrained(REPO, revision="v1", fusion_config={"qkv": True})
    stock = AutoModelForCausalLM.from_pretrained(REPO, revision="v1")
    with torch.no_grad():
        ids = torch.arange(10).reshape(1, 10)
        torch.testing.assert_close(model(ids).logits, stock(ids).logits)
    planned = modelpatch.plan_pretrained(AutoModelForCausalLM, REPO, revision="v1")
    assert planned.directory.name == COMMIT_B


@pytest.mark.parametrize("revision", ["main", "v1", COMMIT_A, COMMIT_B])
def test_revisions_give_their_own_weights(two_revisions, revision):
    model = modelpatch.from_pretrained(AutoModelForCausalLM, REPO, revision=revision)
    assert_same_as_stock(model, AutoModelForCausalLM.from_pretrained(REPO, revision=revision))


def test_the_two_revisions_differ(two_revisions):
    main = modelpatch.from_pretrained(AutoModelForCausalLM, REPO)
    v1 = modelpatch.from_pretrained(AutoModelForCausalLM, REPO, revision="v1")
    assert not torch.equal(main.lm_head.weight, v1.lm_head.weight)


def test_cache_dir_keyword(stock_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "elsewhere"
    add_snapshot(cache, REPO, stock_checkpoint("llama_sharded").path, COMMIT_A, ("main",))
    model = modelpatch.from_pretrained(AutoModelForCausalLM, REPO, cache_dir=cache)
    assert_same_as_stock(model, AutoModelForCausalLM.from_pretrained(REPO, cache_dir=cache))


def test_subfolder(offline_cache, stock_checkpoint):
    source = stock_checkpoint("llama_sharded").path
    add_snapshot(offline_cache, "org/nested", source, COMMIT_A, ("main",), subfolder="weights/llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, "org/nested", subfolder="weights/llama")
    assert_same_as_stock(model, AutoModelForCausalLM.from_pretrained("org/nested", subfolder="weights/llama"))
    refused_load("org/nested", r"config\.json of org/nested .*not in the cache")


def test_local_directory_with_subfolder(stock_checkpoint, tmp_path):
    shutil.copytree(stock_checkpoint("llama").path, tmp_path / "sub")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path, subfolder="sub")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, subfolder="sub")
    assert_bitwise_equal(model.state_dict(), stock.state_dict())


def test_missing_repo_is_a_clear_error(offline_cache):
    message = refused_load("org/missing")
    for needle in (
        "'org/missing' is not a local directory",
        "not in the cache",
        str(offline_cache),
        "HF_HUB_OFFLINE=1",
        "hf download org/missing",
    ):
        assert needle in message, message


def test_local_files_only_without_offline_mode(offline_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    refused_load("org/missing", "local_files_only=True", local_files_only=True)


def test_unreachable_hub_is_a_clear_error(offline_cache, monkeypatch):
    # Online mode against a closed local port: the hub cannot be reached (nothing leaves the machine).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    refused_load("org/missing", "hub could not be reached. Check the connection to http://127.0.0.1:9")


def test_unknown_revision_is_a_clear_error(two_revisions):
    refused_load(REPO, r"revision 'v2' of the hub repository org/tiny is not in the cache", revision="v2")


@pytest.mark.parametrize(
    "revision", ["../refs/v1", "v1/..", "../../models--org--other/refs/main", "/etc/hostname", "main\x00", "a//b", "."]
)
def test_revision_with_path_syntax_is_refused_by_name(two_revisions, stock_checkpoint, revision):
    # huggingface_hub joins the revision onto refs/ and reads the file it names as the commit.
    add_snapshot(two_revisions, "org/other", stock_checkpoint("llama").path, COMMIT_B, ("main",))
    message = refused_load(REPO, r"revision .* of org/tiny is not a branch, tag or commit name", revision=revision)
    assert repr(revision) in message


def test_revisions_with_slashes_still_resolve(two_revisions):
    (two_revisions / "models--org--tiny" / "refs" / "feature").mkdir()
    (two_revisions / "models--org--tiny" / "refs" / "feature" / "x").write_text(COMMIT_B)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, REPO, revision="feature/x")
    assert_same_as_stock(model, AutoModelForCausalLM.from_pretrained(REPO, revision="feature/x"))


def test_snapshot_directory_linked_into_another_repository_is_refused(two_revisions, stock_checkpoint):
    # The snapshot folder itself, not a file in it, leads into another repository: its files and blobs are that one's.
    other = add_snapshot(two_revisions, "org/other", stock_checkpoint("llama_sharded").path, COMMIT_B, ("main",))
    snapshot = two_revisions / "models--org--tiny" / "snapshots" / COMMIT_B
    shutil.rmtree(snapshot)
    snapshot.symlink_to(os.path.relpath(other, snapshot.parent), target_is_directory=True)
    message = refused_load(REPO, revision="v1")
    assert str(snapshot) in message and str(other) in message and "models--org--tiny" in message
    # The link stays inside the repository (a snapshot sharing another commit's folder): it is followed.
    snapshot.unlink()
    snapshot.symlink_to(COMMIT_A, target_is_directory=True)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, REPO, revision="v1")
    assert_same_as_stock(model, AutoModelForCausalLM.from_pretrained(REPO, revision="main"))


def test_shard_missing_from_the_cache_is_named(two_revisions):
    snapshot = two_revisions / "models--org--tiny" / "snapshots" / COMMIT_A
    shard = sorted(snapshot.glob("*.safetensors"))[1]
    shard.unlink()
    message = refused_load(REPO)
    assert f"{shard.name} of org/tiny (revision 'main')" in message and "not in the cache" in message


def _replace_index(two_revisions: Path, content: bytes, size: int | None = None) -> Path:
    """Give the index of ``org/tiny``'s main snapshot ``content`` (in its blob, padded sparsely to ``size``)."""
    index = two_revisions / "models--org--tiny" / "snapshots" / COMMIT_A / "model.safetensors.index.json"
    blob = index.resolve()
    blob.write_bytes(content)
    if size is not None:
        os.truncate(blob, size)  # a sparse file: no disk space, and nothing to read unless a reader reads it all
    return index


def test_hub_index_nested_past_the_parsers_recursion_limit_is_named(two_revisions):
    index = _replace_index(two_revisions, b'{"weight_map": {}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert str(index) in refused_load(REPO, "nested")


def test_hub_index_over_the_size_limit_is_refused_unread(two_revisions):
    # 1 GiB: parsed whole, it cost 2.5 GB of memory before the bound was checked.
    index = _replace_index(two_revisions, b'{"weight_map": {}}', size=2**30)
    assert str(index) in refused_load(REPO, "byte limit")


def test_no_weights_in_the_cache(offline_cache, stock_checkpoint, tmp_path):
    source = tmp_path / "config_only"
    source.mkdir()
    shutil.copy(stock_checkpoint("llama").path / "config.json", source)
    add_snapshot(offline_cache, REPO, source, COMMIT_A, ("main",))
    message = refused_load(REPO)
    assert "No weights in org/tiny (revision 'main')" in message and "allow_pickle=True" in message
    assert "model.safetensors.index.json, model.safetensors" in message


def test_pickle_repo_with_allow_pickle(offline_cache, stock_checkpoint, tmp_path):
    source = tmp_path / "pickled"
    source.mkdir()
    shutil.copy(stock_checkpoint("llama").path / "config.json", source)
    reference = AutoModelForCausalLM.from_pretrained(stock_checkpoint("llama").path)
    torch.save(reference.state_dict(), source / "pytorch_model.bin")
    add_snapshot(offline_cache, REPO, source, COMMIT_A, ("main",))
    refused_load(REPO, "allow_pickle=True")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, REPO, allow_pickle=True)
    assert_bitwise_equal(model.state_dict(), reference.state_dict())


# ------------------------------------------------------------------------------------------------------- symlinks


def test_symlink_escaping_the_blobs_directory_is_refused_by_name(two_revisions, tmp_path):
    snapshot = two_revisions / "models--org--tiny" / "snapshots" / COMMIT_A
    shard = sorted(snapshot.glob("*.safetensors"))[0]
    outside = tmp_path / "outside.safetensors"
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(os.path.relpath(outside, snapshot))
    message = refused_load(REPO)
    assert repr(shard.name) in message and str(outside) in message and "allow_external_symlinks=True" in message
    # The caller vouches for the link: it is followed.
    model = modelpatch.from_pretrained(AutoModelForCausalLM, REPO, allow_external_symlinks=True)
    assert_same_as_stock(model, AutoModelForCausalLM.from_pretrained(REPO))


def test_symlink_into_another_repositorys_blobs_is_refused(two_revisions, offline_cache, stock_checkpoint):
    other = add_snapshot(offline_cache, "org/other", stock_checkpoint("llama").path, COMMIT_A, ("main",))
    snapshot = two_revisions / "models--org--tiny" / "snapshots" / COMMIT_B
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(os.path.relpath((other / "model.safetensors").resolve(), snapshot))
    refused_load(REPO, r"model\.safetensors: resolves through a symlink to .*models--org--oth", revision="v1")


def test_local_symlink_outside_the_directory_is_refused(stock_checkpoint, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(stock_checkpoint("llama").path, directory)
    outside = tmp_path / "weights.safetensors"
    shutil.move(directory / "model.safetensors", outside)
    (directory / "model.safetensors").symlink_to(outside)
    refused_load(directory, r"model\.safetensors: resolves through a symlink .*outside")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory, allow_external_symlinks=True)
    stock = AutoModelForCausalLM.from_pretrained(stock_checkpoint("llama").path)
    assert_bitwise_equal(model.state_dict(), stock.state_dict())


# ------------------------------------------------------------------------------------------------------------ CLI


def test_cli_takes_repo_ids(two_revisions, capsys):
    assert cli_main(["inspect", REPO, "--revision", "v1"]) == 0
    assert f"snapshots/{COMMIT_B}" in capsys.readouterr().out
    assert cli_main(["plan", REPO, "--cache-dir", str(two_revisions), "--local-files-only"]) == 0
    assert f"snapshots/{COMMIT_A}" in capsys.readouterr().out
    assert cli_main(["inspect", "org/missing"]) == 2
    assert "'org/missing' is not a local directory" in capsys.readouterr().err
