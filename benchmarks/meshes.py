"""``distributed_config`` meshes benchmark: load, collective save and weight stream of a Llama on four CPU ranks
(gloo), modelpatch against stock transformers' own ``DistributedConfig`` load of the same checkpoint, in one
``torchrun`` launch.

The checkpoint (a 12-layer 768-wide Llama with a 32000-token vocabulary, 134M parameters, fp32: 0.54 GB) is written
once by stock ``save_pretrained`` into ``--out`` (deleted afterwards unless ``--keep``). For each mesh (``fsdp_size=4``;
``dp_replicate_size=2, fsdp_size=2``, HSDP) and each side (stock; modelpatch unfused; modelpatch with
``fusion_config={"qkv": True, "gate_up": True}``), every rank:

* **load**: ``from_pretrained(path, distributed_config=DistributedConfig(...))``;
* **save**: stock's ``model.save_pretrained`` of its sharded model; modelpatch's collective ``save_pretrained``;
* **stream**: the full weights in the original layout, one at a time: stock gathers them with
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (its route to full weights), modelpatch yields
  them from ``iter_original_state_dict``.

Per phase: the slowest rank's wall time, each rank's peak resident memory above its resident memory before the
phase (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) and the bytes of files each rank wrote
(``write_bytes`` of ``/proc/self/io``: file pages dirtied, not the collectives' sockets). Rounds alternate which side
goes first; medians are printed with the ratios ours / stock (the slowest rank's time, the largest rank's figures).
Both sides' saves are checked to hold the same tensors.

Usage::

    python benchmarks/meshes.py              # builds the checkpoint in /tmp, launches 4 ranks, 3 rounds
    python benchmarks/meshes.py --quick      # a tiny model, to check the script itself
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from fsdp import _reset_peak, _status, _trim  # benchmarks/fsdp.py: the same peak-memory probes
from tensor_parallel import launch_ranks  # benchmarks/tensor_parallel.py: the same launch

HERE = Path(__file__).resolve()
RANKS = 4
MESHES = {"fsdp4": {"fsdp_size": 4}, "hsdp2x2": {"dp_replicate_size": 2, "fsdp_size": 2}}
SIDES = {"stock": None, "modelpatch": {}, "modelpatch_fused": {"qkv": True, "gate_up": True}}
FULL = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
QUICK = dict(FULL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _written() -> int:
    with open("/proc/self/io") as io:
        # write_bytes: the file pages this process dirtied (written or through a mapping), counted as they are
        # dirtied; unlike wchar it leaves out the collectives' socket traffic.
        return next(int(line.split()[1]) for line in io if line.startswith("write_bytes:"))


def _load(side: str, path: str, mesh: dict):
    import transformers
    from transformers.distributed import DistributedConfig

    import modelpatch

    config = DistributedConfig(**mesh)
    if side == "stock":
        return transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
    return modelpatch.AutoModelForCausalLM.from_pretrained(path, distributed_config=config, fusion_config=SIDES[side])


def _save(side: str, model, directory: Path) -> None:
    import modelpatch

    if side == "stock":
        model.save_pretrained(directory)
    else:
        modelpatch.save_pretrained(model, directory)


def _stream(side: str, model) -> int:
    """Read every weight whole in the original layout, one at a time; the number of elements read."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import modelpatch

    if side == "stock":
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sum(tensor.numel() for tensor in state.values())
    return sum(tensor.numel() for _, tensor in modelpatch.iter_original_state_dict(model))


def worker(path: str, out: Path, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import modelpatch  # noqa: F401  (imported before any clock starts, like transformers)

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples: dict[str, dict[str, list[float]]] = {}

    def phase(name: str, run):
        _trim()
        dist.barrier()
        before, written = _status("VmRSS"), _written()
        _reset_peak()
        start = time.perf_counter()
        value = run()
        elapsed = torch.tensor(time.perf_counter() - start)
        figures = {"peak_mib": (_status("VmHWM") - before) / 2**20, "written_mib": (_written() - written) / 2**20}
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        gathered: list[dict[str, float]] = [{}] * world
        dist.all_gather_object(gathered, figures)
        row = samples.setdefault(name, {})
        row.setdefault("wall_s", []).append(elapsed.item())
        for r, per_rank in enumerate(gathered):
            for key, amount in per_rank.items():
                row.setdefault(f"{key}_rank{r}", []).append(amount)
        return value

    # Warm the imports and the page cache: every side reads the files from memory.
    for file in Path(path).glob("*.safetensors"):
        file.read_bytes()
    for mesh_id, mesh in MESHES.items():
        for round_index in range(rounds):
            order = list(SIDES) if round_index % 2 == 0 else list(reversed(SIDES))
            for side in order:
                model = phase(f"{mesh_id} load {side}", functools.partial(_load, side, path, mesh))
                save_dir = out / f"{mesh_id}_{side}"
                phase(f"{mesh_id} save {side}", functools.partial(_save, side, model, save_dir))
                phase(f"{mesh_id} stream {side}", functools.partial(_stream, side, model))
                del model
                if rank == 0 and round_index < rounds - 1:
                    shutil.rmtree(save_dir)
                dist.barrier()
    if rank == 0:
        print(json.dumps(_summary(samples, out), indent=1))
    dist.destroy_process_group()


def _summary(samples: dict[str, dict[str, list[float]]], out: Path) -> dict:
    from safetensors.torch import load_file

    medians = {name: {key: statistics.median(values) for key, values in row.items()} for name, row in samples.items()}
    # One line a phase: the slowest rank's wall time, and the largest peak and write of any rank, ours / stock.
    ratios = {}
    for name, row in medians.items():
        mesh_id, what, side = name.split(" ")
        if side != "stock":
            stock = _worst(medians[f"{mesh_id} {what} stock"])
            ours = _worst(row)
            ratios[f"{name} / stock"] = {key: round(ours[key] / stock[key], 3) for key in ours if stock[key]}
    same = {}
    for mesh_id in MESHES:
        stock = _tensors(out / f"{mesh_id}_stock", load_file)
        for side in SIDES:
            if side != "stock":
                theirs = _tensors(out / f"{mesh_id}_{side}", load_file)
                same[f"{mesh_id} {side}"] = stock.keys() == theirs.keys() and all(
                    stock[key].equal(theirs[key]) for key in stock
                )
    return {"medians": medians, "ratios": ratios, "saves_hold_the_same_tensors": same}


def _worst(row: dict[str, float]) -> dict[str, float]:
    """A phase's wall time and its largest per-rank figures."""
    worst = {"wall_s": row["wall_s"]}
    for figure in ("peak_mib", "written_mib"):
        worst[f"max {figure}"] = max(amount for key, amount in row.items() if key.startswith(figure))
    return worst


def _tensors(directory: Path, load_file) -> dict:
    tensors: dict = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def build_checkpoint(path: Path, quick: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**(QUICK if quick else FULL))).to(torch.float32)
    model.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/modelpatch_bench_meshes"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the saves")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.rounds)
        return
    path = args.out / ("llama_quick" if args.quick else "llama")
    try:
        if not (path / "config.json").exists():
            build_checkpoint(path, args.quick)
        size = sum(file.stat().st_size for file in path.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e9:.2f} GB; load average before: {os.getloadavg()}")
        arguments = ["--worker", str(path), "--out", str(args.out), "--rounds", str(args.rounds)]
        launch_ranks(HERE, arguments, port=29519, ranks=RANKS)
        print(f"load average after: {os.getloadavg()}")
    finally:
        if not args.keep:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
