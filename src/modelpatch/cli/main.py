"""``modelpatch`` entry point: sub-command dispatch and exit codes.

Exit codes: 0 success; 1 verification failed; 2 bad input (usage, missing path, no config.json, a malformed or
oversized file, unknown fusion, bad ``--patch``, a checkpoint that does not match its model, a read-only target).
Bad input is reported in words, never as a traceback: every such error is a ``ModelPatchError`` (or a
``UsageError`` of the command line).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import ModelPatchError
from . import convert, demo, inspect, plan, verify
from .common import UsageError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

COMMANDS = (inspect, plan, convert, verify, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modelpatch",
        description="Restructure transformers checkpoints: inspect, plan, convert and verify patches and fusions.",
        epilog="Exit codes: 0 success, 1 verification failed, 2 bad input.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what modelpatch does")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    try:
        return args.run(args)
    except (UsageError, ModelPatchError) as exc:
        print(f"modelpatch {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
