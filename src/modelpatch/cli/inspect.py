"""``modelpatch inspect PATH``: what a checkpoint holds and what modelpatch could do with it; ``modelpatch inspect
--installs``: what modelpatch changes in torch and transformers for the whole process."""

from __future__ import annotations

import argparse
import re
from collections import Counter

from .arguments import add_source_arguments

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


HELP = "model type, module classes, applicable fusions and checkpoint key layout"
DESCRIPTION = (
    "Describe a local checkpoint without reading tensor data. Everything is checked (config, "
    "model build, file headers) before anything is printed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subject = parser.add_mutually_exclusive_group(required=True)
    add_source_arguments(parser, alternatives=subject)
    subject.add_argument(
        "--installs",
        action="store_true",
        help="instead of a checkpoint: modelpatch's process-wide installs (what each patches in torch or "
        "transformers, when it is made, whether it is made in this process)",
    )


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError


def run(args: argparse.Namespace) -> int:
    for line in _installs() if args.installs else _describe(args):
        print(line)
    return 0


def _installs() -> list[str]:
    """The lines ``inspect --installs`` prints: one block per install, in the order modelpatch lists them."""
    from .._installs import installs

    lines = []
    for install in installs():
        lines += [
            f"{install.name}: {'installed' if install.installed else 'not installed'}",
            f"  patches: {install.patches}",
            f"  by:      {install.by}, at {install.when}",
        ]
    return lines


def _describe(args: argparse.Namespace) -> list[str]:
    """The lines ``inspect`` prints, all computed first, so that a malformed checkpoint prints nothing."""
    import torch

    from ..checkpoint import Checkpoint
    from ..fusions import available_fusions, get_fusion
    from ..fusions.apply import discover
    from ..loading.build import build_empty_model, check_layer_count, config_build_errors
    from ..loading.config import resolve_model_class
    from ..state import is_runtime_layout, stored_fusion_config
    from .common import model_class_for, open_checkpoint

    directory, config = open_checkpoint(args, args.path)
    model_class = resolve_model_class(model_class_for(config, args.model_class), config)
    with Checkpoint.open(directory, allow_pickle=args.allow_pickle) as checkpoint:
        keys = checkpoint.keys()
        dtypes = Counter(str(checkpoint.info(k).dtype).removeprefix("torch.") for k in keys)
        layout = Counter(_INDEX.sub("*", k) for k in keys)
        files, total_bytes = len(checkpoint.files), checkpoint.total_bytes
    # A config with more layers than the checkpoint holds would take long to build, for a model it cannot load.
    check_layer_count(model_class, config, keys, directory / "config.json", torch.float32)
    with config_build_errors(directory / "config.json", model_class):
        model = build_empty_model(model_class, config, torch.float32, [])

    lines = [
        f"checkpoint:   {directory}",
        f"model type:   {config.model_type}",
        f"architecture: {model_class.__name__}",
        f"parameters:   {sum(p.numel() for p in model.parameters()):,}",
    ]
    stored = stored_fusion_config(config)
    if is_runtime_layout(config):
        lines.append(
            f"layout:       runtime layout of fusions {sorted(k for k, v in (stored or {}).items() if v)}: loads only "
            "with them; `modelpatch convert SRC DST --fusion none` writes the original layout"
        )
    else:
        lines.append(
            "layout:       original (loads in stock transformers)"
            + (f"; saved with fusions {sorted(k for k, v in stored.items() if v)}" if stored else "")
        )

    lines += ["", "module classes:"]
    classes = Counter(type(m).__name__ for m in model.modules())
    lines += [f"  {count:>5}  {name}" for name, count in sorted(classes.items())]

    lines += ["", "fusions:"]
    for fusion in available_fusions():
        found = discover(model, {fusion: get_fusion(fusion)})
        if found.mapping:
            lines.append(f"  {fusion:<18} {len(found.modules[fusion])} modules of {', '.join(sorted(found.mapping))}")
        else:
            lines.append(f"  {fusion:<18} not applicable")

    lines += [
        "",
        f"checkpoint:   {len(keys)} tensors in {files} file(s), {_size(total_bytes)}",
        f"dtypes:       {', '.join(f'{d} ({n})' for d, n in dtypes.most_common())}",
        "key layout (indices as *):",
    ]
    lines += [f"  {count:>5}  {pattern}" for pattern, count in sorted(layout.items())]
    return lines
