"""``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...))``: FSDP2 and HSDP loads, on four CPU
processes under ``torchrun`` (gloo), against stock transformers' own ``distributed_config`` load on the same mesh.

One launch (fsdp_config_worker.py) runs both meshes, ``fsdp_size=4`` and ``dp_replicate_size=2, fsdp_size=2``
(HSDP), on a Llama of 8 attention heads to 2 key/value heads, unfused and with fused ``qkv`` + ``gate_up``, the fused
model with tied embeddings and a Qwen2-MoE (unfused, ``linear_experts``). Checked here:
the modules a fusion leaves alone are sharded exactly as stock shards them (every parameter's placements, mesh and
local shape; the same ``fully_shard`` units, owning the same parameters), restructured ones ``Shard(0)`` over the
same mesh; each rank copies into its shards only the bytes of its shards; a few AdamW steps give stock's losses;
after training, modelpatch's collective ``save_pretrained`` and ``model.save_pretrained`` write the checkpoint's
original layout, equal to stock's save of its own trained model; the collectives of the load and of the collective
save (``torch.distributed``'s functions wrapped) move no fused tensor whole; ``from_config`` refuses a
``distributed_config`` by name, as stock's cannot take one.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.distributed import DistributedConfig

import modelpatch
from modelpatch import TensorParallelError
from modelpatch._transformers import tensor_parallel_supported
from support.checkpoints import perturb
from support.compare import assert_bitwise_equal
from support.distributed import FSDP2_RUNS_ON_CPU, run_ranks
from support.files import read_tensors
from support.models import MOE, TEXT

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
# The launched tests: stock's distributed_config loads need transformers' distributed API (5.23 on) and FSDP2 on CPU
# ranks (not torch 2.6's).
NEEDS_DISTRIBUTED_API = pytest.mark.skipif(
    not tensor_parallel_supported(), reason="this transformers predates its distributed API (5.23)"
)

WORKER = Path(__file__).with_name("fsdp_config_worker.py")
RANKS = 4
FUSIONS = {"unfused": None, "fused": {"qkv": True, "gate_up": True}}
# run id: (checkpoint, DistributedConfig's keywords, the fusion configs loaded beside stock's load)
RUNS = {
    "fsdp4": ("llama", {"fsdp_size": 4}, FUSIONS),
    "hsdp": ("llama", {"dp_replicate_size": 2, "fsdp_size": 2}, FUSIONS),
    # Input and output embeddings tied (as Llama-3.2-1B's): one parameter, in the embeddings' unit.
    "fsdp4_tied": ("llama_tied", {"fsdp_size": 4}, {"fused": FUSIONS["fused"]}),
    # An fsdp_plan overriding the model's (decoder layers keep their gathered weights after forward), and FSDP's mixed
    # precision (bfloat16 compute; fused products round otherwise than the separate ones in bfloat16: not compared).
    "fsdp4_plan": ("llama", {"fsdp_size": 4, "fsdp_plan": {"model.layers.*": "keep_full_weight"}}, FUSIONS),
    "fsdp4_mixed": ("llama", {"fsdp_size": 4, "fsdp_mixed_precision": True}, {"unfused": None}),
    # Per-expert Linears where stock holds each layer's experts as two 3-D parameters.
    "fsdp4_moe": ("qwen2_moe", {"fsdp_size": 4}, {"unfused": None, "linear_experts": {"linear_experts": True}}),
    # The tied embeddings and the experts on the HSDP mesh too.
    "hsdp_tied": ("llama_tied", {"dp_replicate_size": 2, "fsdp_size": 2}, {"fused": FUSIONS["fused"]}),
    "hsdp_moe": (
        "qwen2_moe",
        {"dp_replicate_size": 2, "fsdp_size": 2},
        {"unfused": None, "linear_experts": {"linear_experts": True}},
    ),
}
# fsdp_plan rules the fused model cannot take: a module it lacks; q_proj, a slice of qkv_proj holding no parameters.
PLAN_REFUSALS = [
    {"model.layers.*.self_attn.attn": "free_full_weight"},
    {"model.layers.*.self_attn.q_proj": "free_full_weight"},
]
CASES = [(run, case) for run, (_, _, fusions) in RUNS.items() for case in fusions]
# A fused parameter -> the stock parameters it is made of.
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
# An expert's Linear (linear_experts) -> the 3-D parameter of stock's experts holding it.
EXPERT = re.compile(r"(.*\.mlp\.experts)\.\d+\.(?:(gate|up)|down)_proj\.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Llamas of 8 attention heads to 2 key/value heads (fused q/k/v rows: 64 + 16 + 16), one with tied embeddings,
    and a Qwen2-MoE of the same attention and 4 experts, saved by stock."""
    heads = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    builds = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**dict(TEXT, **heads))),
        "llama_tied": lambda: LlamaForCausalLM(LlamaConfig(**dict(TEXT, **heads, tie_word_embeddings=True))),
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
    return paths


