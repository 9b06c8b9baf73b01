"""LoRA on MoE experts: forward + backward of a LoRA-adapted Qwen3-MoE, modelpatch's ``ExpertsLora`` on the
``linear_experts`` Linears against stock PEFT's ``ParamWrapper`` on transformers' 3-D experts.

Both sides hold the same adapter (made by stock PEFT with ``target_parameters=["experts.gate_up_proj",
"experts.down_proj"]``, loaded onto the fused model with ``modelpatch.load_adapter``, trainable). Stock PEFT adds
every expert's update ``B_e @ A_e`` to its weight at each forward (materialising an ``[E, out, in]`` delta per
parameter); modelpatch computes ``B_e (A_e x)`` at each expert's Linears on the tokens routed to it. The two are called
alternately (``compare`` of ``benchmarks/fusions.py``); the table gives the median seconds of one forward + backward,
the ratio (stock / ours: above 1 is faster), and the peak memory one step adds (CUDA's allocator peak on a GPU;
on the CPU, how far resident memory rises above where it stood).

Usage::

    python benchmarks/moe_lora.py                        # CPU, fp32
    python benchmarks/moe_lora.py --device cuda --dtype bf16 --experts 64 --tokens 4096
    python benchmarks/moe_lora.py --quick                # tiny sizes, to check the script itself
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import tempfile
from pathlib import Path

import peft
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import modelpatch
from fusions import DTYPES, compare, print_table


def _models(args: argparse.Namespace, root: Path, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(root / "model")
    dtype = DTYPES[args.dtype]
    stock_model = Qwen3MoeForCausalLM.from_pretrained(root / "model", dtype=dtype).to(device)
    lora = peft.LoraConfig(
        r=args.rank, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]
    )
    stock = peft.get_peft_model(stock_model, lora)
    stock.save_pretrained(root / "adapter")
    fused_model = modelpatch.from_pretrained(
        Qwen3MoeForCausalLM, root / "model", fusion_config={"linear_experts": True}, dtype=dtype
    ).to(device)
    fused = modelpatch.load_adapter(fused_model, root / "adapter", is_trainable=True)
    return stock, fused


def _step(model: torch.nn.Module, input_ids: torch.Tensor):
    def run() -> None:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_peak(run) -> str:
    """How far the process's resident memory rose above where it stood during one step: glibc's free lists are
    returned first (``malloc_trim``), then Linux's peak-RSS mark is reset (``clear_refs`` 5) and read after the step
    (``VmHWM``). Linux only; ``-`` elsewhere."""
    try:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        run()
        return f"{(_status_kib('VmHWM') - before) / 1024:.0f} MiB"
    except OSError:
        return "-"


def _peak(run, device: torch.device) -> str:
    """The memory one step adds at its peak: CUDA's allocator peak on a GPU, the rise of resident memory on the CPU."""
    if device.type != "cuda":
        return _cpu_peak(run)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.experts, args.top_k, args.layers, args.tokens = 64, 32, 8, 2, 1, 32
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as directory:
        stock, fused = _models(args, Path(directory), device)
        input_ids = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.no_grad():
            difference = (stock(input_ids=input_ids).logits - fused(input_ids=input_ids).logits).abs().max().item()
        stock_run, fused_run = _step(stock, input_ids), _step(fused, input_ids)
        stock_s, fused_s = compare(stock_run, fused_run, device, budget_s=5.0 if args.quick else 20.0)
        rows = [
            ["stock PEFT ParamWrapper", f"{stock_s * 1e3:.2f} ms", "1.00x", _peak(stock_run, device)],
            [
                "modelpatch ExpertsLora",
                f"{fused_s * 1e3:.2f} ms",
                f"{stock_s / fused_s:.2f}x",
                _peak(fused_run, device),
            ],
        ]
    print_table(
        f"LoRA forward + backward, Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts of "
        f"{args.intermediate}, top-{args.top_k}, r={args.rank}, {args.tokens} tokens, {args.dtype}, {device} "
        f"(logits max abs difference {difference:.2e})",
        ["side", "median", "stock / ours", "peak"],
        rows,
    )


if __name__ == "__main__":
    main()
