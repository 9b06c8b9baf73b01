"""Fusion benchmark: fused runtime modules vs the stock ones, both sides measured in one run.

1. Patch embedding (Qwen2-VL's ``PatchEmbed``, 1176 -> 1280): stock ``Conv3d`` vs the ``patch_embeddings`` fusion's
   ``Linear`` over the flattened patch, fp32 and bf16, 1024 to 16384 patches. Target on CPU: >= 2.5x faster.
2. A ~400 MB (bf16) Llama-shaped model (~207M parameters, the shape of ``benchmarks/load.py``), built locally with
   stock ``save_pretrained``: stock ``from_pretrained`` vs ``modelpatch.from_pretrained(..., fusion_config={"qkv":
   True, "gate_up": True})``, timing a 128-token prefill and one decode step (1 token, on a fresh copy of the KV
   cache of the 128-token prefill, made untimed). No speed target: on CPU a decode step is bound by memory bandwidth
   (the fused matmul reads the same weight bytes; docs/benchmarks.md), so these figures show what fusing costs.

Each figure is the median of repetitions after warm-up; stock and fused calls alternate so that drift (thermal,
other load) hits both sides alike. On a shared machine every parallel op can stall for a scheduling quantum: check
``uptime`` first, CPU figures taken with a load average above the core count are not worth comparing.
``torch.set_num_threads`` is left at its default. Outputs of both sides are compared (max abs difference) so a
speedup never comes from computing something else.

Usage::

    python benchmarks/fusions.py                      # CPU, fp32 and bf16 (several minutes on 2 cores)
    python benchmarks/fusions.py --device cuda        # the same figures on a GPU
    python benchmarks/fusions.py --dtypes fp32 --skip-patch-embed
    python benchmarks/fusions.py --quick              # tiny sizes, to check the script itself
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

import modelpatch
from modelpatch.fusions import PatchEmbeddingsFusionSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# ~207M parameters (~414 MB in bf16): 2 x 32000 x 1024 embeddings/head + 12 x (attention 3.1M + MLP 8.7M).
LLAMA = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
LLAMA_QUICK = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
FUSIONS = {"qkv": True, "gate_up": True}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Case = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]


def compare(
    stock: Case,
    fused: Case,
    device: torch.device,
    warmup: int = 3,
    budget_s: float = 20.0,
    min_repeats: int = 5,
    max_repeats: int = 100,
) -> tuple[float, float]:
    """Median seconds of ``stock()`` and ``fused()``, called alternately.

    A side may be ``(prepare, run)``: ``prepare()`` runs untimed before each timed ``run()``. Warm-up: one call of
    each, then up to ``warmup`` more while calls are short. Repetitions: as many as fit in ``budget_s`` for both
    sides together, within [``min_repeats``, ``max_repeats``].
    """

    def timed(case: Case) -> float:
        prepare, run = case if isinstance(case, tuple) else (None, case)
        if prepare is not None:
            prepare()
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        return time.perf_counter() - start

    first = timed(stock) + timed(fused)
    for _ in range(warmup if first < 1.0 else 0):
        first = timed(stock) + timed(fused)
    repeats = max(min_repeats, min(max_repeats, int(budget_s / max(first, 1e-9))))
    times: dict[str, list[float]] = {"stock": [], "fused": []}
    for _ in range(repeats):
        times["stock"].append(timed(stock))
        times["fused"].append(timed(fused))
    return statistics.median(times["stock"]), statistics.median(times["fused"])


def row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}\n")
    print(row(header, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(row(r, widths))


# --- 1. Patch embedding -------------------------------------------------------------------------------------------


def bench_patch_embed(device: torch.device, dtypes: list[str], patches: list[int], embed_dim: int, quick: bool):
    spec = PatchEmbeddingsFusionSpec()
    fused_class = spec.make_fused_class(PatchEmbed)
    rows, speedups = [], []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        torch.manual_seed(0)
        stock = PatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=embed_dim)
        fused = fused_class(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=embed_dim)
        with torch.no_grad():
            fused.proj.weight.copy_(stock.proj.weight.reshape(embed_dim, -1))
        stock, fused = stock.to(device, dtype).eval(), fused.to(device, dtype).eval()
        for n in patches:
            x = torch.randn(n, 3 * 2 * 14 * 14, device=device, dtype=dtype)
            with torch.inference_mode():
                diff = (stock(x).float() - fused(x).float()).abs().max().item()
                t_stock, t_fused = compare(
                    partial(stock, x),
                    partial(fused, x),
                    device,
                    budget_s=1.0 if quick else 15.0,
                    min_repeats=3 if quick else 5,
                )
            speedups.append((dtype_name, t_stock / t_fused))
            rows.append(
                [
                    dtype_name,
                    str(n),
                    f"{t_stock * 1e3:.2f}",
                    f"{t_fused * 1e3:.2f}",
                    f"{t_stock / t_fused:.2f}x",
                    f"{diff:.1e}",
                ]
            )
    print_table(
        f"Patch embedding forward, Qwen2-VL PatchEmbed 1176 -> {embed_dim} ({device.type})",
        ["dtype", "patches", "Conv3d ms", "Linear ms", "speedup", "max |diff|"],
        rows,
    )
    return speedups


# --- 2. Prefill / decode ------------------------------------------------------------------------------------------


def build_checkpoint(directory: Path, config_kwargs: dict) -> Path:
    """A bf16 Llama checkpoint written by stock ``save_pretrained`` (reused if already there)."""
    if (directory / "model.safetensors").is_file() and (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config_kwargs)).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def bench_llm(device: torch.device, dtypes: list[str], checkpoint: Path, prompt_len: int, quick: bool):
    rows, results = [], {}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        stock = LlamaForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
        fused = modelpatch.from_pretrained(LlamaForCausalLM, checkpoint, dtype=dtype, fusion_config=FUSIONS)
        fused = fused.to(device).eval()
        assert type(fused.model.layers[0].self_attn).__name__ == "QKVFusedLlamaAttention"
        assert type(fused.model.layers[0].mlp).__name__ == "GateUpFusedLlamaMLP"
        parameters = sum(p.numel() for p in stock.parameters())

        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, stock.config.vocab_size, (1, prompt_len), generator=generator).to(device)

        def prefill(model, prompt=prompt):
            def run():
                return model(input_ids=prompt, past_key_values=DynamicCache(config=model.config), use_cache=True)

            return run

        def decoder(model, prompt=prompt):
            """One decode step on a cache holding the prompt; each step gets a fresh copy of that cache (untimed)."""
            prefilled = DynamicCache(config=model.config)
            token = model(input_ids=prompt, past_key_values=prefilled, use_cache=True).logits[:, -1:].argmax(-1)
            state = {}

            def prepare():
                state["cache"] = copy.deepcopy(prefilled)

            def run():
                return model(input_ids=token, past_key_values=state["cache"], use_cache=True).logits

            return prepare, run

        def once(case):
            prepare, run = case
            prepare()
            return run()

        with torch.inference_mode():
            prefill_diff = (prefill(stock)().logits.float() - prefill(fused)().logits.float()).abs().max().item()
            stock_decode, fused_decode = decoder(stock), decoder(fused)
            decode_diff = (once(stock_decode).float() - once(fused_decode).float()).abs().max().item()
            budget = 1.0 if quick else 40.0
            t_prefill = compare(prefill(stock), prefill(fused), device, budget_s=budget, min_repeats=5)
            t_decode = compare(stock_decode, fused_decode, device, budget_s=budget, min_repeats=10, max_repeats=200)
        for step, (t_stock, t_fused), diff in (("prefill", t_prefill, prefill_diff), ("decode", t_decode, decode_diff)):
            results[(dtype_name, step)] = t_stock / t_fused
            tokens = f"{prompt_len} tok" if step == "prefill" else f"1 tok @ {prompt_len}"
            rows.append(
                [
                    dtype_name,
                    step,
                    tokens,
                    f"{t_stock * 1e3:.1f}",
                    f"{t_fused * 1e3:.1f}",
                    f"{t_stock / t_fused:.2f}x",
                    f"{diff:.1e}",
                ]
            )
        del stock, fused
    print_table(
        f"Llama-shaped model, {parameters / 1e6:.0f}M parameters ({parameters * 2 / 1e6:.0f} MB in bf16), "
        f"qkv + gate_up vs stock ({device.type})",
        ["dtype", "step", "tokens", "stock ms", "fused ms", "speedup", "max |logit diff|"],
        rows,
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--patches", default="1024,4096,16384", help="patch counts for the patch embedding")
    parser.add_argument("--prompt", type=int, default=128, help="prefill length / decode cache length")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="where to build (or reuse) the Llama checkpoint (default: a temporary directory)",
    )
    parser.add_argument("--skip-patch-embed", action="store_true")
    parser.add_argument("--skip-llm", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions (checks the script)")
    args = parser.parse_args(argv)

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtypes {unknown}; choose among {sorted(DTYPES)}")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, modelpatch {modelpatch.__version__}; "
        f"device {device.type} ({name}); torch threads {torch.get_num_threads()}; python {sys.version.split()[0]}"
    )

    failures = []
    if not args.skip_patch_embed:
        patches = [64, 256] if args.quick else [int(p) for p in args.patches.split(",")]
        speedups = bench_patch_embed(device, dtypes, patches, 64 if args.quick else 1280, args.quick)
        worst = min(s for _, s in speedups)
        print(f"\npatch embedding: worst speedup {worst:.2f}x (CPU target >= 2.5x)")
        if device.type == "cpu" and not args.quick and worst < 2.5:
            failures.append(f"patch embedding {worst:.2f}x < 2.5x")

    if not args.skip_llm:
        with tempfile.TemporaryDirectory() as tmp:
            directory = args.checkpoint_dir or Path(tmp) / "llama"
            checkpoint = build_checkpoint(directory, LLAMA_QUICK if args.quick else LLAMA)
            results = bench_llm(device, dtypes, checkpoint, 16 if args.quick else args.prompt, args.quick)
        for dtype_name in dtypes:
            decode = results[(dtype_name, "decode")]
            print(f"decode step {dtype_name}: {decode:.2f}x stock's speed")

    if failures:
        print("\nBelow target: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
