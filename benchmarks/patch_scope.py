"""Patch-scope benchmark: what ``modelpatch.apply_patches`` adds to building a model, and what entering a scope costs.

One process, one run. A small-but-nontrivial Llama (8 layers, hidden 256, by default) is built repeatedly:

(a) stock: ``LlamaForCausalLM(config)`` before modelpatch's ``nn.Module.__new__`` dispatcher exists (pristine torch),
    and again once it is installed, outside any scope (the cost every later construction in the process pays);
(b) inside ``modelpatch.apply_patches()`` with 10 registered patterns: 9 that match nothing and 1 that replaces
    ``LlamaMLP`` with a subclass;
(c) entering + exiting a scope with nothing built: ``apply_patches()`` with an empty registry, with the 10 patterns,
    and a ``Patcher`` holding them.

For reference, transformers' own ``transformers.monkey_patching.apply_patches`` is entered + exited with the same 10
patterns registered there (its ``register_patch_mapping``); its registry is restored afterwards.

Constructions are timed on the CPU device (real weight initialisation) and on the meta device (no allocation, so the
per-module cost of the dispatcher is not hidden by initialisation). The dispatcher's cost is also measured per module
in a tight loop (a tiny module built thousands of times), which is what multiplies with the module count.

Clocks: the primary figure is the process CPU time (``time.process_time``: all threads of this process, not counting
time spent waiting for a CPU), which stays meaningful on a shared, loaded machine; the wall-clock median is printed
beside it. Variants of (b) are measured round-robin with their stock baseline; medians over ``--repeats`` after
``--warmup`` untimed rounds. The pristine baseline is necessarily measured first (the dispatcher cannot be removed once
installed). Target: under 10 ms added per construction.

Usage::

    python benchmarks/patch_scope.py
    python benchmarks/patch_scope.py --repeats 50 --layers 8 --hidden 256
    python benchmarks/patch_scope.py --quick      # a few repeats, to check the script itself
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import modelpatch

TARGET_ADDED_MS = 10.0


class BenchLlamaMLP(LlamaMLP):
    """The one matching replacement: a subclass that keeps LlamaMLP's math."""


def _unused(name: str) -> type[nn.Module]:
    return type(name, (nn.Module,), {"__module__": __name__})


# 9 patterns that match no Llama class (exact names of other models' classes and regexes) + 1 that matches LlamaMLP.
PATTERNS: dict[str, type[nn.Module]] = {
    "Qwen2MoeExperts": _unused("Unused0"),
    "MixtralSparseMoeBlock": _unused("Unused1"),
    r".*VisionAttention$": _unused("Unused2"),
    r"^Gemma\d*RMSNorm$": _unused("Unused3"),
    r".*PatchEmbed$": _unused("Unused4"),
    "BertSelfAttention": _unused("Unused5"),
    r"^T5.*Block$": _unused("Unused6"),
    r"Whisper(Encoder|Decoder)Layer": _unused("Unused7"),
    r".*Conv3d.*": _unused("Unused8"),
    "LlamaMLP": BenchLlamaMLP,
}


@dataclass
class Timing:
    cpu_ms: float  # median process CPU time
    wall_ms: float  # median wall-clock time


def _time_once(fn: Callable[[], object]) -> tuple[int, int]:
    gc.collect()
    gc.disable()
    try:
        cpu, wall = time.process_time_ns(), time.perf_counter_ns()
        result = fn()
        cpu, wall = time.process_time_ns() - cpu, time.perf_counter_ns() - wall
    finally:
        gc.enable()
    del result
    return cpu, wall


def _round_robin(variants: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, Timing]:
    samples: dict[str, list[tuple[int, int]]] = {name: [] for name in variants}
    for i in range(warmup + repeats):
        for name, fn in variants.items():
            measured = _time_once(fn)
            if i >= warmup:
                samples[name].append(measured)
    return {
        name: Timing(statistics.median(c for c, _ in values) / 1e6, statistics.median(w for _, w in values) / 1e6)
        for name, values in samples.items()
    }


def _per_call_us(fn: Callable[[], object], batch: int, samples: int) -> float:
    """Median CPU microseconds per call of ``fn`` (batches of ``batch`` calls)."""
    times = []
    for _ in range(samples):
        gc.disable()
        try:
            start = time.thread_time_ns()
            for _ in range(batch):
                fn()
            times.append((time.thread_time_ns() - start) / batch)
        finally:
            gc.enable()
    return statistics.median(times) / 1e3


def _build(config: LlamaConfig, device: str, scoped: bool) -> Callable[[], object]:
    def build():
        if scoped:
            with modelpatch.apply_patches(), torch.device(device):
                return LlamaForCausalLM(config)
        with torch.device(device):
            return LlamaForCausalLM(config)

    return build


