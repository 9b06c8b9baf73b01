"""``modelpatch convert SRC DST``: offline conversion of a checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..loading import from_pretrained, save_pretrained
from ..state import is_runtime_layout, stored_fusion_config
from .common import (
    UsageError,
    add_patch_arguments,
    add_source_arguments,
    model_class_for,
    open_checkpoint,
    parse_fusions,
    parse_patches,
)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert",
        help="load SRC with patches/fusions and write it to DST (atomic)",
        description="Convert a checkpoint offline. By default DST is in the original layout; --runtime-format "
        "writes the patched/fused layout, which later loads need no conversion for. A SRC in a runtime layout is "
        "loaded with the fusions it was saved with, so `--fusion none` turns it back into the original layout.",
    )
    add_source_arguments(parser, "src")
    parser.add_argument("dst", help="destination directory")
    add_patch_arguments(parser)
    parser.add_argument("--runtime-format", action="store_true", help="write the runtime (fused) layout")
    parser.add_argument("--max-shard-size", default="50GB", help="shard above this size (default 50GB)")
    parser.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    source, config = open_checkpoint(args, args.src)
    destination = Path(args.dst)
    if destination.exists() and not args.force:
        raise UsageError(f"{destination} exists; pass --force to overwrite it.")
    if destination.resolve() == source.resolve():
        raise UsageError("SRC and DST are the same directory.")
    fusions = parse_fusions(args.fusion)
    if is_runtime_layout(config):
        # The source's tensors are in its fusions' layout: it can only be loaded with them. Any target layout is
        # reached from there: the original one by the recorded reverses, a runtime one only with the same fusions.
        stored = stored_fusion_config(config) or {}
        if args.runtime_format and fusions is not None and set(fusions) != {k for k, v in stored.items() if v}:
            raise UsageError(
                f"{args.src} is in the runtime layout of fusions {sorted(stored)}; convert it to the original layout "
                "first (--fusion none), then from there to other fusions."
            )
        fusions = None
    model = from_pretrained(
        model_class_for(config),
        source,
        patcher=parse_patches(args.patch),
        fusion_config=fusions,
        allow_pickle=args.allow_pickle,
    )
    files = save_pretrained(
        model, destination, save_original_format=not args.runtime_format, max_shard_size=args.max_shard_size
    )
    layout = "runtime" if args.runtime_format else "original"
    print(f"wrote {len(files)} files to {destination} ({layout} layout)")
    return 0
