#!/usr/bin/env bash
# The lint / type gate (run by .ci/run before the tests): ruff's lint rules, ruff's formatting, mypy on
# src/modelpatch, all configured in pyproject.toml. Any finding fails the run (each tool exits non-zero).
# The tools are the venv's (scripts/setup.sh installs the versions pinned in .ci/constraints.txt): mypy must see
# the torch and transformers that modelpatch is checked against.
#
#   VENV  the virtual environment whose tools run   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
status=0
# Every check runs even when an earlier one fails, so one run lists every finding.
"$VENV/bin/ruff" check || status=1
"$VENV/bin/ruff" format --check || status=1
"$VENV/bin/mypy" || status=1
exit "$status"
