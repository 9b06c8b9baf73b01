"""``modelpatch verify PATH``: stock vs patched on identical inputs."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .arguments import UsageError, add_dtype_argument, add_patch_arguments, add_source_arguments

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HELP = "compare stock and patched outputs on identical deterministic inputs"
DESCRIPTION = (
    "Load PATH twice, stock and with the given patches/fusions (and the patches registered by "
    "--import modules), run identical deterministic inputs (token ids, and an image for vision-language models) "
    "and print the max abs/rel difference of every output and the speed ratio. Exits 1 when an output is out of "
    "tolerance. A checkpoint in the runtime layout of fusions is verified with those fusions, against the stock "
    "model it unfuses to."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    add_patch_arguments(parser)
    add_dtype_argument(parser, "float32", "the tolerances are meant for it: loosen them for half precision")
    parser.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")


@contextmanager
def _without_registered_patches() -> Iterator[None]:
    """Empty the global patch registry for the block (the stock reference load), then restore it as it was."""
    from ..patching import clear_patch_mapping, get_patch_mapping, register_patch_mapping

    registered = get_patch_mapping()
    clear_patch_mapping()
    try:
        yield
    finally:
        register_patch_mapping(registered)


def _check_runtime_layout(args: argparse.Namespace, config: PretrainedConfig, fusions: dict[str, bool] | None) -> None:
    """Refuse, before anything is loaded, ``--fusion`` other than the fusions a runtime-layout checkpoint is in."""
    from ..errors import FusionError
    from ..fusions.apply import resolve_fusion_config
    from ..state import is_runtime_layout

    if fusions is None or not is_runtime_layout(config):
        return
    try:
        resolve_fusion_config(config, fusions)
    except FusionError:
        stored = resolve_fusion_config(config, None)
        names = sorted(name for name, value in stored.items() if value is not False)
        raise UsageError(
            f"{args.path} is in the runtime layout of fusions {names}, which is the only way it loads: verify it "
            f"with --fusion {','.join(names)} (or without --fusion), or convert it to the original layout first "
            "(modelpatch convert SRC DST --fusion none) and verify other fusions there."
        ) from None


def _stock_reference(args: argparse.Namespace, directory: Path, config: PretrainedConfig, model_class: type) -> Any:
    """The stock model of checkpoint ``directory``, loaded without patches nor fusions.

    A checkpoint in the runtime layout of fusions holds their fused tensors, which a stock model cannot load: it is
    loaded as stored, then :func:`~modelpatch.unfuse` puts the stock modules back, filled by the exact reverses of
    the fusions (bit for bit the state a stock load of its original layout gives).
    """
    import sys

    from ..fusions.apply import has_enabled_fusions, resolve_fusion_config
    from ..loading.load import from_pretrained
    from ..restructuring.restructure import unfuse
    from ..state import is_runtime_layout

    load = {"dtype": args.dtype, "allow_pickle": args.allow_pickle}
    with _without_registered_patches():
        stored = resolve_fusion_config(config, None)
        if not (is_runtime_layout(config) and has_enabled_fusions(stored)):
            return from_pretrained(model_class, directory, fusion_config={}, **load)
        if not args.quiet:
            fused = sorted(name for name, value in stored.items() if value is not False)
            print(
                f"modelpatch verify: note: {args.path} is in the runtime layout of fusions {fused}; the stock "
                "reference is that checkpoint loaded and unfused (modelpatch.unfuse: their exact reverses).",
                file=sys.stderr,
            )
        return unfuse(from_pretrained(model_class, directory, **load))


def run(args: argparse.Namespace) -> int:
    import torch

    from ..loading.load import from_pretrained
    from ..verify import check_tolerances, default_inputs, verify
    from .common import model_class_for, open_checkpoint, parse_fusions, parse_patches

    try:
        check_tolerances(args.atol, args.rtol)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    directory, config = open_checkpoint(args, args.path)
    model_class = model_class_for(config, args.model_class)
    patcher, fusions = parse_patches(args.patch), parse_fusions(args.fusion)
    _check_runtime_layout(args, config, fusions)
    reference = _stock_reference(args, directory, config, model_class)
    candidate = from_pretrained(
        model_class,
        directory,
        patcher=patcher,
        fusion_config=fusions,
        dtype=args.dtype,
        allow_pickle=args.allow_pickle,
    )
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
