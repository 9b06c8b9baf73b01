"""``modelpatch`` entry point: sub-command dispatch and exit codes.

Exit codes: 0 success; 1 verification failed; 2 bad input (usage, missing path, no config.json, a malformed or
oversized file, unknown fusion, bad ``--patch`` or ``--import``, a checkpoint that does not match its model, a
read-only target). Bad input is reported in words, never as a traceback: every such error is a ``ModelPatchError``
(or a ``UsageError`` of the command line).

Parsing imports nothing heavy (``--help`` and ``--version`` answer at once): torch and transformers are imported by
the command that runs.
"""

from __future__ import annotations

import argparse
import importlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr

from .. import __version__
from ..errors import ModelPatchError
from . import convert, demo, inspect, plan, verify
from .arguments import UsageError, add_common_options, check_dtype

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

COMMANDS = (inspect, plan, convert, verify, demo)

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modelpatch",
        description="Restructure transformers checkpoints: inspect, plan, convert and verify patches and fusions.",
        epilog="Exit codes: 0 success, 1 verification failed, 2 bad input.",
    )
    parser.add_argument("--version", action="version", version=f"modelpatch {__version__}")
    add_common_options(parser, per_command=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        # Each command module names its help, description, arguments and run function; the parsers are made here.
        name = command.__name__.rpartition(".")[2]
        command_parser = commands.add_parser(name, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    for command_parser in commands.choices.values():
        add_common_options(command_parser, per_command=True)
    return parser


def import_modules(names: list[str]) -> None:
    """Import the ``--import`` modules, so that what they register at import (fusions, patches) is available.

    The current directory is searched after the installed packages, as a user running ``modelpatch`` next to their
    ``my_fusions.py`` expects (a console script's ``sys.path`` lacks it, unlike ``python -m``).
    """
    if names and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # whatever the module raises: an import error, a rejected registration, ...
            logger.info("importing %s failed", name, exc_info=True)
            message = " ".join(str(exc).split())  # one line, whatever the exception's message
            raise UsageError(f"cannot import --import module {name!r}: {type(exc).__name__}: {message}") from None


# What the commands import when they run, imported first and quietly (see _quiet).
_LIBRARIES = ("torch", "transformers", "modelpatch.cli.common", "modelpatch.loading.load", "modelpatch.verify")


@contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """No warnings and no log records below ERROR for the block: importing torch, transformers and the libraries
    they import (torchao's kernels that do not load on this machine, torch's deprecation notes) would print them
    before every command's own output or one-line error. Only around those imports: the ``--import`` modules and
    what the commands run warn as usual. torch 2.6's C++-extension module prints one line straight to stderr when it
    finds no CUDA runtime (torchao imports it): what the imports print there is dropped too."""
    if not enabled:
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not verbose:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run ``modelpatch`` with ``argv`` (default: ``sys.argv[1:]``) and return its exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help and --version (0), or a usage error argparse has printed (2)
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    with _quiet(not args.verbose):
        for library in _LIBRARIES:
            importlib.import_module(library)
    _configure_logging(args.verbose)
    try:
        check_dtype(args)
        import_modules([*args.imports, *args.command_imports])
        from .common import load_progress

        with load_progress(not args.quiet and sys.stderr.isatty()):
            return args.run(args)
    except (UsageError, ModelPatchError) as exc:
        print(f"modelpatch {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