@pytest.fixture(scope="module")
def mesh_run(checkpoints, tmp_path_factory) -> Path:
    """Runs every run of RUNS on four ranks once; returns the output directory."""
    out = tmp_path_factory.mktemp("fsdp_config")
    runs = [
        dict(id=run, path=str(checkpoints[name]), mesh=mesh, fusions=fusions)
        for run, (name, mesh, fusions) in RUNS.items()
    ]
    job = out / "job.json"
    refusals = [
        dict(path=str(checkpoints["llama"]), mesh={"fsdp_size": 4, "fsdp_plan": plan}, fusion=FUSIONS["fused"])
        for plan in PLAN_REFUSALS
    ]
    from_config = dict(path=str(checkpoints["llama"]), mesh={"fsdp_size": 4}, fusion=FUSIONS["fused"])
    job.write_text(json.dumps({"out": str(out), "runs": runs, "plan_refusals": refusals, "from_config": from_config}))
    run_ranks(WORKER, job, RANKS)
    return out


def _records(out: Path, run: str, case: str) -> list[dict]:
    return [torch.load(out / f"{run}_{case}_rank{rank}.pt", weights_only=False) for rank in range(RANKS)]


def _hsdp(run: str) -> bool:
    return "dp_replicate_size" in RUNS[run][1]


def _stock_names(name: str) -> list[str]:
    """The stock parameters ``name`` (a parameter of the fused model) stands for (of which it holds part)."""
    if expert := EXPERT.fullmatch(name):
        return [f"{expert[1]}.{'gate_up' if expert[2] else 'down'}_proj"]
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            prefix, _, suffix = name.partition(f".{fused}.")
            owner = fused.rpartition(".")[0]
            return [f"{prefix}.{owner}.{part}.{suffix}" for part in parts]
    return [name]


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
@pytest.mark.parametrize(("run", "case"), CASES)
def test_sharded_as_stock_shards(mesh_run, run, case):
    shards = RUNS[run][1]["fsdp_size"]
    for record, stock in zip(_records(mesh_run, run, case), _records(mesh_run, run, "stock"), strict=True):
        ours, theirs = record["layout"], stock["layout"]
        assert ours["plain"] == theirs["plain"] == []  # every parameter is a DTensor
        assert sorted(ours["units"]) == sorted(theirs["units"])
        for unit, params in ours["units"].items():
            assert sorted({n for p in params for n in _stock_names(p)}) == theirs["units"][unit], unit
        for name, (placements, device_mesh, shape, local, coordinate) in ours["params"].items():
            parts = [theirs["params"][n] for n in _stock_names(name)]
            assert all((placements, device_mesh) == part[:2] for part in parts), name
            if name in theirs["params"]:
                assert (shape, local, coordinate) == theirs["params"][name][2:], name
                continue
            # A restructured parameter: Shard(0) as torch cuts any dim 0 (here into equal blocks).
            blocks = torch.arange(shape[0]).chunk(shards)
            assert local == (len(blocks[coordinate[-1]]), *shape[1:]), name
            if len(parts) > 1:  # a fused one holds the parts' rows
                assert shape == (sum(part[2][0] for part in parts), *parts[0][2][1:]), name
        assert "Shard(dim=0)" in placements and ("Replicate()" in placements) == _hsdp(run)


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
@pytest.mark.parametrize(("run", "case"), CASES)
def test_each_rank_copies_only_its_shards(mesh_run, checkpoints, run, case):
    """Each rank copies the bytes of its own shards; all of them together, each replica the checkpoint once."""
    whole = sum(t.numel() * t.element_size() for t in read_tensors(checkpoints[RUNS[run][0]]).values())
    records = _records(mesh_run, run, case)
    assert all(record["placed"] == record["local"] for record in records)
    assert sum(record["placed"] for record in records) == whole * RUNS[run][1].get("dp_replicate_size", 1)


