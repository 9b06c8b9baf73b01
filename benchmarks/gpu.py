"""GPU benchmark: stock transformers against modelpatch's fusions on one accelerator, every figure in one run.

Both sides are built from the same weights, in the same process, called alternately (``compare`` of
``benchmarks/fusions.py``: medians after warm-up, the device synchronised around each call); "speed" is stock's time
divided by ours (above 1: modelpatch is faster). Outputs are compared, so a speed never comes from computing
something else. It builds its own checkpoint (nothing is downloaded) and takes about 5 minutes on one H100 / H200.

1. **load** of a bf16 Llama-3-8B-shaped checkpoint with 8 layers (5.6 GB, hidden 4096, MLP 14336, 32 heads / 8 KV,
   vocab 128256; in the page cache, just written) straight to the device (``device_map``): the ``from_pretrained``
   call of stock, of modelpatch unfused and of modelpatch with ``qkv`` + ``gate_up``, with the peak device memory
   of each; then a whole fresh process per side (imports + load + first forward).
2. **eager prefill** (1 x 2048 and 8 x 512 tokens) and **eager forward of one token** (no cache) of that model:
   ``qkv`` alone, ``gate_up`` alone, both.
3. **eager generate**, 128 new tokens (greedy), batch 1 and 16: both fusions.
4. **compiled decoding**: ``generate(..., cache_implementation="static")``, which transformers compiles, on the first
   4 layers, 64 new tokens: ms per token; the fused model's compiled tokens are checked against its eager tokens.
5. **linear_experts** against stock's ``grouped_mm`` experts: a Qwen3-30B-A3B-shaped sparse block (hidden 2048, 128
   experts of 768, top-8), 1 / 32 / 512 / 4096 / 16384 tokens.

Usage::

    python benchmarks/gpu.py                  # on cuda:0, full sizes
    python benchmarks/gpu.py --quick          # on the CPU, tiny sizes: checks the script (CI runs this)
    python benchmarks/gpu.py --skip load,compiled

Record the figures with the card's name (printed first) in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from experts import build_blocks
from transformers import CompileConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

import modelpatch
from fusions import _sync, compare, print_table

SECTIONS = ("load", "prefill", "generate", "compiled", "experts")
LLAMA = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
LLAMA_QUICK = dict(LLAMA, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
MOE = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
MOE_QUICK = dict(hidden_size=64, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4)
FUSIONS = {"qkv": {"qkv": True}, "gate_up": {"gate_up": True}, "both": {"qkv": True, "gate_up": True}}


class Run:
    """What one invocation measures with: device, dtype, sizes and time budgets."""

    def __init__(self, quick: bool, device: torch.device):
        self.quick, self.device = quick, device
        self.dtype = torch.bfloat16
        self.llama = LLAMA_QUICK if quick else LLAMA
        self.moe = MOE_QUICK if quick else MOE
        self.prefills = [(1, 32), (4, 8)] if quick else [(1, 2048), (8, 512)]
        self.batches = [1, 4] if quick else [1, 16]
        self.new_tokens = 8 if quick else 128
        self.compiled_tokens = 8 if quick else 64
        self.experts_tokens = [1, 32, 256] if quick else [1, 32, 512, 4096, 16384]
        self.budget = 0.5 if quick else 6.0
        self.speeds: dict[str, float] = {}
        self.diffs: dict[str, float] = {}  # max |stock - ours| of each compared output

    def time(self, stock: Callable[[], object], ours: Callable[[], object], repeats: int = 5) -> tuple[float, float]:
        return compare(stock, ours, self.device, warmup=2, budget_s=self.budget, min_repeats=repeats)

    def speed(self, name: str, t_stock: float, t_ours: float) -> str:
        self.speeds[name] = t_stock / t_ours
        return f"{t_stock / t_ours:.3f}x"

    def diff(self, name: str, ours: torch.Tensor, stock: torch.Tensor) -> str:
        self.diffs[name] = (ours.float() - stock.float()).abs().max().item()
        return f"{self.diffs[name]:.1e}"


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_checkpoint(directory: Path, sizes: dict, device: torch.device) -> Path:
    """A bf16 Llama checkpoint written by stock ``save_pretrained`` (weights made on ``device``: fast at 5.6 GB)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**sizes, dtype="bfloat16"))
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.02)
            else:
                parameter.fill_(1.0)  # norms
    model.save_pretrained(directory)
    del model
    _release()
    return directory


