"""One rank of the cross-mesh DCP test (tests/modes/test_dcp_meshes.py), run under ``torchrun`` with gloo, 4 ranks.

For each case of the job file, a model loaded with ``distributed_config`` on the case's first mesh (HSDP, 2 x 2) is
trained two AdamW steps and checkpointed with ``torch.distributed.checkpoint`` twice: its own state with the
optimizer's (``get_state_dict``), and the original layout (``modelpatch.get_original_state_dict``). Two more steps
give the uninterrupted run's losses. Then, on the second mesh (``fsdp_size=4``):

* a model of the same structure resumes from the own-layout checkpoint (model and optimizer) and takes the same two
  steps: the losses of the resumed run;
* a model of the other structure (unfused where the first was fused, stock experts for ``linear_experts``) is filled
  from the original-layout checkpoint (``set_original_state_dict``).

Each rank writes down what it streamed of every model in the original layout (``iter_original_state_dict``, a
collective) and the losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers.distributed import DistributedConfig

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the support package

import modelpatch
from support.distributed import training_losses

transformers.logging.set_verbosity_error()
STEPS = 2


def load(path: str, mesh: dict, fusion_config: dict | None) -> transformers.PreTrainedModel:
    return modelpatch.from_pretrained(
        transformers.AutoModelForCausalLM,
        path,
        fusion_config=fusion_config,
        distributed_config=DistributedConfig(**mesh),
        dtype=torch.float32,
    )


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def batch(rank: int, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of the run's ``step``-th pair of steps (the same on every mesh: data-parallel ranks)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (2, 7), generator=generator)
    return tokens, torch.randint(0, vocab, (2, 7), generator=generator)


def streamed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in modelpatch.iter_original_state_dict(model)}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in job["cases"]:
        name, path, first, second = case["id"], case["path"], case["first_mesh"], case["second_mesh"]
        model = load(path, first, case["fusion_config"])
        optimizer = optimizer_of(model)
        vocab = model.config.vocab_size
        record: dict = {"first": training_losses(model, optimizer, *batch(rank, vocab, 0), STEPS)}
        record["at_checkpoint"] = streamed(model)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(out / f"{name}_own"))
        dcp.save({"model": modelpatch.get_original_state_dict(model)}, checkpoint_id=str(out / f"{name}_original"))
        record["uninterrupted"] = training_losses(model, optimizer, *batch(rank, vocab, 1), STEPS)
        del model, optimizer

        resumed = load(path, second, case["fusion_config"])
        optimizer = optimizer_of(resumed)
        model_state, optimizer_state = get_state_dict(resumed, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, checkpoint_id=str(out / f"{name}_own"))
        set_state_dict(resumed, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        record["resumed_state"] = streamed(resumed)
        record["resumed"] = training_losses(resumed, optimizer, *batch(rank, vocab, 1), STEPS)
        del resumed, optimizer

        other = load(path, second, case["other_fusion_config"])
        placeholders = {"model": modelpatch.get_original_state_dict(other)}
        dcp.load(placeholders, checkpoint_id=str(out / f"{name}_original"))
        modelpatch.set_original_state_dict(other, placeholders["model"])
        record["other_structure"] = streamed(other)
        del other
        torch.save(record, out / f"{name}_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