def _moved_shapes(record: dict, call: str) -> list[tuple[int, ...]]:
    """The shapes of the tensors the collectives of ``call`` moved on one rank (the worker's ``Collectives``)."""
    return [shape for _, shape in record["collectives"][call] if shape is not None]


def _restructured_shapes(record: dict, checkpoint: Path) -> set[tuple[int, ...]]:
    """The full shapes of the parameters the checkpoint holds under no key of its own: fused ``qkv_proj`` /
    ``gate_up_proj``, stock's 3-D experts."""
    keys = set(read_tensors(checkpoint))
    return {params[2] for name, params in record["layout"]["params"].items() if name not in keys}


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
@pytest.mark.parametrize(("run", "case"), CASES)
def test_no_collective_of_the_load_or_the_collective_save_moves_a_restructured_tensor(mesh_run, checkpoints, run, case):
    """Counted by wrapping torch.distributed's collectives (c10d's and the functional ones DTensor's full_tensor
    ends in): the load moves no tensor between ranks (each reads its own rows from the files); the collective
    ``modelpatch.save_pretrained`` moves none either (each rank writes its own rows), only its small agreement
    objects: a fused ``qkv_proj`` / ``gate_up_proj`` (or stock's 3-D experts) is never gathered whole."""
    checkpoint = checkpoints[RUNS[run][0]]
    originals = {tuple(t.shape) for t in read_tensors(checkpoint).values()}
    for record in _records(mesh_run, run, case):
        restructured = _restructured_shapes(record, checkpoint)
        assert _moved_shapes(record, "load") == []
        # An original tensor gathered whole would be allowed (the stream's rule); none of the checkpoint's is.
        moved = _moved_shapes(record, "save")
        assert not [shape for shape in moved if shape in restructured or shape not in originals], moved
        assert sorted(name for name, _ in record["collectives"]["save"]) == sorted(
            ["distributed_c10d.broadcast_object_list"] * 2 + ["distributed_c10d.all_gather_object"]
        )


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
@pytest.mark.parametrize("run", ["fsdp4", "hsdp", "hsdp_tied"])
@pytest.mark.parametrize("call", ["stream", "method"])
def test_the_stream_and_the_method_save_gather_fused_tensors_part_by_part(mesh_run, checkpoints, run, call):
    """``iter_original_state_dict`` and ``model.save_pretrained`` give every rank whole original tensors: a fused
    ``qkv_proj`` / ``gate_up_proj`` comes as ``q``, ``k``, ``v`` (``gate``, ``up``), each part's rows broadcast by
    the ranks holding them, never gathered whole; any other sharded tensor is gathered whole, once (its own
    ``full_tensor``: the checkpoint's shape)."""
    checkpoint = checkpoints[RUNS[run][0]]
    originals = read_tensors(checkpoint)
    for record in _records(mesh_run, run, "fused"):
        restructured = _restructured_shapes(record, checkpoint)
        moved = _moved_shapes(record, call)
        assert not [shape for shape in moved if shape in restructured], moved
        # Rows of a part: never more than the part (the largest, q), each of the model's tensors' width.
        assert all(math.prod(shape) <= originals["model.layers.0.self_attn.q_proj.weight"].numel() for shape in moved)
        gathered = [name for name, _ in record["collectives"][call] if name.endswith("all_gather_single")]
        unfused = [p for name, p in record["layout"]["params"].items() if name in originals]
        assert len(gathered) == len(unfused), (gathered, len(unfused))


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
@pytest.mark.parametrize("run", ["fsdp4", "hsdp"])
def test_the_counted_collectives_include_dtensor_gathers(mesh_run, run):
    """The counting sees what DTensor gathers: stock's ``save_pretrained`` gathers each parameter once
    (``full_tensor``), and every gather is counted with the parameter's full shape."""
    for stock in _records(mesh_run, run, "stock"):
        shapes = sorted(params[2] for params in stock["layout"]["params"].values())
        assert sorted(_moved_shapes(stock, "method")) == shapes


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
@pytest.mark.parametrize(("run", "case"), CASES)
def test_training_gives_stock_losses(mesh_run, run, case):
    for record, stock in zip(_records(mesh_run, run, case), _records(mesh_run, run, "stock"), strict=True):
        # Bitwise for the unfused model; fused products (experts run one by one) round their last bits otherwise.
        atol = 0 if case == "unfused" else 1e-5
        torch.testing.assert_close(record["losses"], stock["losses"], atol=atol, rtol=0)


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
@pytest.mark.parametrize(("run", "case"), CASES)
@pytest.mark.parametrize("save", ["modelpatch", "method"])
def test_saves_after_training_are_stocks_save_of_its_trained_model(mesh_run, checkpoints, run, case, save):
    """The checkpoint's original keys; bitwise stock's save for the unfused model (the same file), close for the
    fused ones (fused q/k/v and gate/up products, and experts run one by one, round their last bits otherwise than
    stock's)."""
    stock = read_tensors(mesh_run / f"{run}_stock_save")
    saved = read_tensors(mesh_run / f"{run}_{case}_{save}_save")
    assert sorted(saved) == sorted(read_tensors(checkpoints[RUNS[run][0]]))
    if RUNS[run][0] == "llama_tied":
        # Stock's save of its FSDP2 model writes the tied head too (its gathered state no longer shares storage),
        # equal to the embeddings; an unsharded save, stock's or modelpatch's, writes the embeddings alone.
        assert_bitwise_equal({"tied": stock.pop("lm_head.weight")}, {"tied": stock["model.embed_tokens.weight"]})
    if case == "unfused":
        assert_bitwise_equal(saved, stock)
        stock_file = (mesh_run / f"{run}_stock_save" / "model.safetensors").read_bytes()
        assert (mesh_run / f"{run}_{case}_{save}_save" / "model.safetensors").read_bytes() == stock_file
    else:
        # Per-expert products with gradients run expert by expert: after three AdamW steps (which divide by the root
        # of the squared gradients) a bias of the routed layers differs by 1.007e-5; 1e-4 as test_fsdp_training's.
        atol = 1e-4 if case == "linear_experts" else 1e-5
        torch.testing.assert_close(saved, stock, atol=atol, rtol=0)
    # Every rank's stream of the trained model is what was saved; stock loads the save.
    for record in _records(mesh_run, run, case):
        assert_bitwise_equal(record["trained"], saved)
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        mesh_run / f"{run}_{case}_{save}_save", output_loading_info=True
    )
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = reloaded.state_dict()  # stock's runtime layout: the tensors it reads unchanged compared
    assert_bitwise_equal(
        {k: state[k] for k in saved.keys() & state.keys()}, {k: saved[k] for k in saved.keys() & state.keys()}
    )


