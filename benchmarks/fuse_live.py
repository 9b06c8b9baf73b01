"""``modelpatch.fuse`` / ``unfuse`` on a model already in memory: time and peak memory, beside a fused load.

A ~400 MB (bf16) Llama-shaped model is written with stock ``save_pretrained``, loaded with stock ``from_pretrained``,
then fused in place (``qkv`` + ``gate_up``) and unfused again. Reported, each in a fresh process:

* the time of ``fuse`` and ``unfuse``, next to the time of stock ``from_pretrained`` and of a fused
  ``modelpatch.from_pretrained`` of the same checkpoint (the alternative to fusing in memory);
* the peak resident memory *added* during ``fuse`` / ``unfuse`` (sampled every millisecond from /proc), as a multiple
  of the largest converted group (one layer's fused ``gate_up_proj``): the target is <= 1x plus allocator slack. The
  model's tensors are first moved into process memory, as after training (a fresh stock load holds views of the
  memory-mapped checkpoint, whose pages stay mapped when a module drops them).

Usage::

    python benchmarks/fuse_live.py            # ~400 MB model (a minute or two on 2 cores)
    python benchmarks/fuse_live.py --quick    # tiny model, to check the script itself
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LLAMA = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
LLAMA_QUICK = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
FUSIONS = {"qkv": True, "gate_up": True}


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakRss:
    """Highest resident set size seen while the ``with`` body runs, sampled from another thread."""

    def __enter__(self) -> PeakRss:
        self.start = self.peak = _rss()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _measure(mode: str, path: str) -> dict[str, float]:
    """One measurement, in this (fresh) process."""
    import torch
    from transformers import AutoModelForCausalLM

    import modelpatch

    if mode == "fused_load":
        start = time.perf_counter()
        modelpatch.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSIONS)
        return {"seconds": time.perf_counter() - start}
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = time.perf_counter() - start
    with torch.no_grad():
        # In process memory, as after training (stock's load leaves views of the memory-mapped file, whose pages
        # stay mapped when a module drops them): what fuse frees is then really freed.
        for param in model.parameters():
            param.data = param.data.clone()
    group = max(layer.mlp.gate_proj.weight.nbytes + layer.mlp.up_proj.weight.nbytes for layer in model.model.layers)
    with PeakRss() as fuse_rss:
        start = time.perf_counter()
        modelpatch.fuse(model, FUSIONS)
        fused = time.perf_counter() - start
    with PeakRss() as unfuse_rss:
        start = time.perf_counter()
        modelpatch.unfuse(model)
        unfused = time.perf_counter() - start
    return {
        "stock_load_seconds": loaded,
        "fuse_seconds": fused,
        "unfuse_seconds": unfused,
        "largest_group_bytes": group,
        "fuse_peak_added_bytes": fuse_rss.peak - fuse_rss.start,
        "unfuse_peak_added_bytes": unfuse_rss.peak - unfuse_rss.start,
    }


def _in_fresh_process(mode: str, path: Path) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement (median reported)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(*args.child)))
        return

    import statistics

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**(LLAMA_QUICK if args.quick else LLAMA))).to(torch.bfloat16).save_pretrained(path)
        live = [_in_fresh_process("live", path) for _ in range(args.repeats)]
        loads = [_in_fresh_process("fused_load", path)["seconds"] for _ in range(args.repeats)]

    def median(key: str) -> float:
        return statistics.median(run[key] for run in live)

    group = median("largest_group_bytes")
    print(f"torch {torch.__version__}; median of {args.repeats} fresh processes; largest group {group / 2**20:.1f} MiB")
    print("| step | seconds | peak memory added | / largest group |")
    print("|---|---|---|---|")
    print(f"| stock from_pretrained | {median('stock_load_seconds'):.3f} | | |")
    print(f"| modelpatch fused from_pretrained | {statistics.median(loads):.3f} | | |")
    for step in ("fuse", "unfuse"):
        added = median(f"{step}_peak_added_bytes")
        print(f"| {step} | {median(f'{step}_seconds'):.3f} | {added / 2**20:.1f} MiB | {added / group:.2f}x |")


if __name__ == "__main__":
    main()
