"""Compiled decoding benchmark: static-cache ``generate`` compiled by transformers itself, fused vs stock.

``generate(..., cache_implementation="static")`` compiles the decoding forward with transformers' ``CompileConfig``
(inductor, ``mode="reduce-overhead"``: CUDA graphs on a GPU; on the CPU it compiles only when told to, which this
script does). Two models, random weights written by stock ``save_pretrained`` and loaded by both sides from the same
files (stock ``from_pretrained`` vs ``modelpatch.from_pretrained``, both with ``device_map=<device>``):

* ``llama``: Llama-3-8B-shaped layers (hidden 4096, intermediate 14336, 32 heads, 8 key/value heads, vocabulary
  128256), 4 layers; fused with ``qkv`` + ``gate_up``;
* ``moe``: Qwen3-30B-A3B-shaped layers (hidden 2048, 128 experts of 768, top 8, vocabulary 151936), 2 layers; fused
  with ``linear_experts``.

Per model and side: milliseconds per generated token (an N-token and a 2-token ``generate`` of the same prompt,
their difference over N - 2 tokens, medians; the sides alternate), the first call's seconds (compiling), and what
dynamo made of it: frames compiled (one expected: more is a graph break or a recompile), graphs, graph breaks,
inductor's CUDA-graph skips, and the instructions the compiled frame runs after its graph call (Python replayed on
every call: stock's frame builds its outputs there; anything more is overhead that CUDA graphs do not remove). The
fused side's compiled tokens are compared with its own eager tokens. ``--logs`` turns on torch's logs of
recompiles, graph breaks and CUDA-graph decisions (why inductor skipped them).

Usage::

    python benchmarks/compiled_generate.py --device cuda          # on a GPU: the figures of interest
    python benchmarks/compiled_generate.py --models llama --logs  # CPU, with torch's compile logs
    python benchmarks/compiled_generate.py --quick                # tiny sizes, to check the script itself
"""

from __future__ import annotations

import argparse
import dis
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import transformers
from torch._dynamo import convert_frame
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

import modelpatch

MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
        {"qkv": True, "gate_up": True},
    ),
    "moe": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=2,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
        ),
        {"linear_experts": True},
    ),
}
QUICK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
QUICK_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


def config_of(name: str, quick: bool) -> tuple[transformers.PretrainedConfig, dict[str, Any]]:
    model_type, sizes, fusions = MODELS[name]
    if quick:
        sizes = {**sizes, **{k: v for k, v in QUICK.items() if k in sizes}, **QUICK_HEADS}
    return AutoConfig.for_model(model_type, **sizes), fusions


def after_graph(code: Any) -> int:
    """Instructions of a compiled frame after its graph call."""
    instructions = list(dis.get_instructions(code))
    for index, instruction in enumerate(instructions):
        if instruction.opname == "STORE_FAST" and str(instruction.argval).startswith("graph_out"):
            return len(instructions) - index - 1
    return -1