def _check_patched(config: LlamaConfig) -> None:
    with modelpatch.apply_patches():
        model = LlamaForCausalLM(config)
    types = {type(layer.mlp) for layer in model.model.layers}
    assert types == {BenchLlamaMLP}, f"the LlamaMLP patch did not apply: {types}"
    assert {type(layer.mlp) for layer in LlamaForCausalLM(config).model.layers} == {LlamaMLP}


def _enter_exit_us(make_scope: Callable[[], object], batch: int, samples: int) -> float:
    def run():
        with make_scope():
            pass

    return _per_call_us(run, batch, samples)


def _transformers_entry_ms(repeats: int) -> Timing:
    from transformers import monkey_patching as hf
    from transformers.models.llama import modeling_llama

    saved = hf.get_patch_mapping()
    try:
        hf.clear_patch_mapping()
        hf.register_patch_mapping(PATTERNS)

        def enter_exit():
            with hf.apply_patches():
                assert modeling_llama.LlamaMLP is BenchLlamaMLP, "transformers' apply_patches did not patch LlamaMLP"

        return _round_robin({"hf": enter_exit}, repeats, warmup=1)["hf"]
    finally:
        hf.clear_patch_mapping()
        if saved:
            hf.register_patch_mapping(saved)
        assert hf.get_patch_mapping() == saved
        assert modeling_llama.LlamaMLP is LlamaMLP


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--hf-repeats", type=int, default=5, help="entries of transformers' apply_patches to time")
    parser.add_argument("--quick", action="store_true", help="few repeats, to check the script runs")
    args = parser.parse_args(argv)
    micro_batch, micro_samples = 2000, 15
    if args.quick:
        args.repeats, args.warmup, args.hf_repeats = 3, 1, 1
        micro_batch, micro_samples = 200, 3

    if "__new__" in nn.Module.__dict__:
        print("nn.Module.__new__ is already replaced: run this benchmark in a fresh process", file=sys.stderr)
        return 2
    modelpatch.clear_patch_mapping()
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    probe = LlamaForCausalLM(config)
    modules_per_model = sum(1 for _ in probe.modules())
    params = sum(p.numel() for p in probe.parameters())
    del probe
    tiny_norm = lambda: LlamaRMSNorm(8)  # noqa: E731 - a cheap transformers module: its cost is mostly the dispatch
    tiny_config = LlamaConfig(hidden_size=8, intermediate_size=8, num_attention_heads=1, vocab_size=8)
    tiny_mlp = lambda: LlamaMLP(tiny_config)  # noqa: E731 - the replaced class, tiny so that the dispatch shows

    # (a) Stock with pristine torch. Must come first: the dispatcher, once installed, stays.
    pristine = _round_robin(
        {"cpu": _build(config, "cpu", False), "meta": _build(config, "meta", False)}, args.repeats, args.warmup
    )
    micro = {"pristine": _per_call_us(tiny_norm, micro_batch, micro_samples)}
    micro["pristine-mlp"] = _per_call_us(tiny_mlp, micro_batch // 4, micro_samples)

    # Register the 10 patterns; the first non-empty scope installs the dispatcher.
    modelpatch.register_patch_mapping(PATTERNS)
    _check_patched(config)
    assert "__new__" in nn.Module.__dict__

    # (a') stock with the dispatcher installed and (b) inside apply_patches, round-robin.
    built = _round_robin(
        {
            "stock-cpu": _build(config, "cpu", False),
            "scope-cpu": _build(config, "cpu", True),
            "stock-meta": _build(config, "meta", False),
            "scope-meta": _build(config, "meta", True),
        },
        args.repeats,
        args.warmup,
    )
    micro["installed"] = _per_call_us(tiny_norm, micro_batch, micro_samples)
    with modelpatch.apply_patches():
        micro["scope"] = _per_call_us(tiny_norm, micro_batch, micro_samples)  # resolved once, then cached
        micro["scope-mlp"] = _per_call_us(tiny_mlp, micro_batch // 4, micro_samples)  # -> BenchLlamaMLP

    # (c) Entering + exiting scopes, nothing built.
    patcher = modelpatch.Patcher(PATTERNS)
    enter_patterns = _enter_exit_us(modelpatch.apply_patches, micro_batch, micro_samples)
    enter_patcher = _enter_exit_us(lambda: patcher, micro_batch, micro_samples)
    modelpatch.clear_patch_mapping()
    enter_empty = _enter_exit_us(modelpatch.apply_patches, micro_batch, micro_samples)

    hf_entry = _transformers_entry_ms(args.hf_repeats)

    # ------------------------------------------------------------------ report
    print(
        f"Llama: {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M parameters, {modules_per_model} "
        f"modules per model; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} intra-op threads"
    )
    print(
        f"median of {args.repeats} constructions per variant after {args.warmup} warm-up rounds; "
        "10 patterns registered, 1 matching (LlamaMLP -> subclass)"
    )
    print("CPU = process CPU time (robust on a loaded machine), wall = wall clock; added/ratio use CPU time")
    print()
    print(f"{'(a)/(b) one model construction':<60} {'CPU ms':>9} {'wall ms':>9} {'added ms':>9} {'ratio':>7}")
    for device in ("cpu", "meta"):
        base = pristine[device].cpu_ms
        rows = [
            ("(a) stock, pristine torch (measured first)", pristine[device], base),
            ("(a) stock, dispatcher installed, outside any scope", built[f"stock-{device}"], base),
            ("(b) inside apply_patches(), vs pristine stock", built[f"scope-{device}"], base),
            (
                "(b) inside apply_patches(), vs stock of the same rounds",
                built[f"scope-{device}"],
                built[f"stock-{device}"].cpu_ms,
            ),
        ]
        print(f"[device={device}]")
        for label, timing, baseline in rows:
            print(
                f"  {label:<58} {timing.cpu_ms:>9.3f} {timing.wall_ms:>9.3f} {timing.cpu_ms - baseline:>+9.3f} "
                f"{timing.cpu_ms / baseline:>6.3f}x"
            )
    print()
    dispatch_out = micro["installed"] - micro["pristine"]
    dispatch_in = micro["scope"] - micro["pristine"]
    print(f"{'per-module construction (CPU us per call)':<60} {'us':>9} {'added us':>9}")
    per_module_rows = [
        ("LlamaRMSNorm(8), pristine torch", micro["pristine"], micro["pristine"]),
        ("LlamaRMSNorm(8), dispatcher installed, outside any scope", micro["installed"], micro["pristine"]),
        ("LlamaRMSNorm(8), inside apply_patches() (not patched)", micro["scope"], micro["pristine"]),
        ("LlamaMLP(hidden 8), pristine torch", micro["pristine-mlp"], micro["pristine-mlp"]),
        ("LlamaMLP(hidden 8) inside apply_patches() -> BenchLlamaMLP", micro["scope-mlp"], micro["pristine-mlp"]),
    ]
    for label, value, baseline in per_module_rows:
        print(f"  {label:<58} {value:>9.2f} {value - baseline:>+9.2f}")
    worst_dispatch = max(dispatch_out, dispatch_in, 0.0)
    print(
        f"  => x {modules_per_model} modules: {dispatch_out * modules_per_model / 1e3:+.3f} ms per model outside a "
        f"scope, {dispatch_in * modules_per_model / 1e3:+.3f} ms inside one"
    )
    print()
    print(f"{'(c) scope entry + exit, nothing built':<60} {'CPU us':>9}")
    print(f"  {'modelpatch.apply_patches(), empty registry':<58} {enter_empty:>9.2f}")
    print(f"  {'modelpatch.apply_patches(), 10 patterns':<58} {enter_patterns:>9.2f}")
    print(f"  {'modelpatch.Patcher(10 patterns)':<58} {enter_patcher:>9.2f}")
    print(
        f"  {'transformers.monkey_patching.apply_patches(), 10 patterns':<58} {hf_entry.cpu_ms * 1e3:>9.0f}"
        f"   (= {hf_entry.cpu_ms:.1f} ms CPU, {hf_entry.wall_ms:.1f} ms wall)"
    )
    print()

    added_vs_pristine = max(built[f"scope-{d}"].cpu_ms - pristine[d].cpu_ms for d in ("cpu", "meta"))
    added_same_round = max(built[f"scope-{d}"].cpu_ms - built[f"stock-{d}"].cpu_ms for d in ("cpu", "meta"))
    estimate = worst_dispatch * modules_per_model / 1e3 + enter_patterns / 1e3
    added = max(added_vs_pristine, added_same_round, estimate)
    verdict = "OK" if added < TARGET_ADDED_MS else "OVER TARGET"
    print(
        f"added per construction: {added_same_round:+.3f} ms vs stock of the same rounds, {added_vs_pristine:+.3f} ms "
        f"vs pristine stock, {estimate:+.3f} ms from per-module dispatch + scope entry"
    )
    print(f"worst: {added:+.3f} ms; target < {TARGET_ADDED_MS:.0f} ms: {verdict}")
    speedup = hf_entry.cpu_ms * 1e3 / max(enter_patterns, 1e-9)
    print(f"transformers' apply_patches entry vs modelpatch's: {speedup:,.0f}x")
    return 0 if added < TARGET_ADDED_MS else 1


if __name__ == "__main__":
    sys.exit(main())
