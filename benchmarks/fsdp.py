"""FSDP2 benchmark: sharded load and collective save of a ~1.1 GB bf16 Llama on two CPU ranks (gloo), against the
gathering baselines, both sides in one ``torchrun`` launch.

The checkpoint (577M parameters, bf16: 1.15 GB) is written once by stock transformers' ``save_pretrained`` into
``--out`` (deleted afterwards unless ``--keep``). The model is fused (``qkv`` + ``gate_up``), so both directions run
conversions. Each rank, in turn:

* **sharded load** (modelpatch): build on the meta device, ``fully_shard`` per layer and on the root, ``to_empty``,
  ``modelpatch.load_sharded``; baseline: ``modelpatch.from_pretrained`` of the whole model on every rank, then
  ``fully_shard`` (a single-process load, then shard);
* **collective save** (modelpatch): ``modelpatch.save_pretrained`` on every rank; baseline: the full state gathered to
  rank 0 (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), converted back to the original layout
  and written by rank 0 alone.

Per phase: the slowest rank's wall time and each rank's peak resident memory above its resident memory before the
phase (``VmHWM`` after resetting it through ``/proc/self/clear_refs``). Both saves are checked to be byte-identical.

Usage::

    python benchmarks/fsdp.py            # builds the checkpoint in /tmp, launches 2 ranks
    python benchmarks/fsdp.py --quick    # a tiny model, to check the script itself
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import gc
import json
import os
import shutil
import time
from pathlib import Path

from tensor_parallel import launch_ranks  # noqa: E402  (benchmarks/tensor_parallel.py: the same launch)

HERE = Path(__file__).resolve()
FUSIONS = {"qkv": True, "gate_up": True}
# 10 layers of a 2048-wide Llama with a 32000-token vocabulary: 577M parameters, 1.15 GB in bf16.
FULL = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=10,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
QUICK = dict(FULL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _reset_peak() -> None:
    """Reset this process's peak resident memory (VmHWM) to its current resident memory (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _trim() -> None:
    from modelpatch.loading.materialize import return_freed_memory

    gc.collect()
    return_freed_memory()


def _sharded_model(path: str, mesh):
    import torch
    import transformers
    from torch.distributed.fsdp import fully_shard

    import modelpatch

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = modelpatch.from_config(transformers.AutoModelForCausalLM, config, fusion_config=FUSIONS, dtype="auto")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def _baseline_load(path: str, mesh):
    import transformers
    from torch.distributed.fsdp import fully_shard

    import modelpatch

    model = modelpatch.from_pretrained(transformers.AutoModelForCausalLM, path, fusion_config=FUSIONS)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _baseline_save(model, directory: Path) -> None:
    """Gather the full state on rank 0, convert it back to the original layout there and write it (rank 0 alone)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from modelpatch.checkpoint import write_checkpoint
    from modelpatch.saving.contents import config_files, model_layout

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tensors = model_layout(model, state).run(state.__getitem__)
        write_checkpoint(directory, tensors, extra_files=config_files(model, original_format=True))
    dist.barrier()


def worker(path: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import modelpatch

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results: dict[str, dict[str, float]] = {}

    def phase(name: str, run):
        _trim()
        dist.barrier()
        before = _status("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        value = run()
        elapsed = torch.tensor(time.perf_counter() - start)
        peak = _status("VmHWM") - before
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        peaks: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        results[name] = {"wall_s": elapsed.item(), **{f"peak_mib_rank{r}": p / 2**20 for r, p in enumerate(peaks)}}
        return value

    # Warm the imports (a meta build and a plan) and the page cache: both sides read the files from memory.
    modelpatch.plan_pretrained(transformers.AutoModelForCausalLM, path, fusion_config=FUSIONS)
    for file in Path(path).glob("*.safetensors"):
        file.read_bytes()
    sharded = phase("sharded load (modelpatch)", lambda: modelpatch.load_sharded(_sharded_model(path, mesh), path))
    phase("collective save (modelpatch)", functools.partial(modelpatch.save_pretrained, sharded, out / "collective"))
    del sharded
    baseline = phase("load then shard (baseline)", lambda: _baseline_load(path, mesh))
    phase("gather to rank 0 + save (baseline)", functools.partial(_baseline_save, baseline, out / "gathered"))
    del baseline
    if dist.get_rank() == 0:
        same = filecmp.cmp(out / "collective/model.safetensors", out / "gathered/model.safetensors", shallow=False)
        pairs = [
            ("sharded load (modelpatch)", "load then shard (baseline)"),
            ("collective save (modelpatch)", "gather to rank 0 + save (baseline)"),
        ]
        ratios = {
            f"{ours} / baseline": {
                key: results[ours][key] / results[base][key] for key in results[ours] if results[base][key]
            }
            for ours, base in pairs
        }
        print(json.dumps({"results": results, "ratios": ratios, "saves_identical": same}, indent=1))
    dist.destroy_process_group()


def build_checkpoint(path: Path, quick: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(QUICK if quick else FULL), dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    model.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("/tmp/modelpatch_bench_fsdp"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the saves")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return
    path = args.out / ("llama_quick" if args.quick else "llama")
    try:
        if not (path / "config.json").exists():
            build_checkpoint(path, args.quick)
        size = sum(file.stat().st_size for file in path.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e9:.2f} GB; load average before: {os.getloadavg()}")
        launch_ranks(HERE, ["--worker", str(path), "--out", str(args.out)], port=29518)
        print(f"load average after: {os.getloadavg()}")
    finally:
        if not args.keep:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
