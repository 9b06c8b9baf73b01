"""``modelpatch convert SRC DST``: offline conversion of a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .arguments import UsageError, add_dtype_argument, add_patch_arguments, add_source_arguments

if TYPE_CHECKING:
    from transformers import PretrainedConfig


HELP = "convert SRC with patches/fusions into DST, streamed tensor by tensor (atomic)"
DESCRIPTION = (
    "Convert a checkpoint offline, planned from its headers as a load would be and streamed one "
    "tensor at a time (memory holds one converted group, never the model). By default DST is in the original "
    "layout; --runtime-format "
    "writes the patched/fused layout, which later loads need no conversion for. A SRC in a runtime layout is "
    "loaded with the fusions it was saved with, so `--fusion none` turns it back into the original layout, with no "
    "fusions recorded (`--fusion NAMES` records those, which later modelpatch loads apply). Every "
    "tensor of SRC is kept: when the model class has no place for one, nothing is written and the command fails. "
    "SRC's other files (tokenizer, chat template, processor configs, README, LICENSE, ...) are copied along; its "
    "weight files and subdirectories are not (see docs/cli.md)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, "src")
    parser.add_argument("dst", help="destination directory")
    add_patch_arguments(parser)
    add_dtype_argument(parser, "auto")
    parser.add_argument("--runtime-format", action="store_true", help="write the runtime (fused) layout")
    parser.add_argument("--max-shard-size", default="50GB", help="shard above this size (default 50GB)")
    parser.add_argument("--force", action="store_true", help="overwrite DST if it exists")


def run(args: argparse.Namespace) -> int:
    from ..errors import LoadPlanError
    from ..loading.diagnose import collapse_indices
    from ..saving.convert import plan_conversion
    from ..state import is_runtime_layout, stored_fusion_config
    from .carry import plan_carry
    from .common import model_class_for, open_checkpoint, parse_fusions, parse_patches

    source, config = open_checkpoint(args, args.src)
    destination = Path(args.dst)
    if destination.exists() and not args.force:
        raise UsageError(f"{destination} exists; pass --force to overwrite it.")
    resolved_source, resolved_destination = source.resolve(), destination.resolve()
    if resolved_destination == resolved_source:
        raise UsageError("SRC and DST are the same directory.")
    # DST is replaced as a whole (--force): one that contains SRC would be replaced by a copy holding SRC and every
    # file beside it; one inside SRC would be written into the checkpoint being read.
    if resolved_source.is_relative_to(resolved_destination):
        raise UsageError(f"DST {destination} contains SRC ({resolved_source}): pick a directory outside it.")
    if resolved_destination.is_relative_to(resolved_source):
        raise UsageError(f"DST {destination} lies inside SRC ({resolved_source}): pick a directory outside it.")
    model_class = model_class_for(config, args.model_class)
    fusions = parse_fusions(args.fusion)
    recorded: dict[str, bool] | None = None
    if is_runtime_layout(config):
        # The source's tensors are in its fusions' layout: it can only be loaded with them. Any target layout is
        # reached from there: the original one by the recorded reverses, a runtime one only with the same fusions.
        stored = stored_fusion_config(config) or {}
        if args.runtime_format and fusions is not None and set(fusions) != {k for k, v in stored.items() if v}:
            raise UsageError(
                f"{args.src} is in the runtime layout of fusions {sorted(stored)}; convert it to the original layout "
                "first (--fusion none), then from there to other fusions."
            )
        # The original layout records the fusions --fusion names for later loads (none for `--fusion none`); without
        # --fusion, the source's own.
        recorded = None if args.runtime_format else fusions
        fusions = None
    carry = plan_carry(source)
    try:
        # Planned from headers as a load with unexpected_keys="error": a checkpoint key the model has no place for
        # would be missing from DST.
        with plan_conversion(
            model_class,
            source,
            patcher=parse_patches(args.patch),
            fusion_config=fusions,
            dtype=args.dtype,
            allow_pickle=args.allow_pickle,
        ) as conversion:
            # Keys the class declares ignorable would be left out of DST too (recomputed buffers are not lost).
            ignored = conversion.ignored
            if ignored:
                raise UsageError(
                    f"{type(conversion.plan.model).__name__} ignores {len(ignored)} tensors of {args.src}: "
                    f"{', '.join(collapse_indices(ignored))}.\n{_keep_every_tensor(args, config)}"
                )
            files = conversion.write(
                destination,
                runtime_format=args.runtime_format,
                max_shard_size=args.max_shard_size,
                recorded_fusions=recorded,
            )
    except LoadPlanError as exc:
        if "unexpected in the checkpoint" not in exc.problems:
            raise
        raise UsageError(f"{exc}\n{_keep_every_tensor(args, config)}") from None
    copied = carry.copy_to(destination, {file.name for file in files})
    layout = "runtime" if args.runtime_format else "original"
    print(f"wrote {len(files)} files to {destination} ({layout} layout)")
    if copied:
        print(f"copied from {args.src}: {', '.join(map(str, copied))}")
    if conversion.unapplied and not args.quiet:
        print(
            f"modelpatch convert: note: --fusion {','.join(conversion.unapplied)} fuses nothing in "
            f"{type(conversion.plan.model).__name__}: not recorded in {destination}/config.json",
            file=sys.stderr,
        )
    if carry.skipped and not args.quiet:
        print(f"modelpatch convert: note: not copied from {args.src}: {', '.join(carry.skipped)}", file=sys.stderr)
    return 0


def _keep_every_tensor(args: argparse.Namespace, config: PretrainedConfig) -> str:
    """What to do when the chosen class would drop tensors of the source."""
    from .common import architectures_note, model_classes

    note = "" if args.model_class else architectures_note(config)
    candidates = ", ".join(model_classes(config.model_type))
    return (
        f"convert keeps every tensor of SRC, and this model class{f' (AutoModel, because {note})' if note else ''} "
        "has no place for them, so nothing was written. Pick the class with --model-class"
        f"{f' (for {config.model_type!r}: {candidates})' if candidates else ''}."
    )
