"""``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...))``: FSDP2 and HSDP loads, on four CPU
processes under ``torchrun`` (gloo), against stock transformers' own ``distributed_config`` load on the same mesh.

One launch (fsdp_config_worker.py) runs both meshes, ``fsdp_size=4`` and ``dp_replicate_size=2, fsdp_size=2``
(HSDP), on a Llama of 8 attention heads to 2 key/value heads, unfused and with fused ``qkv`` + ``gate_up``. Checked
here: the modules a fusion leaves alone are sharded exactly as stock shards them (every parameter's placements,
mesh and local shape; the same ``fully_shard`` units, owning the same parameters), fused ones ``Shard(0)`` over the
same mesh; each rank copies into its shards only the bytes of its shards; a few AdamW steps give stock's losses;
after training, modelpatch's collective ``save_pretrained`` and ``model.save_pretrained`` write the checkpoint's
original layout, equal to stock's save of its own trained model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig

import modelpatch
from modelpatch import TensorParallelError
from modelpatch._transformers import tensor_parallel_supported
from support.checkpoints import perturb
from support.compare import assert_bitwise_equal
from support.distributed import FSDP2_RUNS_ON_CPU, run_ranks
from support.files import read_tensors
from support.models import TEXT

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
# The launched tests: stock's distributed_config loads need transformers' distributed API (5.23 on) and FSDP2 on CPU
# ranks (not torch 2.6's).
NEEDS_DISTRIBUTED_API = pytest.mark.skipif(
    not tensor_parallel_supported(), reason="this transformers predates its distributed API (5.23)"
)

WORKER = Path(__file__).with_name("fsdp_config_worker.py")
RANKS = 4
MESHES = {"fsdp4": {"fsdp_size": 4}, "hsdp": {"dp_replicate_size": 2, "fsdp_size": 2}}
FUSIONS = {"unfused": None, "fused": {"qkv": True, "gate_up": True}}
# A fused parameter -> the stock parameters it is made of.
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A Llama of 8 attention heads to 2 key/value heads (fused q/k/v rows: 64 + 16 + 16), saved by stock."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TEXT, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)))
    perturb(model, 0)
    path = tmp_path_factory.mktemp("llama_8_heads")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mesh_run(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_config")
    job = out / "job.json"
    job.write_text(json.dumps({"out": str(out), "path": str(checkpoint), "meshes": MESHES, "fusions": FUSIONS}))
    run_ranks(WORKER, job, RANKS)
    return out


def _records(out: Path, mesh: str, case: str) -> list[dict]:
    return [torch.load(out / f"{mesh}_{case}_rank{rank}.pt", weights_only=False) for rank in range(RANKS)]


def _stock_names(name: str) -> list[str]:
    """The stock parameters ``name`` (a parameter of the fused model) stands for."""
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            prefix, _, suffix = name.partition(f".{fused}.")
            owner = fused.rpartition(".")[0]
            return [f"{prefix}.{owner}.{part}.{suffix}" for part in parts]
    return [name]


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("case", sorted(FUSIONS))
@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
def test_sharded_as_stock_shards(mesh_run, mesh, case):
    for record, stock in zip(_records(mesh_run, mesh, case), _records(mesh_run, mesh, "stock"), strict=True):
        ours, theirs = record["layout"], stock["layout"]
        assert ours["plain"] == theirs["plain"] == []  # every parameter is a DTensor
        assert sorted(ours["units"]) == sorted(theirs["units"])
        for unit, params in ours["units"].items():
            assert sorted(n for p in params for n in _stock_names(p)) == theirs["units"][unit], unit
        for name, (placements, device_mesh, shape, local, coordinate) in ours["params"].items():
            parts = [theirs["params"][n] for n in _stock_names(name)]
            assert all((placements, device_mesh) == part[:2] for part in parts), name
            if len(parts) == 1:
                assert (shape, local, coordinate) == parts[0][2:], name
                continue
            # A fused parameter: the parts' rows, Shard(0) as torch cuts any dim 0 (here into equal blocks).
            assert shape == (sum(part[2][0] for part in parts), *parts[0][2][1:]), name
            blocks = torch.arange(shape[0]).chunk(MESHES[mesh]["fsdp_size"])
            assert local == (len(blocks[coordinate[-1]]), *shape[1:]), name
        assert "Shard(dim=0)" in placements and ("Replicate()" in placements) == (mesh == "hsdp")


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("case", sorted(FUSIONS))
@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
def test_each_rank_copies_only_its_shards(mesh_run, checkpoint, mesh, case):
    whole = sum(t.numel() * t.element_size() for t in read_tensors(checkpoint).values())
    for record in _records(mesh_run, mesh, case):
        assert record["placed"] == record["local"] == whole // MESHES[mesh]["fsdp_size"]


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("case", sorted(FUSIONS))
@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
def test_training_gives_stock_losses(mesh_run, mesh, case):
    for record, stock in zip(_records(mesh_run, mesh, case), _records(mesh_run, mesh, "stock"), strict=True):
        # Bitwise for the unfused model; fused products round their last bits otherwise than the separate ones.
        atol = 0 if case == "unfused" else 1e-5
        torch.testing.assert_close(record["losses"], stock["losses"], atol=atol, rtol=0)


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("case", sorted(FUSIONS))
@pytest.mark.parametrize("save", ["modelpatch", "method"])
@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
def test_saves_after_training_are_stocks_save_of_its_trained_model(mesh_run, mesh, case, save):
    """Bitwise for the unfused model (the same files); fused q/k/v and gate/up products round their last bits
    otherwise than the separate ones, so trained weights agree within 1e-5."""
    stock = read_tensors(mesh_run / f"{mesh}_stock_save")
    saved = read_tensors(mesh_run / f"{mesh}_{case}_{save}_save")
    assert sorted(saved) == sorted(stock)
    if case == "unfused":
        assert_bitwise_equal(saved, stock)
        stock_file = (mesh_run / f"{mesh}_stock_save" / "model.safetensors").read_bytes()
        assert (mesh_run / f"{mesh}_{case}_{save}_save" / "model.safetensors").read_bytes() == stock_file
    else:
        torch.testing.assert_close(saved, stock, atol=1e-5, rtol=0)
    # Every rank's stream of the trained model is what was saved.
    for record in _records(mesh_run, mesh, case):
        assert_bitwise_equal(record["trained"], saved)
    reloaded = LlamaForCausalLM.from_pretrained(mesh_run / f"{mesh}_{case}_{save}_save")
    assert_bitwise_equal(dict(reloaded.state_dict()), saved)


@NEEDS_DISTRIBUTED_API  # DistributedConfig has these fields from 5.23 on
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp_size": 2, "fsdp_size": 2}, r"asks for \{'tp_size': 2, 'fsdp_size': 2\}.*together with FSDP"),
        ({"fsdp_size": 2, "ep_size": 2}, r"asks for expert parallelism \({'enable_expert_parallel': True}\)"),
        ({"pp_size": 2}, r"asks for \{'pp_size': 2\}"),
        ({"fsdp_size": 2, "fsdp_plan": {"model.layers.*": "free_full_weight"}}, r"an FSDP plan of its own"),
        ({"fsdp_size": 2, "fsdp_cpu_offload": True}, "FSDP CPU offload"),
        ({"fsdp_size": 2, "fsdp_mixed_precision": True}, "FSDP mixed precision"),
    ],
)
def test_what_is_not_supported_is_refused_naming_what_is(checkpoint, fields, message):
    with pytest.raises(TensorParallelError, match=message) as raised:
        modelpatch.from_pretrained(LlamaForCausalLM, checkpoint, distributed_config=DistributedConfig(**fields))
    assert "tensor parallelism alone (tp_plan / tp_size), FSDP2 alone (fsdp_size) or HSDP" in str(raised.value)


def test_an_fsdp_load_this_process_cannot_do_is_refused_by_name(checkpoint):
    """One process: a mesh of 4 ranks is refused by its size; a transformers without the distributed API (the
    lowest set) refuses every FSDP2 load by name."""
    if tensor_parallel_supported():
        message = r"\(fsdp_size=4\) makes a mesh of 4 ranks, but this process was launched with world size 1"
    else:
        message = r"FSDP2 loading \(fsdp_size=4\) drives the distributed API of transformers 5\.23; .* predates it"
    with pytest.raises(TensorParallelError, match=message):
        modelpatch.from_pretrained(LlamaForCausalLM, checkpoint, distributed_config={"fsdp_size": 4})
