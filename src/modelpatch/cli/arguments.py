"""The command line's options, defined without importing torch or transformers.

``modelpatch --help`` and ``--version`` build every parser, so nothing here (or in the modules that register the
commands) may import more than the standard library; what a command needs is imported inside its ``run``.
"""

from __future__ import annotations

import argparse
from typing import Any

BUILTIN_FUSIONS = ("gate_up", "linear_experts", "patch_embeddings", "qkv")
"""The fusions modelpatch registers itself (``modelpatch.available_fusions()`` before any user registration).

Spelled out for the ``--fusion`` help, which would otherwise import every fusion family (and torch) to list them;
tests/cli checks that it matches the registry.
"""

DTYPES = ("auto", "float32", "bfloat16", "float16")


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


def add_common_options(parser: argparse.ArgumentParser, *, per_command: bool) -> None:
    """``-v``, ``-q`` and ``--import``: accepted before the command and after it.

    argparse copies every attribute of a command's namespace over the global one, defaults included, so the
    per-command flags have no default (they set the attribute only when given) and the per-command imports go to
    ``command_imports``; :func:`modelpatch.cli.main.main` imports both lists.
    """
    unset: dict[str, Any] = {"default": argparse.SUPPRESS} if per_command else {}
    parser.add_argument("-v", "--verbose", action="store_true", help="log what modelpatch does", **unset)
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bars and no notes on stderr (progress bars are also off when stderr is not a terminal)",
        **unset,
    )
    parser.add_argument(
        "--import",
        dest="command_imports" if per_command else "imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, e.g. one that calls modelpatch.register_fusion or register_patch_mapping "
        "(installed, on PYTHONPATH, or in the current directory); repeatable",
    )


def add_source_arguments(
    parser: argparse.ArgumentParser, name: str = "path", alternatives: argparse._MutuallyExclusiveGroup | None = None
) -> None:
    """The checkpoint argument ``name`` (a local directory or a hub repo id) and the options of reading it.

    ``alternatives``: a required group of options the checkpoint is one of (then it may be left out for another).
    """
    source_help = "checkpoint directory, or hub repo id (org/name) resolved through the hub cache"
    if alternatives is None:
        parser.add_argument(name, help=source_help)
    else:
        alternatives.add_argument(name, nargs="?", help=source_help)
    parser.add_argument("--revision", help="hub branch, tag or commit (default: main)")
    parser.add_argument("--subfolder", default="", help="the checkpoint's folder inside the directory or repository")
    parser.add_argument("--cache-dir", help="huggingface_hub cache to use instead of HF_HUB_CACHE")
    parser.add_argument("--local-files-only", action="store_true", help="never download: use the hub cache only")
    parser.add_argument(
        "--model-class",
        metavar="NAME",
        help="transformers class to load into, e.g. LlamaForCausalLM or AutoModelForCausalLM "
        "(default: the config's architectures, else AutoModel)",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pytorch_model.bin checkpoints (read with torch.load(weights_only=True); prefer safetensors)",
    )


def add_patch_arguments(parser: argparse.ArgumentParser) -> None:
    """``--fusion`` and ``--patch``."""
    parser.add_argument(
        "--fusion",
        metavar="NAMES",
        help=f"comma-separated fusions to enable (built in: {', '.join(BUILTIN_FUSIONS)}; more from --import "
        "modules), or 'none'",
    )
    parser.add_argument(
        "--patch",
        action="append",
        metavar="ORIGINAL=package.module:Class",
        help="replace class ORIGINAL (an exact name or a regex) by an importable nn.Module subclass; repeatable",
    )


def add_dtype_argument(parser: argparse.ArgumentParser, default: str, why: str = "") -> None:
    """``--dtype``, passed as ``dtype=`` to ``from_pretrained``; ``why`` explains the default."""
    # Checked by check_dtype, not by argparse's ``choices``, whose refusal prints the whole usage first.
    parser.add_argument(
        "--dtype",
        default=default,
        metavar="{" + ",".join(DTYPES) + "}",
        help="dtype to load the weights in; 'auto' keeps the config's dtype (else the checkpoint's) "
        f"(default: {default}{f'; {why}' if why else ''})",
    )


def check_dtype(args: argparse.Namespace) -> None:
    """Refuse a ``--dtype`` that is not one of :data:`DTYPES`, in one line naming it (commands without the option
    pass)."""
    dtype = getattr(args, "dtype", None)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
