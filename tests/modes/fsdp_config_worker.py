"""One rank of the ``distributed_config`` FSDP2 / HSDP test (tests/modes/test_fsdp_config.py), under ``torchrun``.

For each run of the job file (a checkpoint, a mesh as ``DistributedConfig`` keywords, fusion configs): stock
transformers' ``from_pretrained`` with that ``distributed_config``, then modelpatch's with each fusion config. Each
model: how it is sharded (every parameter's placements, mesh and local shape; every ``fully_shard`` unit and the
parameters it owns), the bytes this rank's load copied into its shards, a few AdamW steps on this rank's own batch
(the losses), the trained weights in the checkpoint's original layout, and its saves (stock's ``save_pretrained``;
modelpatch's collective ``save_pretrained`` and ``model.save_pretrained``), and the collectives its load, its saves
and its stream of the original state called (:class:`Collectives`). Then the messages of loads whose ``fsdp_plan``
names a module the fused model lacks, or one it holds no parameters in, and of ``from_config`` given a
``distributed_config`` (stock's and modelpatch's).
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
import transformers
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

sys.path.insert(0, str(Path(__file__).parents[1]))

import modelpatch
from modelpatch.modes import fsdp
from support.distributed import training_losses

transformers.logging.set_verbosity_error()

STEPS = 3
# The collectives of torch.distributed (c10d's functions) and of the functional collectives DTensor's full_tensor and
# redistribute end in (funcol), by name; their autograd halves run only in backward passes.
COLLECTIVE = re.compile(
    r"_?(all_gather|all_reduce|broadcast|reduce|scatter|gather|all_to_all|barrier|monitored_barrier|send|recv|isend"
    r"|irecv|batch_isend_irecv)\w*"
)


class Collectives:
    """Every collective call made inside :meth:`counting`, as (function, shape of the largest tensor it moves: the
    gathered output, the reduced or broadcast tensor; None for objects and barriers).

    Each collective function of ``torch.distributed.distributed_c10d`` and of the functional collectives is wrapped
    wherever a module of torch.distributed, transformers or modelpatch holds it (``torch.distributed.all_gather``,
    ``funcol.all_gather_single`` that DTensor calls, names imported ``from`` them); a collective made inside another
    (``all_gather_object`` over ``all_gather``) counts once, as the outer one.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...] | None]] | None = None
        self.depth = 0
        wrappers: dict[int, Callable[..., Any]] = {}
        for module in (c10d, funcol):
            for name, function in vars(module).items():
                if (
                    inspect.isfunction(function)
                    and function.__module__ == module.__name__
                    and COLLECTIVE.fullmatch(name)
                    and not name.endswith(("_backward", "_setup_context"))
                ):
                    wrappers[id(function)] = self._wrapped(f"{module.__name__.rpartition('.')[2]}.{name}", function)
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(("torch.distributed", "transformers", "modelpatch")):
                continue
            for attribute, value in list(vars(module).items()):
                if id(value) in wrappers and callable(value):
                    setattr(module, attribute, wrappers[id(value)])

    def _wrapped(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            try:
                result = function(*args, **kwargs)
            finally:
                self.depth -= 1
            if self.calls is not None and self.depth == 0:
                moved = [_moved(value) for value in (*args, *kwargs.values(), result)]
                self.calls.append((name, max(moved, key=lambda shape: -1 if shape is None else _numel(shape))))
            return result

        return collective

    @contextmanager
    def counting(self) -> Iterator[list[tuple[str, tuple[int, ...] | None]]]:
        self.calls = calls = []
        try:
            yield calls
        finally:
            self.calls = None


def _moved(value: Any) -> tuple[int, ...] | None:
    """The shape of the tensor ``value`` (a list of tensors: their concatenation along dim 0), else None."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) and v.ndim for v in value):
        return (sum(v.shape[0] for v in value), *value[0].shape[1:])
    return None


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


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
    return training_losses(model, optimizer, tokens, targets, STEPS)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    collectives = Collectives()
    placed: list[int] = []
    original_place = fsdp.FullyShardedLoad.place

    def counting_place(self, key, value):
        placed.append(value.numel() * value.element_size())
        return original_place(self, key, value)

    # The bytes each rank's load hands over to be copied into its shards (what it reads of the files).
    fsdp.FullyShardedLoad.place = counting_place
    for run in job["runs"]:
        mesh_id, path, config = run["id"], Path(run["path"]), DistributedConfig(**run["mesh"])
        with collectives.counting() as load:
            stock = transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
        record = {"layout": layout(stock), "losses": train(stock, rank), "collectives": {"load": load}}
        with collectives.counting() as record["collectives"]["method"]:
            stock.save_pretrained(out / f"{mesh_id}_stock_save")
        torch.save(record, out / f"{mesh_id}_stock_rank{rank}.pt")
        del stock
        for case_id, fusion_config in run["fusions"].items():
            placed.clear()
            with collectives.counting() as load:
                model = modelpatch.from_pretrained(
                    transformers.AutoModelForCausalLM, path, fusion_config=fusion_config, distributed_config=config
                )
            record = {"layout": layout(model), "placed": sum(placed), "local": local_bytes(model)}
            record["losses"] = train(model, rank)
            counted: dict[str, list] = {"load": load}
            with collectives.counting() as counted["stream"]:
                record["trained"] = {key: t.clone() for key, t in modelpatch.iter_original_state_dict(model)}
            with collectives.counting() as counted["save"]:
                modelpatch.save_pretrained(model, out / f"{mesh_id}_{case_id}_modelpatch_save")
            with collectives.counting() as counted["method"]:
                model.save_pretrained(out / f"{mesh_id}_{case_id}_method_save")
            record["collectives"] = counted
            torch.save(record, out / f"{mesh_id}_{case_id}_rank{rank}.pt")
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
    # from_config with a distributed_config: stock's (which hands it to the model's __init__), modelpatch's function
    # and Auto class.
    build = job["from_config"]
    config = transformers.AutoConfig.from_pretrained(build["path"])
    sharding = DistributedConfig(**build["mesh"])
    builds = {
        "stock": lambda: transformers.AutoModelForCausalLM.from_config(config, distributed_config=sharding),
        "function": lambda: modelpatch.from_config(
            transformers.AutoModelForCausalLM, config, fusion_config=build["fusion"], distributed_config=sharding
        ),
        "auto": lambda: modelpatch.AutoModelForCausalLM.from_config(config, distributed_config=sharding),
    }
    refused = {}
    for name, make in builds.items():
        try:
            make()
            refused[name] = "built"
        except (TypeError, modelpatch.TensorParallelError) as exc:
            refused[name] = f"{type(exc).__name__}: {exc}"
    (out / f"from_config_rank{rank}.json").write_text(json.dumps(refused))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
