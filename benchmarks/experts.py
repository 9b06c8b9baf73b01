"""MoE experts benchmark: stock transformers' fused 3-D experts vs the ``linear_experts`` fusion's per-expert Linears.

Two Qwen3-MoE sparse blocks (router + experts), stock with its default ``grouped_mm`` experts implementation, against
the same block built with the ``linear_experts`` fused class holding the same weights:

* one sized like a real layer (default: hidden 2048, 64 experts of intermediate size 768, top-8), timing a 1x128-token
  prefill and a 1-token decode step, fp32 and bf16, eager and under ``torch.compile`` (each side compiled on its own,
  ``fullgraph=False``; graph breaks counted). Target on CPU: ours >= 0.95x stock everywhere.
* a tiny one whose calls are bound by the host (hidden 64, 128 experts of 32, top-8, one token): what a call costs
  beyond its arithmetic (the operations issued, the check that the packed experts still stand as packed), which on a
  GPU is what a decode step costs. Timed per call over batches of calls. Target: ours >= 1.0x stock, eager. (Compiled
  in fp32, stock runs transformers' own fallback loop, which skips experts without tokens, where the CPU's grouped
  product loops over all 128: not the same arithmetic to compare.)

Both sides are called alternately (``compare`` of ``benchmarks/fusions.py``), so drift hits them alike; outputs are
compared (max abs difference). Check ``uptime`` first: figures taken with a load average above the core count are
not worth comparing.

Usage::

    python benchmarks/experts.py                      # CPU, fp32 and bf16, eager and compiled, both blocks
    python benchmarks/experts.py --no-compile --dtypes fp32
    python benchmarks/experts.py --blocks host-bound  # the tiny block only
    python benchmarks/experts.py --threads 1          # on a shared machine: parallel ops stall on busy cores
    python benchmarks/experts.py --device cuda --dtypes bf16 --experts 128 --tokens 1 32 512 4096 16384
    python benchmarks/experts.py --quick              # tiny sizes, to check the script itself
"""

from __future__ import annotations

import argparse
import copy
import platform

import torch
import transformers
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from fusions import DTYPES, compare, print_table
from modelpatch.fusions import LinearExpertsFusionSpec
from modelpatch.fusions.linear_experts.modules import LinearExperts

REAL = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8)
QUICK = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
HOST_BOUND = dict(hidden_size=64, moe_intermediate_size=32, num_experts=128, num_experts_per_tok=8)
# Calls per timed sample of the host-bound block: one call takes well under a millisecond.
HOST_BOUND_CALLS = 20


def build_blocks(
    sizes: dict, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(stock block, block whose experts are the ``linear_experts`` fused class), same weights, eval mode."""
    config = Qwen3MoeConfig(**sizes, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"  # what from_pretrained picks by default
    torch.manual_seed(0)
    stock = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.normal_(0, 0.02)
    stock = stock.to(device=device, dtype=dtype).eval()
    ours = copy.deepcopy(stock)
    fused_class = LinearExpertsFusionSpec().make_fused_class(type(stock.experts))
    experts = fused_class(config).to(device=device, dtype=dtype)
    intermediate = sizes["moe_intermediate_size"]
    with torch.no_grad():
        for index, expert in enumerate(experts):
            # In place: the weights stay views of the experts' packed 3-D tensors.
            expert.gate_proj.weight.copy_(stock.experts.gate_up_proj[index, :intermediate])
            expert.up_proj.weight.copy_(stock.experts.gate_up_proj[index, intermediate:])
            expert.down_proj.weight.copy_(stock.experts.down_proj[index])
    assert isinstance(experts, LinearExperts) and experts._packed is not None, "the experts should be packed"
    ours.experts = experts.eval()
    return stock, ours


def graph_breaks(block: torch.nn.Module, x: torch.Tensor) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(block)(x).graph_break_count


def time_block(
    stock: torch.nn.Module,
    ours: torch.nn.Module,
    x: torch.Tensor,
    device: torch.device,
    budget_s: float,
    calls: int = 1,
) -> tuple[float, float, float]:
    """(stock seconds per call, ours, max abs difference of their outputs), ``calls`` calls per timed sample."""

    def repeated(block: torch.nn.Module):
        def run() -> None:
            for _ in range(calls):
                block(x)

        return run

    with torch.inference_mode():
        diff = (stock(x).float() - ours(x).float()).abs().max().item()
        t_stock, t_ours = compare(repeated(stock), repeated(ours), device, budget_s=budget_s, min_repeats=5)
    return t_stock / calls, t_ours / calls, diff


def bench_block(
    name: str, sizes: dict, tokens: list[int], dtype_name: str, mode: str, args, calls: int = 1
) -> list[list[str]]:
    """The rows of one block in one dtype and mode."""
    device = torch.device(args.device)
    dtype = DTYPES[dtype_name]
    stock, ours = build_blocks(sizes, dtype, device)
    breaks = {}
    if mode == "compiled":
        sample = torch.randn(1, tokens[0], sizes["hidden_size"], dtype=dtype, device=device)
        with torch.inference_mode():
            breaks = {"stock": graph_breaks(stock, sample), "ours": graph_breaks(ours, sample)}
        torch._dynamo.reset()
        stock, ours = torch.compile(stock, dynamic=False), torch.compile(ours, dynamic=False)
    rows = []
    for count in tokens:
        x = torch.randn(1, count, sizes["hidden_size"], generator=torch.Generator().manual_seed(count))
        x = x.to(device=device, dtype=dtype)
        budget = 1.0 if args.quick else args.budget
        t_stock, t_ours, diff = time_block(stock, ours, x, device, budget, calls)
        rows.append(
            [
                name,
                dtype_name,
                mode,
                "prefill" if count > 1 else "decode",
                str(count),
                f"{t_stock * 1e3:.3f}",
                f"{t_ours * 1e3:.3f}",
                f"{t_stock / t_ours:.2f}x",
                f"{diff:.1e}",
                f"{breaks['stock']}/{breaks['ours']}" if breaks else "-",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 1], help="tokens per call (prefill, decode)")
    parser.add_argument("--blocks", nargs="+", default=["real", "host-bound"], choices=["real", "host-bound"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--experts", type=int, help="experts of the real block (default: 64; Qwen3-30B-A3B has 128)")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per case, both sides together")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    real = QUICK if args.quick else REAL
    if args.experts:
        real = dict(real, num_experts=args.experts)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads, {args.device}; real block {real}; host-bound block {HOST_BOUND}"
    )
    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    rows = []
    for dtype_name in args.dtypes:
        for mode in modes:
            if "real" in args.blocks:
                rows += bench_block("real", real, args.tokens, dtype_name, mode, args)
            if "host-bound" in args.blocks:
                rows += bench_block("host-bound", HOST_BOUND, [1], dtype_name, mode, args, HOST_BOUND_CALLS)
    print_table(
        "Qwen3-MoE sparse block forward (router + experts), stock grouped_mm experts vs linear_experts, per call",
        ["block", "dtype", "mode", "step", "tokens", "stock ms", "ours ms", "stock/ours", "max |diff|", "breaks s/o"],
        rows,
    )


if __name__ == "__main__":
    main()
