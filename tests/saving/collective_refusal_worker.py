"""One rank of tests/saving/test_collective_refusals.py, run under ``torchrun`` with gloo on two CPU processes.

An FSDP2-sharded llama (``fully_shard`` per decoder layer and on the root, filled by ``load_sharded``) is saved
collectively once, then each case below saves over that checkpoint in a way the ranks must refuse, each rank
writing down what it raised and how long it took; a barrier (the process group still usable: no collective of a save
was entered) separates the cases. Last, a collective save every rank makes alike, which must succeed.

* ``peft``: rank 1 saves its model wrapped by PEFT (``get_peft_model``), which it refuses itself;
* ``mixed``: rank 0 calls ``modelpatch.save_pretrained``, rank 1 ``model.save_pretrained``;
* ``rank0_only``: rank 0 saves, rank 1 never does;
* ``unsharded_late``: rank 1 saves an unsharded model (a plain load) once rank 0 waits in its collective save;
* ``unsharded_first``: the same, rank 1 first (its save writes the whole checkpoint), rank 0 a second later.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import peft
import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the support package

import modelpatch
from support.distributed import joined_job

transformers.logging.set_verbosity_error()


def sharded_model(path: str, mesh) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = modelpatch.from_config(transformers.AutoModelForCausalLM, config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return modelpatch.load_sharded(model, path)


def outcome(save) -> dict:
    """Run ``save()``: what it raised (or "saved") and the seconds it took."""
    start = time.monotonic()
    try:
        save()
        said = "saved"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    return {"said": said, "seconds": time.monotonic() - start}


def main() -> None:
    job, rank, mesh = joined_job()
    out, path = Path(job["out"]), job["path"]
    model = sharded_model(path, mesh)
    target = out / "target"
    modelpatch.save_pretrained(model, target)
    results = {}

    def case(name: str, save) -> None:
        dist.barrier()
        results[name] = outcome(save)
        dist.barrier()

    if rank == 1:
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
        case("peft", lambda: modelpatch.save_pretrained(wrapped, target))
        wrapped.unload()  # the sharded model without its adapter layers, for the next cases
    else:
        case("peft", lambda: modelpatch.save_pretrained(model, target))
    if rank == 0:
        case("mixed", lambda: modelpatch.save_pretrained(model, target))
    else:
        case("mixed", lambda: model.save_pretrained(target))
    case("rank0_only", lambda: modelpatch.save_pretrained(model, target) if rank == 0 else None)
    unsharded = modelpatch.from_pretrained(transformers.AutoModelForCausalLM, path)

    def late(first: int):
        def save() -> None:
            if rank != first:
                time.sleep(2)
            modelpatch.save_pretrained(model if rank == 0 else unsharded, target)

        return save

    case("unsharded_late", late(first=0))
    case("unsharded_first", late(first=1))
    case("after", lambda: modelpatch.save_pretrained(model, target))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
