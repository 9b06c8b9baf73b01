"""One rank of the ``distributed_config`` FSDP2 / HSDP test (tests/modes/test_fsdp_config.py), under ``torchrun``.

For each run of the job file (a checkpoint, a mesh as ``DistributedConfig`` keywords, fusion configs): stock
transformers' ``from_pretrained`` with that ``distributed_config``, then modelpatch's with each fusion config. Each
model: how it is sharded (every parameter's placements, mesh and local shape; every ``fully_shard`` unit and the
parameters it owns), the bytes this rank's load copied into its shards, a few AdamW steps on this rank's own batch
(the losses), the trained weights in the checkpoint's original layout, and its saves (stock's ``save_pretrained``;
modelpatch's collective ``save_pretrained`` and ``model.save_pretrained``). Then the messages of loads whose
``fsdp_plan`` names a module the fused model lacks, or one it holds no parameters in.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

sys.path.insert(0, str(Path(__file__).parents[1]))

import modelpatch
from modelpatch.modes import fsdp

transformers.logging.set_verbosity_error()

STEPS = 3


def layout(model: torch.nn.Module) -> dict:
    """Per parameter: (placements, mesh, full shape, local shape, this rank's coordinate in the mesh); per
    ``fully_shard`` unit: the parameters it owns (those of its module not under a nested unit)."""
    params = {
        name: (
            str(p.placements),
            str(p.device_mesh),
            tuple(p.shape),
            tuple(p.to_local().shape),
            tuple(p.device_mesh.get_coordinate()),
        )
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    plain = sorted(name for name, p in model.named_parameters() if not isinstance(p, DTensor))
    units: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        nested = [f"{inner}." for inner, child in module.named_modules() if inner and isinstance(child, FSDPModule)]
        owned = [n for n, _ in module.named_parameters() if not any(n.startswith(prefix) for prefix in nested)]
        units[name] = sorted(f"{name}.{n}" if name else n for n in owned)
    return {"params": params, "plain": plain, "units": units}


def local_bytes(model: torch.nn.Module) -> int:
    """The bytes of this rank's part of every tensor of the model's state (a tied parameter once)."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in unique.values())


def train(model: torch.nn.Module, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, model.config.vocab_size, (2, 7), generator=generator)
    targets = torch.randint(0, model.config.vocab_size, (2, 7), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for _ in range(STEPS):
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    placed: list[int] = []
    original_place = fsdp.FullyShardedLoad.place

    def counting_place(self, key, value):
        placed.append(value.numel() * value.element_size())
        return original_place(self, key, value)

    # The bytes each rank's load hands over to be copied into its shards (what it reads of the files).
    fsdp.FullyShardedLoad.place = counting_place
    for run in job["runs"]:
        mesh_id, path, config = run["id"], Path(run["path"]), DistributedConfig(**run["mesh"])
        stock = transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
        record = {"layout": layout(stock), "losses": train(stock, rank)}
        torch.save(record, out / f"{mesh_id}_stock_rank{rank}.pt")
        stock.save_pretrained(out / f"{mesh_id}_stock_save")
        del stock
        for case_id, fusion_config in run["fusions"].items():
            placed.clear()
            model = modelpatch.from_pretrained(
                transformers.AutoModelForCausalLM, path, fusion_config=fusion_config, distributed_config=config
            )
            record = {"layout": layout(model), "placed": sum(placed), "local": local_bytes(model)}
            record["losses"] = train(model, rank)
            record["trained"] = {key: t.clone() for key, t in modelpatch.iter_original_state_dict(model)}
            torch.save(record, out / f"{mesh_id}_{case_id}_rank{rank}.pt")
            modelpatch.save_pretrained(model, out / f"{mesh_id}_{case_id}_modelpatch_save")
            model.save_pretrained(out / f"{mesh_id}_{case_id}_method_save")
    messages = []
    for refusal in job["plan_refusals"]:
        try:
            modelpatch.from_pretrained(
                transformers.AutoModelForCausalLM,
                refusal["path"],
                fusion_config=refusal["fusion"],
                distributed_config=DistributedConfig(**refusal["mesh"]),
            )
            messages.append("loaded")
        except modelpatch.TensorParallelError as exc:
            messages.append(str(exc))
    (out / f"plan_refusals_rank{rank}.json").write_text(json.dumps(messages))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