@NEEDS_DISTRIBUTED_API  # DistributedConfig has these fields from 5.23 on
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp_size": 2, "fsdp_size": 2}, r"asks for \{'tp_size': 2, 'fsdp_size': 2\}.*together with FSDP"),
        ({"fsdp_size": 2, "ep_size": 2}, r"asks for expert parallelism \({'enable_expert_parallel': True}\)"),
        ({"pp_size": 2}, r"asks for \{'pp_size': 2\}"),
        ({"fsdp_size": 2, "fsdp_cpu_offload": True}, "FSDP CPU offload"),
    ],
)
def test_what_is_not_supported_is_refused_naming_what_is(checkpoints, fields, message):
    with pytest.raises(TensorParallelError, match=message) as raised:
        modelpatch.from_pretrained(
            LlamaForCausalLM, checkpoints["llama"], distributed_config=DistributedConfig(**fields)
        )
    assert "tensor parallelism alone (tp_plan / tp_size), FSDP2 alone (fsdp_size) or HSDP" in str(raised.value)
    assert "with fsdp_plan and fsdp_mixed_precision" in str(raised.value)


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
def test_fsdp_plans_the_fused_model_cannot_take_are_refused_by_name(mesh_run):
    """On every rank, before anything is read: transformers' refusal of a rule naming nothing, and modelpatch's of a
    rule naming a module the fusion left without parameters (stock would make it a unit of its own)."""
    for rank in range(RANKS):
        unknown, empty = json.loads((mesh_run / f"plan_refusals_rank{rank}.json").read_text())
        assert unknown.startswith("LlamaForCausalLM cannot be sharded with FSDP2: `fsdp_plan` keys"), unknown
        assert "model.layers.*.self_attn.attn" in unknown
        assert "shards ['model.layers.0.self_attn.q_proj', 'model.layers.1.self_attn.q_proj']" in empty, empty
        assert "which hold no parameters in this model" in empty