class Side:
    """One model and what its compiled decoding did."""

    def __init__(self, model: transformers.PreTrainedModel, prompt: torch.Tensor, config: CompileConfig):
        self.model, self.prompt, self.config = model, prompt, config
        self.codes: list[Any] = []
        self.stats: dict[str, int] = {}

    def generate(self, tokens: int, compiled: bool = True) -> torch.Tensor:
        return self.model.generate(
            self.prompt,
            attention_mask=torch.ones_like(self.prompt),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            cache_implementation="static",
            compile_config=self.config,
            disable_compile=not compiled,
        )

    def first_call(self, tokens: int, device: torch.device, compiled_frames: list[Any]) -> float:
        """Seconds of the first compiled ``generate``; records what dynamo (adding the code of each frame it compiles
        to ``compiled_frames``) and inductor did meanwhile."""
        counters.clear()
        before = len(compiled_frames)
        start = time.perf_counter()
        self.generate(tokens)
        sync(device)
        seconds = time.perf_counter() - start
        self.codes = compiled_frames[before:]
        self.stats = {
            "frames": len(self.codes),
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "cudagraph skips": counters["inductor"]["cudagraph_skips"],
            "after graph": after_graph(self.codes[0]) if self.codes else -1,
        }
        return seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_token(sides: dict[str, Side], tokens: int, repeats: int, device: torch.device) -> dict[str, float]:
    """Median milliseconds per generated token, the sides alternating."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, side in sides.items():
            spans = []
            for count in (tokens, 2):
                sync(device)
                start = time.perf_counter()
                side.generate(count)
                sync(device)
                spans.append(time.perf_counter() - start)
            times[name].append((spans[0] - spans[1]) / (tokens - 2) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def bench(name: str, device: torch.device, dtype: torch.dtype, tokens: int, repeats: int, quick: bool) -> list[str]:
    config, fusions = config_of(name, quick)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(tmp)
        stock = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, device_map=str(device)).eval()
        fused = modelpatch.from_pretrained(
            AutoModelForCausalLM, tmp, dtype=dtype, device_map=str(device), fusion_config=fusions
        ).eval()
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # the CPU compiles as a GPU would
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=generator).to(device)
    sides = {"stock": Side(stock, prompt, compile_config), "fused": Side(fused, prompt, compile_config)}
    torch._dynamo.reset()
    compiled_frames: list[Any] = []
    handle = convert_frame.register_bytecode_hook(lambda code, new_code: compiled_frames.append(new_code))
    try:
        first = {side_name: side.first_call(tokens, device, compiled_frames) for side_name, side in sides.items()}
        compiled_tokens = sides["fused"].generate(tokens)
        equal = torch.equal(compiled_tokens, sides["fused"].generate(tokens, compiled=False))
        ms = per_token(sides, tokens, repeats, device)
    finally:
        handle.remove()
    rows = []
    for side_name, side in sides.items():
        stats = side.stats
        rows.append(
            f"| {name} | {side_name} | {ms[side_name]:.3f} | {ms['stock'] / ms[side_name]:.3f}x | "
            f"{first[side_name]:.1f} | {stats['frames']} | {stats['graphs']} | {stats['breaks']} | "
            f"{stats['cudagraph skips']} | {stats['after graph']} | "
            + ("" if side_name == "stock" else ("equal" if equal else "**differ**"))
            + " |"
        )
    if len(compiled_frames) != len(sides["stock"].codes) + len(sides["fused"].codes):
        rows.append(f"(dynamo compiled frames again after the first calls: {len(compiled_frames)} in all)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--models", default="llama,moe", help="comma-separated: llama, moe")
    parser.add_argument("--tokens", type=int, help="generated tokens of a timed generate (64; --quick: 8)")
    parser.add_argument("--repeats", type=int, help="timed generates per side (5; --quick: 2)")
    parser.add_argument("--logs", action="store_true", help="torch's logs: recompiles, graph breaks, CUDA graphs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few tokens (checks the script; CPU proxy)")
    args = parser.parse_args(argv)

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.logs:
        torch._logging.set_logs(recompiles=True, graph_breaks=True, cudagraphs=True, perf_hints=True)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if unknown := [n for n in names if n not in MODELS]:
        parser.error(f"unknown models {unknown}; choose among {sorted(MODELS)}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    tokens = args.tokens or (8 if args.quick else 64)
    repeats = args.repeats or (2 if args.quick else 5)
    if tokens < 3:
        parser.error("--tokens: at least 3 (a 2-token generate is subtracted)")

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, modelpatch {modelpatch.__version__}; "
        f"device {device.type} ({device_name}); {args.dtype}; {tokens} tokens; python {sys.version.split()[0]}\n"
    )
    print(
        "| model | side | ms/token | speed | first call s | frames | graphs | graph breaks | cudagraph skips "
        "| instructions after graph | compiled tokens vs eager |"
    )
    print("|" + "---|" * 11)
    for name in names:
        for line in bench(name, device, dtype, tokens, repeats, args.quick):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
