"""``modelpatch verify PATH``: stock vs patched on identical inputs."""

from __future__ import annotations

import argparse

from ..loading import from_pretrained
from ..verify import verify
from .common import add_patch_arguments, model_class_for, open_checkpoint_config, parse_fusions, parse_patches


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "verify",
        help="compare stock and patched outputs on identical deterministic inputs",
        description="Load PATH twice, unpatched and with the given patches/fusions, run identical deterministic "
        "inputs (token ids, and an image for vision-language models) and print the max abs/rel difference of every "
        "output and the speed ratio. Exits 1 when an output is out of tolerance.",
    )
    parser.add_argument("path", help="checkpoint directory")
    add_patch_arguments(parser)
    parser.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    _, config = open_checkpoint_config(args.path)
    model_class = model_class_for(config)
    patcher, fusions = parse_patches(args.patch), parse_fusions(args.fusion)
    reference = from_pretrained(model_class, args.path, fusion_config={}, dtype="float32")
    candidate = from_pretrained(model_class, args.path, patcher=patcher, fusion_config=fusions, dtype="float32")
    report = verify(reference, candidate, atol=args.atol, rtol=args.rtol)
    print(report)
    return 0 if report.passed else 1
