#!/usr/bin/env bash
# Creates .venv with Python 3.11 and installs modelpatch (editable) with its test dependencies.
# torch is pinned to 2.13.0: its CPU wheel is available locally; any other request downloads gigabytes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -c "import modelpatch, torch, transformers; print('modelpatch', modelpatch.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
