#!/usr/bin/env bash
# Creates a virtual environment with Python 3.11 and installs modelpatch (editable) with its test dependencies and
# the lint / type gate's tools (scripts/lint.sh).
#
# pyproject.toml declares compatible ranges; the exact versions come from a constraints file (pip -c), so every
# setup resolves to the same, CI-tested set. torch is pinned to 2.13.0 there: its CPU wheel is available locally;
# any other version downloads gigabytes.
#
#   VENV         where to create it                      (default .venv)
#   CONSTRAINTS  the pins to install                     (default .ci/constraints.txt: the highest supported
#                                                         transformers; .ci/constraints-lowest.txt: the lowest)
#   PYTHON       the interpreter that creates the venv   (default python3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv}"
CONSTRAINTS="${CONSTRAINTS:-.ci/constraints.txt}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip -c "$CONSTRAINTS"
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" -c "$CONSTRAINTS"
"$VENV/bin/python" -m pip install --quiet -e ".[test,dev]" -c "$CONSTRAINTS"
"$VENV/bin/python" -c "import modelpatch, torch, transformers; print('modelpatch', modelpatch.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
