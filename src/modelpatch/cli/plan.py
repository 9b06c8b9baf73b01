"""``modelpatch plan PATH``: the full conversion plan, from safetensors headers alone."""

from __future__ import annotations

import argparse

from .arguments import add_patch_arguments, add_source_arguments

HELP = "each runtime parameter <- its checkpoint keys and operations (no tensor data read)"
DESCRIPTION = "Plan a load with the given patches and fusions and print where every parameter comes from."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    add_patch_arguments(parser)


def _keys(keys: list[str]) -> str:
    return ", ".join(keys) if len(keys) <= 4 else f"{keys[0]}, {keys[1]}, ... {keys[-1]} ({len(keys)} keys)"


def run(args: argparse.Namespace) -> int:
    from ..loading.load import plan_pretrained
    from .common import model_class_for, open_checkpoint, parse_fusions, parse_patches

    directory, config = open_checkpoint(args, args.path)
    plan = plan_pretrained(
        model_class_for(config, args.model_class),
        directory,
        patcher=parse_patches(args.patch),
        fusion_config=parse_fusions(args.fusion),
        allow_pickle=args.allow_pickle,
    )
    print(f"{type(plan.model).__name__} <- {plan.directory}")
    if plan.runtime_layout:
        print("(checkpoint saved in the runtime layout: no conversion needed)")
    for runtime_key, checkpoint_key in plan.conversion.direct.items():
        if runtime_key in plan.expected:
            source = checkpoint_key if runtime_key == checkpoint_key else f"{checkpoint_key} (renamed)"
            print(f"{runtime_key} <- {source}")
    for group in plan.conversion.groups:
        operations = " -> ".join(type(op).__name__ + _op_args(op) for op in group.operations) or "copy"
        for target in group.target_keys():
            print(f"{target} <- [{_keys(group.source_keys())}] via {operations}")
    for key in plan.new_parameters:
        print(f"{key} <- (new, initialised like stock)")
    for target, source in plan.tied.items():
        print(f"{target} <- tied to {source}")
    for key in plan.dropped:
        print(f"(dropped) {key}")
    for key in plan.ignored:
        print(f"(ignored by the model class) {key}")
    for key in plan.unexpected:
        print(f"(unexpected, not loaded) {key}")
    return 0


def _op_args(op: object) -> str:
    fields = {k: v for k, v in vars(op).items() if v is not None and v is not False}
    return "(" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"
