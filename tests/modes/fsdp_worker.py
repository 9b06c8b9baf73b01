"""One rank of the FSDP2 training test (tests/modes/test_fsdp_training.py), run under ``torchrun`` with gloo.

For each case of the job file: load the checkpoint (with modelpatch and the case's fusions, or with stock
transformers), shard it with ``fully_shard`` per decoder layer and on the root over a 1-D mesh of every rank, stream
its original layout, then train a few AdamW steps on this rank's own batch (fixed seeds) and record the losses, the
first step's gradients and the trained weights, both in the checkpoint's original layout.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import peft
import torch
import torch.distributed as dist
import transformers
from peft import LoraConfig
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).parents[1]))

import modelpatch
from modelpatch.errors import FusionError, ModelPatchError
from modelpatch.saving.contents import model_layout
from support.distributed import joined_job, training_losses

transformers.logging.set_verbosity_error()

STEPS = 3
# One checkpoint tensor of layer 0 (of a fused group on the fused llama) loaded alone.
PART = "model.layers.0.self_attn.k_proj.weight"


def batch(rank: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and targets: rank 0 one token (so that most experts get none there), others six."""
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = 1 if rank == 0 else 6
    return (
        torch.randint(0, vocab_size, (1, tokens), generator=generator),
        torch.randint(0, vocab_size, (1, tokens), generator=generator),
    )


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def original_layout(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime-layout ``tensors`` of ``model`` (its gradients) under the checkpoint's names, as a save converts them."""
    layout = model_layout(model, tensors)
    return {key: tensor.clone() for key, tensor in layout.run(tensors.__getitem__).items()}


def shard(model: torch.nn.Module, mesh, placement: str | None) -> None:
    """``fully_shard`` each decoder layer, then the root; ``placement="dim1"`` shards every 2-D weight's dim 1."""
    kwargs = {}
    if placement == "dim1":
        kwargs["shard_placement_fn"] = lambda param: Shard(1) if param.dim() == 2 else Shard(0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def train(model: torch.nn.Module, rank: int, record: dict) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tokens, targets = batch(rank, model.config.vocab_size)
    with torch.no_grad():  # inference on the sharded model first
        record["inference"] = model(input_ids=tokens).logits

    def read_grads() -> None:
        grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
        record["grads"] = original_layout(model, grads)

    record["losses"] = training_losses(model, optimizer, tokens, targets, STEPS, read_grads)
    record["trained"] = original_layout(model, {name: full(p) for name, p in model.named_parameters()})


def routed(model: torch.nn.Module, rank: int) -> list[list[int]]:
    """Per MoE layer, the experts this rank's batch routes to (hooks on the experts' containers only)."""
    seen: list[list[int]] = []
    handles = [
        layer.mlp.experts.register_forward_pre_hook(
            lambda _m, args: seen.append(sorted(set(args[1].flatten().tolist())))
        )
        for layer in model.model.layers
    ]
    tokens, _ = batch(rank, model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=tokens)
    for handle in handles:
        handle.remove()
    return seen


def stream(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in modelpatch.iter_original_state_dict(model)}


def load_checkpoint(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)`` of a whole checkpoint, which stores a tied weight once: torch's strict load
    (stock's too) names the tied partner missing, so every other key must load and only tied names be missing."""
    names: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if names.setdefault(id(param), name) != name:
            tied.add(name)
    result = model.load_state_dict(state, strict=False)
    assert set(result.missing_keys) <= tied and not result.unexpected_keys, result


def reload(model: torch.nn.Module, path: Path, record: dict) -> None:
    """``model.load_state_dict`` in the checkpoint's layout on the sharded model: every tensor plus one, then one
    tensor of a fused group alone, then the checkpoint itself again (what training starts from)."""
    original = load_file(str(path / "model.safetensors"))
    load_checkpoint(model, {key: tensor + 1 for key, tensor in original.items()})
    record["reloaded"] = stream(model)
    load_checkpoint(model, original)
    model.load_state_dict({PART: original[PART] + 1}, strict=False)
    record["partly_reloaded"] = stream(model)
    load_checkpoint(model, original)


def restructure_refusals(model) -> list[str]:
    """What fuse / unfuse say on the sharded model (FusionError messages)."""
    messages = []
    for call in (lambda: modelpatch.fuse(model, {"qkv": True}), lambda: modelpatch.unfuse(model)):
        try:
            call()
            messages.append("done")
        except FusionError as exc:
            messages.append(str(exc))
    return messages


def messages(calls: dict[str, object], error: type[Exception]) -> dict[str, str]:
    """Each call's ``error`` message ("done" when it raised none)."""
    out = {}
    for name, call in calls.items():
        try:
            call()  # type: ignore[operator]
            out[name] = "done"
        except error as exc:
            out[name] = str(exc)
    return out


def tensor_parallel_refusals(path: Path, out: Path, rank: int) -> None:
    """What restructuring, adapters and the original-layout doors say on a tensor-parallel model, and on one sharded
    with FSDP2 too (a 2-D mesh: tensor parallel over the ranks, FSDP2 over a dimension of size 1)."""
    load = partial(modelpatch.from_pretrained, transformers.AutoModelForCausalLM, path, tp_plan="auto")
    plain, fused = load(), load(fusion_config={"qkv": True})
    record = messages(
        {
            "fuse": lambda: modelpatch.fuse(plain, {"qkv": True}),
            "unfuse": lambda: modelpatch.unfuse(fused),
            "adapters": lambda: modelpatch.get_peft_model(fused, LoraConfig(target_modules=["q_proj"])),
            "load_adapter": lambda: modelpatch.load_adapter(fused, str(path)),
        },
        ModelPatchError,
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("tp", "dp"))
    for layer in plain.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(plain, mesh=mesh["dp"])
    two_d = messages(
        {
            "fuse": lambda: modelpatch.fuse(plain, {"qkv": True}),
            "stream": lambda: next(modelpatch.iter_original_state_dict(plain)),
            "load_state_dict": lambda: plain.load_state_dict(load_file(str(path / "model.safetensors"))),
        },
        ModelPatchError,
    )
    (out / f"tensor_parallel_rank{rank}.json").write_text(json.dumps({"tp": record, "2d": two_d}))


def adapters_then_fsdp(path: Path, mesh, rank: int) -> dict[str, torch.Tensor]:
    """LoRA added before ``fully_shard`` (stock PEFT on stock transformers, modelpatch's on the fused model), then a
    few AdamW steps on the adapters: the losses of each."""
    config = dict(r=2, target_modules=["q_proj", "k_proj", "up_proj"], init_lora_weights=False)
    builds = {
        "stock": lambda: peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(path), LoraConfig(**config)),
        "fused": lambda: modelpatch.get_peft_model(
            modelpatch.from_pretrained(
                transformers.AutoModelForCausalLM, path, fusion_config={"qkv": True, "gate_up": True}
            ),
            LoraConfig(**config),
        ),
    }
    losses = {}
    tokens, targets = batch(rank, 64)
    for name, build in builds.items():
        torch.manual_seed(0)  # the adapters' initial weights
        model = build()
        shard(model.base_model.model, mesh, None)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        losses[name] = training_losses(model, optimizer, tokens, targets, STEPS)
    return losses


def main() -> None:
    job, rank, mesh = joined_job()
    out = Path(job["out"])
    for case in job["cases"]:
        torch.manual_seed(0)
        path = Path(case["path"])
        if case["stock"]:
            model = getattr(transformers, case["class"]).from_pretrained(path)
        else:
            model = modelpatch.from_pretrained(
                transformers.AutoModelForCausalLM, path, fusion_config=case["fusion_config"]
            )
            unsharded = dict(modelpatch.iter_original_state_dict(model))
        record: dict = {}
        if case.get("routed"):
            record["routed"] = routed(model, rank)
        shard(model, mesh, case.get("placement"))
        if not case["stock"]:
            record["streamed"] = stream(model)
            record["unsharded"] = unsharded
            reload(model, path, record)
            record["refusals"] = restructure_refusals(model)
        train(model, rank, record)
        # Tied input and output embeddings stay one parameter through the load, sharding, reloads and training.
        record["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        torch.save(record, out / f"{case['id']}_rank{rank}.pt")
    torch.save(adapters_then_fsdp(Path(job["adapters"]), mesh, rank), out / f"adapters_rank{rank}.pt")
    if job["tensor_parallel"]:
        tensor_parallel_refusals(Path(job["tensor_parallel"]), out, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