def _load(run: Run, path: Path, side: str) -> tuple[torch.nn.Module, float, float]:
    """(model, seconds of the from_pretrained call, peak device memory in GB) of one side."""
    _release()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    _sync(run.device)
    start = time.perf_counter()
    if side == "stock":
        model = LlamaForCausalLM.from_pretrained(path, dtype=run.dtype, device_map=str(run.device))
    else:
        fusions = FUSIONS["both"] if side == "fused" else None
        model = modelpatch.from_pretrained(
            LlamaForCausalLM, path, dtype=run.dtype, device_map=str(run.device), fusion_config=fusions
        )
    _sync(run.device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(run.device) / 1e9 if run.device.type == "cuda" else float("nan")
    return model.eval(), seconds, peak


PROCESS = """
import sys, time
start = time.perf_counter()
import torch, transformers, modelpatch
side, path, device = sys.argv[1:4]
cls = transformers.LlamaForCausalLM
kwargs = dict(dtype=torch.bfloat16, device_map=device)
if side == "stock":
    model = cls.from_pretrained(path, **kwargs)
else:
    model = modelpatch.from_pretrained(cls, path, fusion_config={"qkv": True, "gate_up": True} if side == "fused"
                                       else None, **kwargs)
with torch.inference_mode():
    model(input_ids=torch.ones(1, 8, dtype=torch.long, device=device)).logits.float().sum().item()
print(time.perf_counter() - start)
"""


def _process_seconds(side: str, path: Path, device: torch.device) -> float:
    """Seconds of a fresh interpreter that imports, loads ``side`` and runs a first forward."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", PROCESS, side, str(path), str(device)],
        check=True,
        capture_output=True,
        env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"),
    )
    return time.perf_counter() - start


def bench_load(run: Run, path: Path) -> None:
    rounds = 1 if run.quick else 2
    seconds: dict[str, list[float]] = {"stock": [], "plain": [], "fused": []}
    peaks: dict[str, float] = {}
    for _ in range(rounds):
        for side in seconds:
            model, elapsed, peaks[side] = _load(run, path, side)
            seconds[side].append(elapsed)
            del model
    best = {side: min(values) for side, values in seconds.items()}
    process = {side: _process_seconds(side, path, run.device) for side in seconds}  # one each: ~15 s apiece
    rows = [
        [side, f"{best[side]:.2f}", run.speed(f"load {side}", best["stock"], best[side]), f"{peaks[side]:.2f}",
         f"{process[side]:.2f}", run.speed(f"process {side}", process["stock"], process[side])]
        for side in ("plain", "fused")
    ]  # fmt: skip
    rows.insert(0, ["stock", f"{best['stock']:.2f}", "1", f"{peaks['stock']:.2f}", f"{process['stock']:.2f}", "1"])
    print_table(
        f"1. load to {run.device} (page cache warm): best of {rounds}",
        ["side", "from_pretrained s", "speed", "peak GB", "fresh process s", "speed"],
        rows,
    )


def bench_prefill(run: Run, stock: torch.nn.Module, fused: dict[str, torch.nn.Module]) -> None:
    rows = []
    vocab = stock.config.vocab_size
    cases = [(f"prefill {b}x{t}", b, t) for b, t in run.prefills] + [("forward 1 token", 1, 1)]
    with torch.inference_mode():
        for label, batch, tokens in cases:
            ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
            ids = ids.to(run.device)
            reference = stock(input_ids=ids, use_cache=False).logits
            for name, model in fused.items():
                diff = run.diff(f"{label} {name}", model(input_ids=ids, use_cache=False).logits, reference)
                t_stock, t_ours = run.time(
                    lambda ids=ids: stock(input_ids=ids, use_cache=False),
                    lambda ids=ids, model=model: model(input_ids=ids, use_cache=False),
                )
                speed = run.speed(f"{label} {name}", t_stock, t_ours)
                rows.append([label, name, f"{t_stock * 1e3:.2f}", f"{t_ours * 1e3:.2f}", speed, diff])
    print_table("2. eager prefill / one-token forward (no cache)", ["case", "fusion", "stock ms", "ours ms", "speed",
                                                                  "max |logit diff|"], rows)  # fmt: skip


def _generation(new_tokens: int, **kwargs: object) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)


def bench_generate(run: Run, stock: torch.nn.Module, fused: torch.nn.Module) -> None:
    rows = []
    config = _generation(run.new_tokens, pad_token_id=0)
    with torch.inference_mode():
        for batch in run.batches:
            ids = torch.randint(1, stock.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(batch))
            ids = ids.to(run.device)
            same = torch.equal(
                stock.generate(ids, generation_config=config), fused.generate(ids, generation_config=config)
            )
            t_stock, t_ours = run.time(
                lambda ids=ids: stock.generate(ids, generation_config=config),
                lambda ids=ids: fused.generate(ids, generation_config=config),
                repeats=3,
            )
            speed = run.speed(f"generate batch {batch}", t_stock, t_ours)
            rows.append([str(batch), f"{t_stock * 1e3:.0f}", f"{t_ours * 1e3:.0f}", speed, str(same)])
    print_table(
        f"3. eager generate, {run.new_tokens} new tokens, qkv + gate_up",
        ["batch", "stock ms", "ours ms", "speed", "same tokens"],
        rows,
    )


def _first_layers(model: torch.nn.Module, count: int) -> torch.nn.Module:
    """``model`` cut to its first ``count`` decoder layers (the same weights, no copy)."""
    model.model.layers = model.model.layers[:count]
    model.config.num_hidden_layers = count
    return model


def bench_compiled(run: Run, stock: torch.nn.Module, fused: torch.nn.Module) -> None:
    compile_config = CompileConfig()  # transformers' defaults: inductor, "reduce-overhead" (CUDA graphs)
    if run.device.type == "cpu":
        compile_config._compile_all_devices = True  # transformers compiles on accelerators; on the CPU when told to
    config = _generation(run.compiled_tokens, pad_token_id=0, cache_implementation="static",
                         compile_config=compile_config)  # fmt: skip
    eager = _generation(run.compiled_tokens, pad_token_id=0)
    ids = torch.randint(1, stock.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(run.device)
    with torch.inference_mode():
        # Compiled kernels round otherwise than eager ones: stock's own pair is the reference for the fused one.
        same = {
            side: torch.equal(*(model.generate(ids, generation_config=c) for c in (config, eager)))
            for side, model in (("stock", stock), ("fused", fused))
        }
        t_stock, t_ours = run.time(
            lambda: stock.generate(ids, generation_config=config),
            lambda: fused.generate(ids, generation_config=config),
            repeats=3,
        )
    per_token = [t / run.compiled_tokens * 1e3 for t in (t_stock, t_ours)]
    speed = run.speed("compiled decoding", t_stock, t_ours)
    print_table(
        f"4. compiled decoding (static cache, transformers' compile), {len(stock.model.layers)} layers, "
        f"{run.compiled_tokens} new tokens, qkv + gate_up",
        ["stock ms/token", "ours ms/token", "speed", "compiled tokens == eager tokens: stock / ours"],
        [[f"{per_token[0]:.3f}", f"{per_token[1]:.3f}", speed, f"{same['stock']} / {same['fused']}"]],
    )


def bench_experts(run: Run) -> None:
    stock, ours = build_blocks(run.moe, run.dtype)
    stock, ours = stock.to(run.device), ours.to(run.device)
    rows = []
    with torch.inference_mode():
        for tokens in run.experts_tokens:
            x = torch.randn(1, tokens, run.moe["hidden_size"], generator=torch.Generator().manual_seed(tokens))
            x = x.to(run.device, run.dtype)
            diff = run.diff(f"experts {tokens}", ours(x), stock(x))
            t_stock, t_ours = run.time(lambda x=x: stock(x), lambda x=x: ours(x), repeats=10)
            speed = run.speed(f"experts {tokens}", t_stock, t_ours)
            rows.append([str(tokens), f"{t_stock * 1e3:.3f}", f"{t_ours * 1e3:.3f}", speed, diff])
    print_table(
        f"5. MoE sparse block, grouped_mm experts vs linear_experts, {run.moe}",
        ["tokens", "stock ms", "ours ms", "speed", "max |diff|"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CPU, tiny sizes (checks the script)")
    parser.add_argument("--device", default=None, help="default: cuda:0 (the CPU with --quick)")
    parser.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {', '.join(SECTIONS)}")
    parser.add_argument("--json", type=Path, help="also write every speed to this file")
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := skip - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose among {', '.join(SECTIONS)}")
    device = torch.device(args.device or ("cpu" if args.quick else "cuda:0"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --quick for the CPU check")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(
        f"device {device} ({name}); python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, modelpatch {modelpatch.__version__}; {'QUICK' if args.quick else 'full size'}"
    )
    run = Run(args.quick, device)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "llama", run.llama, device)
        if "load" not in skip:
            bench_load(run, path)
        if {"prefill", "generate", "compiled"} - skip:
            stock = LlamaForCausalLM.from_pretrained(path, dtype=run.dtype, device_map=str(device)).eval()
            fused = {
                name: modelpatch.from_pretrained(
                    LlamaForCausalLM, path, dtype=run.dtype, device_map=str(device), fusion_config=fusions
                ).eval()
                for name, fusions in FUSIONS.items()
            }
            if "prefill" not in skip:
                bench_prefill(run, stock, fused)
            if "generate" not in skip:
                bench_generate(run, stock, fused["both"])
            if "compiled" not in skip:
                bench_compiled(run, _first_layers(stock, 4), _first_layers(fused["both"], 4))
            del stock, fused
            _release()
    if "experts" not in skip:
        bench_experts(run)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    slower = sorted(name for name, speed in run.speeds.items() if speed < 1.0)
    print("slower than stock: " + (", ".join(slower) if slower else "none"))
    if args.json:
        found = {"device": name, "quick": args.quick, "speeds": run.speeds, "diffs": run.diffs}
        args.json.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
