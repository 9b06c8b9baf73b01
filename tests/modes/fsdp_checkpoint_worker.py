"""One rank of the FSDP2 checkpoint test (tests/modes/test_fsdp_checkpoint.py), run under ``torchrun`` with gloo.

For each case of the job file, a model is built on the meta device (modelpatch's ``from_config`` with the case's
fusions), sharded with ``fully_shard`` per decoder layer and on the root, materialised with ``to_empty``, and then:

* filled with ``modelpatch.load_sharded``: its gathered state (rank 0 writes it) and its collective saves, original
  and runtime layout;
* trained: four steps uninterrupted; two steps, a DCP checkpoint of model and optimizer (``get_state_dict``), a fresh
  model and optimizer resumed from it, two more steps — the losses of both runs are recorded;
* its state saved to DCP in the original layout (``get_original_state_dict``), read back into a model built without
  the fusions (``set_original_state_dict``) and saved collectively.

Last, the last case's model saved collectively into a directory, made read-only, then saved there again: the message
each rank got. Then two saves over a previous checkpoint that every rank must refuse (the message or exception each
rank got is written down): from ranks holding differently fused models (rank 0 fused with ``qkv`` and ``gate_up``,
rank 1 with ``qkv`` only), and one interrupted on rank 1 (a real SIGINT, as Ctrl-C sends, raised when rank 1 writes
its first rows); that one ends the process group, so it comes last and rank 1 then exits at once, as Ctrl-C ends it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the support package

import modelpatch
import modelpatch.saving.sharded
from modelpatch.errors import ModelPatchError
from support.distributed import joined_job

transformers.logging.set_verbosity_error()


def sharded_model(path: str, fusion_config: dict | None, mesh) -> transformers.PreTrainedModel:
    """The case's model built on the meta device, sharded and filled from ``path`` by ``load_sharded``."""
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = modelpatch.from_config(transformers.AutoModelForCausalLM, config, fusion_config=fusion_config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return modelpatch.load_sharded(model, path)


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in model.state_dict().items()}


def batches(rank: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab - 8, (2, 16), generator=generator) for _ in range(4)]


def train(model, optimizer, inputs: list[torch.Tensor]) -> list[float]:
    model.train()
    losses = []
    for ids in inputs:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def refused_save(model, target: Path) -> str:
    """Save ``model`` into ``target`` collectively: "saved", or the type and message of what this rank raised."""
    try:
        modelpatch.save_pretrained(model, target)
    except (Exception, KeyboardInterrupt) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def interrupt_first_write() -> None:
    """Make this rank's next collective save receive SIGINT (what Ctrl-C sends) when it writes its first rows."""
    write_at = modelpatch.saving.sharded.write_at

    def interrupted(fd, offset, tensor):
        modelpatch.saving.sharded.write_at = write_at
        signal.raise_signal(signal.SIGINT)  # Python's own handler raises KeyboardInterrupt here
        write_at(fd, offset, tensor)

    modelpatch.saving.sharded.write_at = interrupted


def refused_saves(model, job: dict, out: Path, mesh) -> None:
    """The saves every rank must refuse, over a previous checkpoint of ``model`` (see the module docstring)."""
    rank = dist.get_rank()
    fusion_config = {"qkv": True, "gate_up": True} if rank == 0 else {"qkv": True}
    mixed = sharded_model(job["mixed_fusions"], fusion_config, mesh)
    modelpatch.save_pretrained(model, out / "mixed_fusions_save")
    (out / f"mixed_fusions_rank{rank}.txt").write_text(refused_save(mixed, out / "mixed_fusions_save"))
    modelpatch.save_pretrained(model, out / "interrupted_save")
    if rank == 1:
        interrupt_first_write()
    (out / f"interrupted_rank{rank}.txt").write_text(refused_save(model, out / "interrupted_save"))
    if rank == 1:
        os._exit(0)  # interrupted: gone, as Ctrl-C ends a process; the other rank learns it from its collectives


def main() -> None:
    job, rank, mesh = joined_job()
    out = Path(job["out"])
    for case in job["cases"]:
        name, path, fusion_config = case["id"], case["path"], case["fusion_config"]
        model = sharded_model(path, fusion_config, mesh)
        record: dict = {"loaded": gathered(model)}
        modelpatch.save_pretrained(model, out / f"{name}_save")
        modelpatch.save_pretrained(model, out / f"{name}_save_runtime", save_original_format=False)
        if case["train"]:
            inputs = batches(rank, model.config.vocab_size)
            record["uninterrupted"] = train(model, optimizer_of(model), inputs)
            # The interrupted run: two steps, a DCP checkpoint, a fresh model and optimizer, two more steps.
            model = sharded_model(path, fusion_config, mesh)
            optimizer = optimizer_of(model)
            record["resumed"] = train(model, optimizer, inputs[:2])
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(out / f"{name}_dcp"))
            record["at_checkpoint"] = gathered(model)
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            # The gathered optimizer state lands on rank 0 only.
            record["optimizer_at_checkpoint"] = get_state_dict(model, optimizer, options=full)[1].get("state")
            model = sharded_model(path, fusion_config, mesh)
            optimizer = optimizer_of(model)
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optimizer_state}
            dcp.load(state, checkpoint_id=str(out / f"{name}_dcp"))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            record["resumed"] += train(model, optimizer, inputs[2:])
        # The original layout through DCP, into a model built without the fusions.
        original = modelpatch.get_original_state_dict(model)
        dcp.save({"model": original}, checkpoint_id=str(out / f"{name}_dcp_original"))
        modelpatch.save_pretrained(model, out / f"{name}_before_original")
        unfused = sharded_model(path, None, mesh)
        placeholders = {"model": modelpatch.get_original_state_dict(unfused)}
        dcp.load(placeholders, checkpoint_id=str(out / f"{name}_dcp_original"))
        modelpatch.set_original_state_dict(unfused, placeholders["model"])
        modelpatch.save_pretrained(unfused, out / f"{name}_unfused_from_original")
        if rank == 0:
            torch.save(record, out / f"{name}.pt")
        else:
            torch.save({k: v for k, v in record.items() if k in ("uninterrupted", "resumed")}, out / f"{name}_1.pt")
    # A save every rank must refuse: rank 0 cannot replace a read-only directory. The previous files stay.
    target = out / "read_only_save"
    modelpatch.save_pretrained(model, target)
    dist.barrier()
    if rank == 0:
        target.chmod(0o555)
    dist.barrier()
    try:
        modelpatch.save_pretrained(model, target)
        refused = "saved"
    except ModelPatchError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    if rank == 0:
        target.chmod(0o755)
    (out / f"refused_rank{rank}.txt").write_text(refused)
    refused_saves(model, job, out, mesh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
