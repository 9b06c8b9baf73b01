"""``modelpatch verify PATH``: stock vs patched on identical inputs."""

from __future__ import annotations

import argparse

from ..loading import from_pretrained
from ..verify import verify
from .common import (
    add_patch_arguments,
    add_source_arguments,
    model_class_for,
    open_checkpoint,
    parse_fusions,
    parse_patches,
)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "verify",
        help="compare stock and patched outputs on identical deterministic inputs",
        description="Load PATH twice, unpatched and with the given patches/fusions, run identical deterministic "
        "inputs (token ids, and an image for vision-language models) and print the max abs/rel difference of every "
        "output and the speed ratio. Exits 1 when an output is out of tolerance.",
    )
    add_source_arguments(parser)
    add_patch_arguments(parser)
    parser.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    directory, config = open_checkpoint(args, args.path)
    model_class = model_class_for(config)
    patcher, fusions = parse_patches(args.patch), parse_fusions(args.fusion)
    common = {"dtype": "float32", "allow_pickle": args.allow_pickle}
    reference = from_pretrained(model_class, directory, fusion_config={}, **common)
    candidate = from_pretrained(model_class, directory, patcher=patcher, fusion_config=fusions, **common)
    report = verify(reference, candidate, atol=args.atol, rtol=args.rtol)
    print(report)
    return 0 if report.passed else 1
