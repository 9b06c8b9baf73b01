"""scripts/check_transformers_release.py: what it keeps of CI's pins for another transformers release, and its report
of a real pytest run (the whole script, which installs a release, is run by hand: docs/transformers_releases.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_transformers_release.py"
_spec = importlib.util.spec_from_file_location("check_transformers_release", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_requirement_names_are_normalised():
    assert check.name_of("huggingface_hub==2.4.0") == "huggingface-hub"
    assert check.name_of("Jinja2>=3 ; python_version > '3'") == "jinja2"
    assert check.name_of("tokenizers<0.24.0,>=0.23.1") == "tokenizers"


def test_the_release_and_what_it_requires_are_unpinned(tmp_path):
    constraints = check.constraints_without({"huggingface-hub", "tokenizers"}, tmp_path).read_text().splitlines()
    names = {check.name_of(line) for line in constraints}
    assert not names & {"transformers", "huggingface-hub", "tokenizers"}
    assert {"torch", "safetensors", "accelerate", "peft"} <= names


def test_the_venv_is_made_with_the_python_the_constraints_name():
    python = check.constraints_python()
    assert check.constraints_version() == "3.13"
    if python is None:
        pytest.skip("no Python 3.13 on this machine")
    found = subprocess.run(
        [python, "-c", "import sys; print(*sys.version_info[:2], sep='.')"], capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "3.13"


def test_the_summary_counts_a_real_run_and_names_each_failure(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert 1 == 2, 'transformers 9.0 lacks x.y, which loading needs; supported: ...'\n"
        "def test_skips():\n    pytest.skip('not here')\n"
    )
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "test_sample.py"],
        cwd=tmp_path,
        capture_output=True,
        check=False,
    )
    counts, failures = check.summary(report)
    assert dict(counts) == {"passed": 1, "failed": 1, "skipped": 1}
    ((test, message),) = failures
    assert test == "test_sample.py::test_fails" and "lacks x.y, which loading needs" in message
