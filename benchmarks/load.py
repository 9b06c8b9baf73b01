"""Load benchmark: stock transformers ``from_pretrained`` vs ``modelpatch.from_pretrained``.

Two checkpoints are built locally with stock ``save_pretrained`` (bf16, one safetensors file each):

* ``llama``: a ~200M-parameter Llama (~400 MB), loaded without any conversion (the zero-copy path);
* ``moe``: a qwen2_moe-shaped model of a few hundred MB stored per expert, fused to 3-D experts at load.

Each is loaded four ways: stock, modelpatch without fusions, modelpatch with the case's fusions (``qkv`` +
``gate_up`` for llama, whose q/k/v and gate/up weights are then copied into fused Linears; ``linear_experts`` for the
MoE, whose per-expert tensors then load without conversion and are packed into 3-D tensors), and modelpatch loading
the same fused model from its runtime-layout checkpoint (written once, outside the clock, as ``modelpatch convert
--runtime-format`` writes it: what a user loading a fused model again and again keeps). The fused loads are
compared with stock's load of the original checkpoint, which does not fuse them.

Every measurement runs in a FRESH Python process (one subprocess per measurement) that imports torch, transformers,
modelpatch and the model's modeling module before the clock starts, so that import time is not load time: these are
in-process figures. What a user waits for (interpreter start, imports, load and first forward, warm and cold page
cache) is what ``benchmarks/process.py`` measures. Measured:

* load: the ``from_pretrained`` call (wall clock, and the process's CPU time, less sensitive to other load);
* load + forward: the same plus the first forward pass over 16 tokens;
* peak RSS growth during the load (``/proc/self/status`` VmHWM after resetting it via ``/proc/self/clear_refs``),
  and the RSS growth once loaded, both relative to the RSS just before the load.

Targets checked: llama load <= 0.5x stock, llama load + first forward <= 1.0x stock, the MoE conversion's peak RSS
growth <= 1.1x the model's bytes, and for each fused load: time <= 1.0x stock's (unfused) load, peak RSS growth <= 1.1x
the model's bytes. The page cache is warmed (every file read once) before measuring, for both.

Usage::

    python benchmarks/load.py                # full size, 3 fresh processes per measurement (a few minutes)
    python benchmarks/load.py --quick        # tiny models, to check the script itself
    python benchmarks/load.py --repeats 5 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()

CASES = {
    # ~207M parameters: 2 x 32000 x 1024 embeddings/head + 12 layers x (attention 3.1M + MLP 8.7M).
    "llama": (
        "llama",
        dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
    ),
    # ~220M parameters, ~75% of them in 16 experts per layer stored one tensor per expert.
    "moe": (
        "qwen2_moe",
        dict(
            vocab_size=16000,
            hidden_size=1024,
            intermediate_size=2816,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=1024,
            num_experts=16,
            num_experts_per_tok=4,
            num_hidden_layers=6,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
    ),
}
QUICK = {
    "llama": dict(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "moe": dict(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
# What the fused loads enable, per case.
FUSIONS = {"llama": {"qkv": True, "gate_up": True}, "moe": {"linear_experts": True}}
IMPLEMENTATIONS = ("stock", "modelpatch", "modelpatch-fused", "modelpatch-fused-runtime")
TOKENS = 16


# ------------------------------------------------------------------------------------------------- the worker


def _proc_status() -> dict[str, int]:
    """RSS figures of this process in bytes."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[name] = int(value.split()[0]) * 1024
    return out


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(impl: str, case: str, path: str) -> dict:
    """One measurement, in this (fresh) process. Prints nothing; returns the numbers."""
    import gc
    import importlib

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    import modelpatch

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model_type = AutoConfig.from_pretrained(path).model_type
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")  # not load time
    # transformers builds its conversion registry once per process (both loaders read it): not load time either.
    transformers.conversion_mapping.get_checkpoint_conversion_mapping(model_type)
    input_ids = torch.randint(0, 1000, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    # modelpatch exports its names lazily: importing its loader is import time, like the modeling module above.
    load = modelpatch.from_pretrained

    gc.collect()
    before = _proc_status()
    peak_reset = _reset_peak_rss()
    start, cpu_start = time.perf_counter(), time.process_time()
    if impl == "stock":
        model = AutoModelForCausalLM.from_pretrained(path)
    elif impl == "modelpatch":
        model = load(AutoModelForCausalLM, path)
    elif impl == "modelpatch-fused":
        model = load(AutoModelForCausalLM, path, fusion_config=FUSIONS[case])
    else:  # the fusions are recorded in the runtime layout's config.json
        model = load(AutoModelForCausalLM, _runtime_path(Path(path)))
    loaded, cpu_loaded = time.perf_counter(), time.process_time()
    after_load = _proc_status()
    with torch.no_grad():
        model(input_ids=input_ids)
    forward = time.perf_counter()

    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    fused = any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())
    return {
        "impl": impl,
        "case": case,
        "load_s": loaded - start,
        "load_cpu_s": cpu_loaded - cpu_start,
        "load_forward_s": forward - start,
        "peak_rss_growth": (after_load["VmHWM"] - before["VmRSS"]) if peak_reset else None,
        "rss_growth": after_load["VmRSS"] - before["VmRSS"],
        "anon_growth": after_load["RssAnon"] - before["RssAnon"],
        "model_bytes": model_bytes,
        "dtype": str(model.dtype),
        "fused_experts": fused,
    }


