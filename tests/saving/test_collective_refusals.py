"""Collective saves the ranks must refuse together, within seconds, naming the rank and the reason: run on two CPU
processes under ``torchrun`` (gloo) by collective_refusal_worker.py, whose docstring lists the cases.

Before, each of these left a rank waiting in a collective of the save until the process group's timeout (gloo's 30
minutes), then saying only that "a peer rank failed"; ranks in different saves aborted the processes (SIGABRT in
gloo). The ranks now meet in the process group's store before any collective of a save (``saving/agreement.py``),
each with its own checks done; the wait for a rank that never starts the save is ``MODELPATCH_SAVE_JOIN_TIMEOUT``
seconds, set short here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from support.distributed import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORKER = Path(__file__).with_name("collective_refusal_worker.py")
JOIN_TIMEOUT = 6.0
PROMPT = JOIN_TIMEOUT / 2  # what "at once" allows (two CPU processes on a loaded machine)


@pytest.fixture(scope="module")
def refusals(tiny, tmp_path_factory):
    """Every case's outcome on each rank, and the output directory."""
    out = tmp_path_factory.mktemp("collective_refusals")
    job = out / "job.json"
    job.write_text(json.dumps({"out": str(out), "path": str(tiny("llama").path)}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MODELPATCH_SAVE_JOIN_TIMEOUT", str(JOIN_TIMEOUT))
        run_ranks(WORKER, job, 2)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    return ranks, out


def test_a_rank_refusing_its_own_save_is_named_by_every_rank_at_once(refusals):
    ranks, out = refusals
    own, peer = ranks[1]["peft"], ranks[0]["peft"]
    assert own["said"].startswith("SaveError: PeftModel is a PEFT model"), own
    assert peer["said"].startswith(f"SaveError: Cannot save to {out / 'target'}; nothing was replaced: another rank"), (
        peer
    )
    assert "rank 1: SaveError: PeftModel is a PEFT model" in peer["said"], peer
    assert max(own["seconds"], peer["seconds"]) < PROMPT, (own, peer)


def test_ranks_calling_different_saves_refuse_naming_each(refusals):
    ranks, out = refusals
    for rank in range(2):
        said = ranks[rank]["mixed"]
        assert said["said"] == ranks[0]["mixed"]["said"], ranks
        assert "the ranks called different saves" in said["said"], said
        assert f"rank 0: modelpatch.save_pretrained (each rank writes its rows) into {out / 'target'}" in said["said"]
        assert "rank 1: model.save_pretrained (the shards gathered" in said["said"]
        assert said["seconds"] < PROMPT, said


def test_a_rank_that_never_saves_is_named_within_the_join_timeout(refusals):
    ranks, out = refusals
    said = ranks[0]["rank0_only"]
    refused = f"SaveError: Cannot save to {out / 'target'}: rank 1 did not start the collective save"
    assert said["said"].startswith(f"{refused} within {JOIN_TIMEOUT:g} s"), said
    assert "Rank 1 never called it" in said["said"], said
    assert JOIN_TIMEOUT <= said["seconds"] < JOIN_TIMEOUT + PROMPT, said


def test_an_unsharded_rank_saving_once_the_others_wait_refuses_and_they_refuse_at_once(refusals):
    ranks, _ = refusals
    lone, waiting = ranks[1]["unsharded_late"], ranks[0]["unsharded_late"]
    assert "rank 0 is saving a sharded model into it collectively" in lone["said"], lone
    assert "another rank refused it. rank 1: its model holds no sharded parameters" in waiting["said"], waiting
    assert waiting["seconds"] < 2 + PROMPT, waiting  # rank 1 starts 2 s after rank 0


def test_an_unsharded_rank_saving_first_is_named_with_what_it_wrote(refusals):
    ranks, out = refusals
    lone, waiting = ranks[1]["unsharded_first"], ranks[0]["unsharded_first"]
    assert lone["said"] == "saved", lone  # its own model, whole: nothing told it otherwise
    assert "rank 1 did not start the collective save" in waiting["said"], waiting
    assert "Rank 1 saved its model alone" in waiting["said"] and "Nothing was replaced by rank 0" in waiting["said"]
    assert "nothing was replaced:" not in waiting["said"]


def test_the_ranks_stay_in_step_for_the_next_save(refusals):
    ranks, out = refusals
    assert [rank["after"]["said"] for rank in ranks] == ["saved", "saved"], ranks