def test_an_fsdp_load_this_process_cannot_do_is_refused_by_name(checkpoints):
    """One process: a mesh of 4 ranks is refused by its size; a transformers without the distributed API (the
    lowest set) refuses every FSDP2 load by name."""
    if tensor_parallel_supported():
        message = r"\(fsdp_size=4\) makes a mesh of 4 ranks, but this process was launched with world size 1"
    else:
        message = r"FSDP2 loading \(fsdp_size=4\) drives the distributed API of transformers 5\.23; .* predates it"
    with pytest.raises(TensorParallelError, match=message):
        modelpatch.from_pretrained(LlamaForCausalLM, checkpoints["llama"], distributed_config={"fsdp_size": 4})


@NEEDS_DISTRIBUTED_API
@FSDP2_RUNS_ON_CPU
def test_from_config_with_a_distributed_config_is_refused_by_name_as_stock_cannot_take_it(mesh_run):
    """Stock transformers' ``from_config`` hands ``distributed_config`` to the model's ``__init__`` (a TypeError);
    modelpatch's ``from_config`` and Auto class refuse it by name, on every rank of a torchrun launch, with the ways
    to a sharded model."""
    for rank in range(RANKS):
        refused = json.loads((mesh_run / f"from_config_rank{rank}.json").read_text())
        assert refused["stock"].startswith("TypeError: ") and "distributed_config" in refused["stock"]
        for ours in (refused["function"], refused["auto"]):
            assert ours.startswith("TensorParallelError: from_config takes no distributed_config"), ours
            assert "from_pretrained(..., distributed_config=...)" in ours and "load_sharded" in ours


@pytest.mark.parametrize(
    "keywords", [{"distributed_config": {"fsdp_size": 4}}, {"tp_plan": "auto"}, {"tp_plan": "auto", "tp_size": 2}]
)
def test_from_config_refuses_sharding_keywords_in_one_process_too(keywords):
    """The refusal is the keyword's, before anything is built, whatever the process (and the transformers) is."""
    config = LlamaConfig(**TEXT)
    given = " / ".join(keywords)
    with pytest.raises(TensorParallelError, match=f"^from_config takes no {given}: stock transformers' from_config"):
        modelpatch.from_config(LlamaForCausalLM, config, **keywords)
    # Without them, the same call builds.
    assert isinstance(modelpatch.from_config(LlamaForCausalLM, config), LlamaForCausalLM)