# ------------------------------------------------------------------------------------------------- the driver


def _runtime_path(path: Path) -> Path:
    return path.with_name(path.name + "-runtime")


def build_checkpoints(out: Path, quick: bool) -> dict[str, Path]:
    """Each case's checkpoint (stock ``save_pretrained``), and next to it its fused runtime-layout checkpoint."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from modelpatch.saving.convert import plan_conversion

    transformers.logging.set_verbosity_error()
    paths = {}
    for case, (model_type, kwargs) in CASES.items():
        kwargs = QUICK[case] if quick else kwargs
        path = out / f"{case}{'-quick' if quick else ''}"
        paths[case] = path
        marker = path / "config.json"
        if marker.is_file() and AutoConfig.from_pretrained(path).to_dict().get("hidden_size") == kwargs["hidden_size"]:
            if (_runtime_path(path) / "config.json").is_file():
                continue
        else:
            print(f"building {case} checkpoint in {path} ...", flush=True)
            torch.manual_seed(0)
            config = AutoConfig.for_model(model_type, **kwargs)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(path)
            del model
        with plan_conversion(AutoModelForCausalLM, path, fusion_config=FUSIONS[case]) as conversion:
            conversion.write(_runtime_path(path), runtime_format=True)
    return paths


def warm_page_cache(path: Path) -> None:
    for file in sorted(path.iterdir()):
        with file.open("rb") as f:
            while f.read(1 << 24):
                pass


def measure(impl: str, case: str, path: Path) -> dict:
    result = subprocess.run(
        [sys.executable, str(HERE), "--worker", impl, case, str(path)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.0f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="where checkpoints are built (reused)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement (median reported)")
    parser.add_argument("--quick", action="store_true", help="tiny models: check the script, not the speed")
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "CASE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0

    paths = build_checkpoints(args.out, args.quick)
    results: dict[tuple[str, str], dict] = {}
    for case, path in paths.items():
        warm_page_cache(path)
        warm_page_cache(_runtime_path(path))
        runs: dict[str, list[dict]] = {impl: [] for impl in IMPLEMENTATIONS}
        for _ in range(args.repeats):
            for impl in runs:  # interleaved, so drift affects all alike
                runs[impl].append(measure(impl, case, path))
        for impl, samples in runs.items():
            merged = dict(samples[0])
            for key in ("load_s", "load_cpu_s", "load_forward_s", "peak_rss_growth", "rss_growth", "anon_growth"):
                values = [s[key] for s in samples if s[key] is not None]
                merged[key] = statistics.median(values) if values else None
                merged[key + "_min"] = min(values) if values else None
            results[(case, impl)] = merged

    rows = []
    checks = []

    def row(case, metric, stock, mine, fmt, target=None, ratio_of=None, mins=None):
        ratio = (mine / stock) if (stock and mine is not None) else None
        shown_ratio = ratio if ratio_of is None else ratio_of
        verdict = ""
        if target is not None and shown_ratio is not None:
            ok = shown_ratio <= target
            checks.append(ok)
            verdict = f"<= {target:g}  {'ok' if ok else 'MISSED'}"
        best = "" if not mins or not mins[0] or mins[1] is None else f"{mins[1] / mins[0]:.2f}x"
        rows.append(
            (case, metric, fmt(stock), fmt(mine), "" if shown_ratio is None else f"{shown_ratio:.2f}x", best, verdict)
        )

    seconds = lambda v: "n/a" if v is None else f"{v:.3f} s"  # noqa: E731
    for case in paths:
        stock, mine, fused, runtime = (results[(case, impl)] for impl in IMPLEMENTATIONS)
        model_bytes = mine["model_bytes"]
        unfused = case == "llama"
        row(
            case,
            "load",
            stock["load_s"],
            mine["load_s"],
            seconds,
            0.5 if unfused else None,
            mins=(stock["load_s_min"], mine["load_s_min"]),
        )
        row(
            case,
            "load, CPU time (user + sys)",
            stock["load_cpu_s"],
            mine["load_cpu_s"],
            seconds,
            mins=(stock["load_cpu_s_min"], mine["load_cpu_s_min"]),
        )
        row(
            case,
            "load + first forward (16 tok)",
            stock["load_forward_s"],
            mine["load_forward_s"],
            seconds,
            1.0 if unfused else None,
            mins=(stock["load_forward_s_min"], mine["load_forward_s_min"]),
        )
        row(case, "peak RSS growth during load", stock["peak_rss_growth"], mine["peak_rss_growth"], _mb)
        row(case, "RSS growth after load", stock["rss_growth"], mine["rss_growth"], _mb)
        row(case, "anonymous RSS growth after load", stock["anon_growth"], mine["anon_growth"], _mb)
        if not unfused:
            peak = mine["peak_rss_growth"]
            row(
                case,
                "modelpatch peak RSS growth / model bytes",
                None,
                None,
                lambda v: "",
                1.1,
                None if peak is None else peak / model_bytes,
            )
            stock_peak = stock["peak_rss_growth"]
            row(
                case,
                "stock peak RSS growth / model bytes",
                None,
                None,
                lambda v: "",
                None,
                None if stock_peak is None else stock_peak / model_bytes,
            )
        rows.append((case, "model bytes", _mb(model_bytes), _mb(model_bytes), "", "", ""))
        fusions = "+".join(FUSIONS[case])
        row(
            case,
            f"fused ({fusions}) load vs stock load",
            stock["load_s"],
            fused["load_s"],
            seconds,
            1.0,
            mins=(stock["load_s_min"], fused["load_s_min"]),
        )
        row(
            case,
            f"fused ({fusions}) load, CPU time",
            stock["load_cpu_s"],
            fused["load_cpu_s"],
            seconds,
            mins=(stock["load_cpu_s_min"], fused["load_cpu_s_min"]),
        )
        row(case, f"fused ({fusions}) peak RSS growth", stock["peak_rss_growth"], fused["peak_rss_growth"], _mb)
        fused_peak = fused["peak_rss_growth"]
        row(
            case,
            f"fused ({fusions}) peak RSS growth / model bytes",
            None,
            None,
            lambda v: "",
            1.1,
            None if fused_peak is None else fused_peak / fused["model_bytes"],
        )
        row(
            case,
            f"fused ({fusions}) load + first forward vs stock's",
            stock["load_forward_s"],
            fused["load_forward_s"],
            seconds,
            mins=(stock["load_forward_s_min"], fused["load_forward_s_min"]),
        )
        row(
            case,
            f"fused ({fusions}) load from its runtime layout vs stock load",
            stock["load_s"],
            runtime["load_s"],
            seconds,
            1.0,
            mins=(stock["load_s_min"], runtime["load_s_min"]),
        )
        row(
            case,
            f"fused ({fusions}) from its runtime layout: load + first forward",
            stock["load_forward_s"],
            runtime["load_forward_s"],
            seconds,
            mins=(stock["load_forward_s_min"], runtime["load_forward_s_min"]),
        )
        runtime_peak = runtime["peak_rss_growth"]
        row(
            case,
            f"fused ({fusions}) from its runtime layout: peak RSS growth / model bytes",
            None,
            None,
            lambda v: "",
            1.1,
            None if runtime_peak is None else runtime_peak / runtime["model_bytes"],
        )
        assert stock["dtype"] == mine["dtype"] == fused["dtype"] == runtime["dtype"], (stock["dtype"], runtime["dtype"])
        assert mine["fused_experts"] == stock["fused_experts"]

    header = ("case", "metric", "stock", "modelpatch", "ratio", "min ratio", "target")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print()
    print(
        f"{args.repeats} fresh process(es) per measurement: medians (targets checked on their ratio) and the ratio "
        "of the fastest runs ('min ratio'); torch threads: default; "
        f"{'QUICK (tiny models)' if args.quick else 'full size'}"
    )
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for r in rows:
        print(line.format(*r))
    print()
    print("all targets met" if all(checks) else "SOME TARGETS MISSED")
    return 0 if all(checks) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
