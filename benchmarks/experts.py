"""MoE experts benchmark: stock transformers' fused 3-D experts vs the ``linear_experts`` fusion's per-expert Linears.

One Qwen3-MoE sparse block (router + experts) sized like a real layer (default: hidden 2048, 64 experts of
intermediate size 768, top-8), stock with its default ``grouped_mm`` experts implementation, against the same block
built with the ``linear_experts`` fused class holding the same weights. Timed: a 1x128-token prefill and a 1-token
decode step, fp32 and bf16, eager and under ``torch.compile`` (each side compiled on its own, ``fullgraph=False``;
graph breaks counted). Target on CPU: ours >= 0.9x stock everywhere.

Both sides are called alternately (``compare`` of ``benchmarks/fusions.py``), so drift hits them alike; outputs are
compared (max abs difference). Check ``uptime`` first: figures taken with a load average above the core count are
not worth comparing.

Usage::

    python benchmarks/experts.py                      # CPU, fp32 and bf16, eager and compiled
    python benchmarks/experts.py --no-compile --dtypes fp32
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


def build_blocks(sizes: dict, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(stock block, block whose experts are the ``linear_experts`` fused class), same weights, eval mode."""
    config = Qwen3MoeConfig(**sizes, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"  # what from_pretrained picks by default
    torch.manual_seed(0)
    stock = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.normal_(0, 0.02)
    stock = stock.to(dtype).eval()
    ours = copy.deepcopy(stock)
    fused_class = LinearExpertsFusionSpec().make_fused_class(type(stock.experts))
    experts = fused_class(config).to(dtype)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 1], help="tokens per call (prefill, decode)")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per case, both sides together")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = QUICK if args.quick else REAL
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads; block {sizes}"
    )
    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    rows = []
    for dtype_name in args.dtypes:
        stock, ours = build_blocks(sizes, DTYPES[dtype_name])
        for mode in modes:
            breaks = {}
            if mode == "compiled":
                sample = torch.randn(1, args.tokens[0], sizes["hidden_size"], dtype=DTYPES[dtype_name])
                with torch.inference_mode():
                    breaks = {"stock": graph_breaks(stock, sample), "ours": graph_breaks(ours, sample)}
                torch._dynamo.reset()
                run_stock, run_ours = torch.compile(stock, dynamic=False), torch.compile(ours, dynamic=False)
            else:
                run_stock, run_ours = stock, ours
            for tokens in args.tokens:
                x = torch.randn(1, tokens, sizes["hidden_size"], generator=torch.Generator().manual_seed(tokens))
                x = x.to(DTYPES[dtype_name])
                with torch.inference_mode():
                    diff = (run_stock(x).float() - run_ours(x).float()).abs().max().item()
                    t_stock, t_ours = compare(
                        lambda run_stock=run_stock, x=x: run_stock(x),
                        lambda run_ours=run_ours, x=x: run_ours(x),
                        torch.device("cpu"),
                        budget_s=1.0 if args.quick else args.budget,
                        min_repeats=5,
                    )
                rows.append(
                    [
                        dtype_name,
                        mode,
                        "prefill" if tokens > 1 else "decode",
                        str(tokens),
                        f"{t_stock * 1e3:.2f}",
                        f"{t_ours * 1e3:.2f}",
                        f"{t_stock / t_ours:.2f}x",
                        f"{diff:.1e}",
                        f"{breaks['stock']}/{breaks['ours']}" if breaks else "-",
                    ]
                )
                print(" | ".join(rows[-1]), flush=True)
    print_table(
        "Qwen3-MoE sparse block forward (router + experts), stock grouped_mm experts vs linear_experts (CPU)",
        ["dtype", "mode", "step", "tokens", "stock ms", "ours ms", "stock/ours", "max |diff|", "graph breaks s/o"],
        rows,
    )


if __name__ == "__main__":
    main()
