"""``modelpatch demo``: the end-to-end job on embedded tiny checkpoints (no network, a few seconds).

Builds a grouped-query Llama and a Qwen2-MoE with stock ``save_pretrained``, loads them fused, verifies the fused
models against unfused ones, and saves them back in the original layout, checking the files byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .arguments import UsageError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def demo_models() -> list[tuple[str, type[PreTrainedModel], PretrainedConfig, dict[str, bool]]]:
    """(title, model class, config, fusions) of each demo checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    sizes: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    moe = Qwen2MoeConfig(
        **sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128
    )
    return [
        ("llama (grouped-query)", LlamaForCausalLM, LlamaConfig(**sizes), {"qkv": True, "gate_up": True}),
        ("qwen2_moe", Qwen2MoeForCausalLM, moe, {"qkv": True, "gate_up": True, "linear_experts": True}),
    ]


HELP = "run the embedded end-to-end demo (tiny checkpoints, no network)"
DESCRIPTION = (
    "Build tiny checkpoints with stock save_pretrained, load them with fusions, verify against the "
    "unfused models and save them back bit for bit."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", metavar="DIR", help="write the demo checkpoints under DIR instead of a temp dir")


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.safetensors"))
    return names == sorted(p.name for p in b.glob("*.safetensors")) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from ..loading.load import from_pretrained
    from ..loading.record import get_load_report
    from ..saving.save import save_pretrained
    from ..verify import verify

    with tempfile.TemporaryDirectory(prefix="modelpatch-demo-") as scratch:
        root = Path(args.keep or scratch)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file there or above it, no permission, ...
            raise UsageError(f"--keep {args.keep}: cannot make that directory ({exc.strerror or exc}).") from None
        ok = True
        for index, (title, model_class, config, fusions) in enumerate(demo_models()):
            source, saved = root / f"{config.model_type}-source", root / f"{config.model_type}-saved"
            torch.manual_seed(index)
            model_class(config).save_pretrained(source)
            reference = from_pretrained(model_class, source, fusion_config={})
            fused = from_pretrained(model_class, source, fusion_config=fusions)
            replaced = sorted(
                {type(m).__name__ for m in fused.modules()} - {type(m).__name__ for m in reference.modules()}
            )
            report = verify(reference, fused)
            save_pretrained(fused, saved)
            identical = _same_files(source, saved)
            ok &= report.passed and identical
            print(f"== {title}: fusions {', '.join(fusions)}")
            print(f"replaced modules: {', '.join(replaced)}")
            load_report = get_load_report(fused)
            assert load_report is not None  # every model from_pretrained returns carries its report
            print(load_report.summary())
            print(report)
            print(f"saved back to the original layout, byte-identical to the source: {'yes' if identical else 'NO'}\n")
        print("demo PASSED" if ok else "demo FAILED")
        return 0 if ok else 1
