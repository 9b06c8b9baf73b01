#!/usr/bin/env bash
# Creates a virtual environment and installs modelpatch (editable) with its test dependencies and the lint / type
# gate's tools (scripts/lint.sh).
#
# pyproject.toml declares compatible ranges; the exact versions come from a constraints file (pip -c), so every
# setup resolves to the same, CI-tested set. Each constraints file names the Python it is for (a "# python: 3.X"
# line): .ci/constraints.txt the newest supported set (Python 3.13, the newest torch, which PyPI serves as a CUDA
# build of a few GB, downloaded once and cached by pip; it runs on the CPU), .ci/constraints-lowest.txt the lowest
# (Python 3.11, torch 2.6.0, a CUDA 12.4 build of ~2.5 GB, cached alike).
#
#   VENV         where to create it                      (default .venv)
#   CONSTRAINTS  the pins to install                     (default .ci/constraints.txt: the newest supported set;
#                                                         .ci/constraints-lowest.txt: the lowest)
#   PYTHON       the interpreter that creates the venv   (default: python3.X, X from the constraints file; found on
#                                                         PATH or among pyenv's installed versions)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
CONSTRAINTS="${CONSTRAINTS:-.ci/constraints.txt}"

wanted=$(sed -n 's/^# python: *\([0-9][0-9.]*\) *$/\1/p' "$CONSTRAINTS")
if [ -z "$wanted" ]; then
    echo "setup.sh: $CONSTRAINTS has no '# python: 3.X' line naming its interpreter" >&2
    exit 1
fi

# Whether the interpreter $1 runs and is Python $wanted.
is_wanted() {
    "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$wanted'.split('.'))))" >/dev/null 2>&1
}
# The interpreter: $PYTHON, else python$wanted where it runs (a pyenv shim on PATH may not, when pyenv's global
# version is another), else one of pyenv's installed $wanted.x.
find_python() {
    local candidate
    for candidate in "python$wanted" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$wanted".*/bin/"python$wanted"; do
        if is_wanted "$candidate"; then
            echo "$candidate"
            return
        fi
    done
}
PYTHON="${PYTHON:-$(find_python)}"
if [ -z "$PYTHON" ]; then
    echo "setup.sh: no Python $wanted found (on PATH or in pyenv); install it or set PYTHON" >&2
    exit 1
fi
if [ -x "$VENV/bin/python" ] && ! is_wanted "$VENV/bin/python"; then
    echo "setup.sh: $VENV holds another Python than $wanted ($CONSTRAINTS); remove it or set VENV" >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip -c "$CONSTRAINTS"
# torch's version comes from the constraints like every other package's.
"$VENV/bin/python" -m pip install --quiet -e ".[test,dev]" -c "$CONSTRAINTS"
# llm-compressor, for tests/quantization: installed without its dependencies, at the version the constraints pin.
# Its releases pin transformers<=5.17, torch<=2.14 and compressed-tensors==0.19, which no resolver can combine with
# modelpatch's transformers range; it runs with the releases installed here (what it imports besides them is in the
# test extra). The tests skip themselves where it does not import.
"$VENV/bin/python" -m pip install --quiet --no-deps llmcompressor -c "$CONSTRAINTS"
"$VENV/bin/python" -c "import sys, modelpatch, torch, transformers; print('python', sys.version.split()[0], '| modelpatch', modelpatch.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
