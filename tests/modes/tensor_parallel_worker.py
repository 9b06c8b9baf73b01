"""One rank of the tensor-parallel test (tests/modes/test_tensor_parallel.py), run under ``torchrun`` with gloo.

For each case of the job file: load with modelpatch and ``tp_plan="auto"``, record this rank's logits and how each
parameter is sharded (and, for unfused cases, the same of stock transformers' own TP load), and save the model
through ``model.save_pretrained`` and ``modelpatch.save_pretrained`` (rank 0 writes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(1, str(Path(__file__).parents[1] / "fusions"))  # the worked example of a user-defined fusion

from test_user_defined_fusion import TENSOR_PARALLEL_FUSIONS

import modelpatch
from modelpatch.modes import parallel
from support.checkpoints import CheckpointSpec, TinyCheckpoint

transformers.logging.set_verbosity_error()


def layout(model: torch.nn.Module) -> dict[str, tuple]:
    """Per parameter: (tensor type, placements, local shape); and which modules carry TP forward hooks."""
    params = {
        name: (
            type(p.data).__name__,
            str(p.placements) if isinstance(p.data, DTensor) else None,
            tuple((p.to_local() if isinstance(p.data, DTensor) else p).shape),
        )
        for name, p in model.named_parameters()
    }
    hooked = sorted(name for name, module in model.named_modules() if getattr(module, "_is_hooked", False))
    return {"params": params, "hooked": hooked}


def checkpoint_of(name: str, path: Path, model_class: type) -> TinyCheckpoint:
    """The test's checkpoint ``name`` (already written at ``path``), for its inputs and outputs."""
    config = transformers.AutoConfig.from_pretrained(path)
    spec = CheckpointSpec(model_class, lambda: config)
    return TinyCheckpoint(name, path, model_class, spec, config.get_text_config().vocab_size)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    read_bytes = []
    original_fetch = parallel.ShardedLoad.fetch

    def counting_fetch(self, fetch):
        sharded = original_fetch(self, fetch)

        def counted(key):
            tensor = sharded(key)
            read_bytes.append(tensor.numel() * tensor.element_size())
            return tensor

        return counted

    # Counts the bytes each rank's load hands over to be copied or kept (what it reads of the files).
    parallel.ShardedLoad.fetch = counting_fetch
    for fusion, spec in TENSOR_PARALLEL_FUSIONS.items():
        modelpatch.register_fusion(fusion, spec())
    for case in job["cases"]:
        name, path = case["name"], Path(case["path"])
        model_class = getattr(transformers, case["class"])
        checkpoint = checkpoint_of(name, path, model_class)
        read_bytes.clear()
        model = modelpatch.from_pretrained(
            transformers.AutoModelForCausalLM, path, fusion_config=case["fusion_config"], tp_plan="auto"
        )
        rank = dist.get_rank()
        record = {"logits": checkpoint.outputs(model)["logits"], "layout": layout(model), "read": sum(read_bytes)}
        if case["compare_stock"]:
            stock = model_class.from_pretrained(path, tp_plan="auto")
            record["stock_layout"] = layout(stock)
            record["stock_logits"] = checkpoint.outputs(stock)["logits"]
        # Every rank streams the original layout (gathered tensor by tensor, a collective per tensor).
        record["streamed"] = {key: tensor.clone() for key, tensor in modelpatch.iter_original_state_dict(model)}
        torch.save(record, out / f"{case['id']}_rank{rank}.pt")
        model.save_pretrained(out / f"{case['id']}_stock_save")
        modelpatch.save_pretrained(model, out / f"{case['id']}_modelpatch_save")
    # Loads that must be refused on every rank before anything is read (so by the plan): the message each rank got.
    refusals = []
    for refusal in job.get("refusals", []):
        try:
            modelpatch.plan_pretrained(
                transformers.AutoModelForCausalLM,
                refusal["path"],
                tp_plan=refusal.get("tp_plan", "auto"),
                fusion_config=refusal.get("fusion_config"),
            )
            refusals.append("planned")
        except parallel.TensorParallelError as exc:
            refusals.append(str(exc))
    (out / f"refusals_rank{dist.get_rank()}.json").write_text(json.dumps(refusals))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
