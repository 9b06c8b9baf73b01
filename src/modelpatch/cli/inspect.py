"""``modelpatch inspect PATH``: what a checkpoint holds and what modelpatch could do with it."""

from __future__ import annotations

import argparse
import re
from collections import Counter

import torch

from ..checkpoint import Checkpoint
from ..fusions import available_fusions, get_fusion
from ..fusions.apply import discover
from ..loading.build import build_empty_model, config_build_errors
from ..loading.config import resolve_model_class
from ..state import is_runtime_layout, stored_fusion_config
from .common import add_source_arguments, model_class_for, open_checkpoint

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "inspect",
        help="model type, module classes, applicable fusions and checkpoint key layout",
        description="Describe a checkpoint without reading tensor data.",
    )
    add_source_arguments(parser)
    parser.set_defaults(run=run)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError


def run(args: argparse.Namespace) -> int:
    directory, config = open_checkpoint(args, args.path)
    model_class = resolve_model_class(model_class_for(config, args.model_class), config)
    with config_build_errors(directory / "config.json", model_class):
        model = build_empty_model(model_class, config, torch.float32, [])
    print(f"checkpoint:   {directory}")
    print(f"model type:   {config.model_type}")
    print(f"architecture: {model_class.__name__}")
    print(f"parameters:   {sum(p.numel() for p in model.parameters()):,}")
    stored = stored_fusion_config(config)
    if is_runtime_layout(config):
        print(f"layout:       runtime layout of fusions {sorted(k for k, v in (stored or {}).items() if v)}: loads only "
              "with them; `modelpatch convert SRC DST --fusion none` writes the original layout")
    else:
        print("layout:       original (loads in stock transformers)"
              + (f"; saved with fusions {sorted(k for k, v in stored.items() if v)}" if stored else ""))

    print("\nmodule classes:")
    for name, count in sorted(Counter(type(m).__name__ for m in model.modules()).items()):
        print(f"  {count:>5}  {name}")

    print("\nfusions:")
    for fusion in available_fusions():
        mapping, modules = discover(model, {fusion: get_fusion(fusion)})
        if mapping:
            print(f"  {fusion:<18} {len(modules[fusion])} modules of {', '.join(sorted(mapping))}")
        else:
            print(f"  {fusion:<18} not applicable")

    with Checkpoint.open(directory, allow_pickle=args.allow_pickle) as checkpoint:
        keys = checkpoint.keys()
        dtypes = Counter(str(checkpoint.info(k).dtype).removeprefix("torch.") for k in keys)
        layout = Counter(_INDEX.sub("*", k) for k in keys)
        print(f"\ncheckpoint:   {len(keys)} tensors in {len(checkpoint.files)} file(s), {_size(checkpoint.total_bytes)}")
        print(f"dtypes:       {', '.join(f'{d} ({n})' for d, n in dtypes.most_common())}")
        print("key layout (indices as *):")
        for pattern, count in sorted(layout.items()):
            print(f"  {count:>5}  {pattern}")
    return 0
