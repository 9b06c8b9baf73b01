"""DCP checkpoints of ``distributed_config`` models across meshes, structures and world sizes: a model trained on an
HSDP mesh (``dp_replicate_size=2, fsdp_size=2``, four CPU ranks under ``torchrun``, gloo) resumes on
``fsdp_size=4`` from its own state (model and optimizer, ``get_state_dict``), loads in the other structure from its
original-layout checkpoint (``get_original_state_dict`` / ``set_original_state_dict``) on that mesh, and in one
process. The worker is dcp_meshes_worker.py.

Checked: the resumed run takes the uninterrupted run's steps (fp32 losses within 1e-5: the meshes reduce gradients
in other orders); every model filled from a checkpoint streams, in the original layout, bitwise the weights the
trained model had when it was checkpointed — on the second mesh, in the other structure, and in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

import modelpatch
from modelpatch._transformers import tensor_parallel_supported
from support.checkpoints import perturb
from support.compare import assert_bitwise_equal
from support.distributed import FSDP2_RUNS_ON_CPU, run_ranks
from support.models import MOE, TEXT

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.skipif(not tensor_parallel_supported(), reason="this transformers predates its distributed API (5.23)"),
    FSDP2_RUNS_ON_CPU,
    # The loads in this process (another world size) say that they run without a process group.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

WORKER = Path(__file__).with_name("dcp_meshes_worker.py")
RANKS = 4
HSDP = {"dp_replicate_size": 2, "fsdp_size": 2}
FSDP4 = {"fsdp_size": 4}
FUSED = {"qkv": True, "gate_up": True}
# id: (checkpoint, the fusions trained and resumed, the other structure filled from the original layout)
CASES = {
    "llama_fused": ("llama", FUSED, None),
    "llama_unfused": ("llama", None, FUSED),
    "qwen2_moe_linear_experts": ("qwen2_moe", {"linear_experts": True}, None),
}


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Saves the checkpoints (a Llama of 8 heads to 2 kv heads, a Qwen2-MoE of 4 experts) and runs every case on four
    ranks once; returns the output directory and the checkpoints."""
    heads = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    builds = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**dict(TEXT, **heads))),
        "qwen2_moe": lambda: Qwen2MoeForCausalLM(
            Qwen2MoeConfig(**dict(MOE, **heads, shared_expert_intermediate_size=48))
        ),
    }
    paths = {}
    for name, build in builds.items():
        torch.manual_seed(0)
        model = build()
        perturb(model, 0)
        paths[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(paths[name])
    out = tmp_path_factory.mktemp("dcp_meshes")
    cases = [
        dict(
            id=case,
            path=str(paths[name]),
            first_mesh=HSDP,
            second_mesh=FSDP4,
            fusion_config=fusions,
            other_fusion_config=other,
        )
        for case, (name, fusions, other) in CASES.items()
    ]
    job = out / "job.json"
    job.write_text(json.dumps({"out": str(out), "cases": cases}))
    run_ranks(WORKER, job, RANKS, timeout=600)
    return out, paths


def _records(out: Path, case: str) -> list[dict]:
    return [torch.load(out / f"{case}_rank{rank}.pt", weights_only=False) for rank in range(RANKS)]


@pytest.mark.parametrize("case", CASES)
def test_resumes_on_another_mesh(mesh_run, case):
    out, _ = mesh_run
    for record in _records(out, case):
        torch.testing.assert_close(record["resumed"], record["uninterrupted"], rtol=0, atol=1e-5)
        # The steps after the checkpoint train: the run is not a stand-still that would match anything.
        assert not torch.equal(record["uninterrupted"], record["first"])
        assert_bitwise_equal(record["resumed_state"], record["at_checkpoint"])


@pytest.mark.parametrize("case", CASES)
def test_original_layout_into_the_other_structure(mesh_run, case):
    out, _ = mesh_run
    for record in _records(out, case):
        assert_bitwise_equal(record["other_structure"], record["at_checkpoint"])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("structure", ["same", "other"])
def test_original_layout_in_one_process(mesh_run, case, structure):
    out, paths = mesh_run
    name, fusions, other = CASES[case]
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, paths[name], fusion_config=fusions if structure == "same" else other
    )
    before = {key: tensor.clone() for key, tensor in modelpatch.iter_original_state_dict(model)}
    placeholders = {"model": modelpatch.get_original_state_dict(model)}
    dcp.load(placeholders, checkpoint_id=str(out / f"{case}_original"))
    modelpatch.set_original_state_dict(model, placeholders["model"])
    expected = _records(out, case)[0]["at_checkpoint"]
    after = {key: tensor.clone() for key, tensor in modelpatch.iter_original_state_dict(model)}
    assert_bitwise_equal(after, expected)
    assert any(not torch.equal(before[key], expected[key]) for key in expected)  # training moved the weights
