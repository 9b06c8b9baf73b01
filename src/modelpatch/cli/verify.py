"""``modelpatch verify PATH``: stock vs patched on identical inputs."""

from __future__ import annotations

import argparse

import torch

from ..loading import from_pretrained
from ..verify import default_inputs, verify
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
    model_class = model_class_for(config, args.model_class)
    patcher, fusions = parse_patches(args.patch), parse_fusions(args.fusion)
    load = {"dtype": "float32", "allow_pickle": args.allow_pickle}
    reference = from_pretrained(model_class, directory, fusion_config={}, **load)
    candidate = from_pretrained(model_class, directory, patcher=patcher, fusion_config=fusions, **load)
    inputs = default_inputs(reference)
    try:
        with torch.inference_mode():
            reference(**inputs)
    except Exception as exc:
        raise UsageError(
            f"verify cannot run {type(reference).__name__} on its default inputs ({', '.join(inputs)}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    try:
        report = verify(reference, candidate, inputs, atol=args.atol, rtol=args.rtol)
    except Exception as exc:  # the reference ran on these inputs: the patched model is what fails
        print(f"the patched model fails where the stock one runs: {type(exc).__name__}: {exc}\nFAILED")
        return 1
    print(report)
    return 0 if report.passed else 1
