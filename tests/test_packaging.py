"""Packaging: what the installed distribution declares and ships (issue 12, "installable beside other tools").

Read from the installed metadata (``importlib.metadata``), so a venv set up from a stale pyproject.toml fails here
until ``scripts/setup.sh`` reinstalls it.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.resources
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DIST = "modelpatch"


def _requirements() -> list[Requirement]:
    return [Requirement(line) for line in metadata.requires(DIST) or ()]


def _runtime() -> list[Requirement]:
    return [r for r in _requirements() if r.marker is None or "extra" not in str(r.marker)]


def _extra(name: str) -> list[Requirement]:
    return [r for r in _requirements() if r.marker is not None and r.marker.evaluate({"extra": name})]


def _editable() -> bool:
    direct_url = metadata.distribution(DIST).read_text("direct_url.json")
    return bool(direct_url) and json.loads(direct_url).get("dir_info", {}).get("editable", False)


def test_runtime_dependencies_are_ranges():
    runtime = {r.name.lower(): r for r in _runtime()}
    assert {"torch", "transformers", "safetensors", "accelerate", "tqdm"} <= runtime.keys()
    for requirement in runtime.values():
        operators = {spec.operator for spec in requirement.specifier}
        assert not operators & {"==", "==="}, f"{requirement} is pinned: pins belong in .ci/constraints*.txt"
        assert operators & {">=", ">", "~="}, f"{requirement} has no lower bound"


def test_extras_declared():
    assert {r.name for r in _extra("peft")} == {"peft"}
    assert {r.name for r in _extra("torchao")} == {"torchao"}
    assert {"pytest", "hypothesis", "peft", "torchao"} <= {r.name for r in _extra("test")}
    for requirement in _extra("peft") + _extra("torchao") + _extra("test"):
        assert not {spec.operator for spec in requirement.specifier} & {"==", "==="}, requirement


@pytest.mark.parametrize("name", ["transformers", "torch", "safetensors", "accelerate", "tqdm"])
def test_installed_versions_inside_declared_ranges(name):
    (requirement,) = [r for r in _runtime() if r.name.lower() == name]
    installed = Version(metadata.version(name))
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"installed {name} {installed} is outside the declared {requirement}"
    )


def test_installed_metadata_matches_pyproject():
    """The metadata the other tests read is the current pyproject's (else: rerun scripts/setup.sh)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    if metadata.version(DIST) != pyproject["version"]:
        pytest.skip("the installed modelpatch is not this checkout")
    declared = sorted(str(Requirement(r)) for r in pyproject["dependencies"])
    assert sorted(str(r) for r in _runtime()) == declared


def test_py_typed_ships():
    assert importlib.resources.files("modelpatch").joinpath("py.typed").is_file()
    if not _editable():
        files = {str(f).replace("\\", "/") for f in metadata.files(DIST) or ()}
        assert "modelpatch/py.typed" in files
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["modelpatch"]


def test_wheel_contains_py_typed_and_license(tmp_path):
    """Build the wheel from a copy of the sources (no network, no build isolation) and look inside."""
    setuptools = pytest.importorskip("setuptools")
    if Version(setuptools.__version__) < Version("77"):
        pytest.skip("building needs setuptools >= 77 (PEP 639 license field)")
    source = tmp_path / "src_tree"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path / "dist"
    out.mkdir()
    subprocess.run(
        [sys.executable, "-c", f"import setuptools.build_meta as b; b.build_wheel({str(out)!r})"],
        cwd=source,
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = out.glob("modelpatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "modelpatch/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_lint_tools_declared_as_ranges_and_pinned_for_ci():
    """The ``dev`` extra (scripts/lint.sh's ruff and mypy) is ranges; each constraints file pins a version inside."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = {Requirement(line).name: Requirement(line) for line in pyproject["dev"]}
    assert {"ruff", "mypy"} <= dev.keys()
    for name in ("constraints.txt", "constraints-lowest.txt"):
        pins = {
            Requirement(line).name.lower(): Requirement(line)
            for line in (ROOT / ".ci" / name).read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }
        for requirement in dev.values():
            assert not {spec.operator for spec in requirement.specifier} & {"==", "==="}, requirement
            (pin,) = pins[requirement.name].specifier
            assert pin.operator == "==", f"{name}: {pins[requirement.name]} is not a pin"
            assert requirement.specifier.contains(pin.version), f"{name} pins {pin} outside {requirement}"


def test_both_ci_sets_pin_every_extra_inside_its_declared_range():
    """The extras (PEFT, torchao, the test tools) install in both CI sets, each pinned inside the range pyproject.toml
    declares: the lowest set's torch (2.6) holds some extras to older releases (torchao 0.16, compressed-tensors 0.15),
    so their declared floors must admit those."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("constraints.txt", "constraints-lowest.txt"):
        _, pins = _ci_set(name)
        for requirement in (Requirement(line) for group in ("peft", "torchao", "test") for line in extras[group]):
            pin = pins.get(requirement.name.lower())
            assert pin is not None, f"{name} pins no {requirement.name}"
            assert requirement.specifier.contains(pin), f"{name} pins {requirement.name} {pin} outside {requirement}"


def test_ci_runs_the_lowest_and_the_newest_supported_transformers():
    """The declared transformers range is the door's, and CI's two venvs pin its lowest and its newest release: the
    floor's own release series, and the series just below the (exclusive) ceiling."""
    from modelpatch import _transformers as door

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (declared,) = [Requirement(r) for r in pyproject if Requirement(r).name == "transformers"]
    assert declared.specifier == SpecifierSet(door.SUPPORTED)
    floor = Version(next(s.version for s in declared.specifier if s.operator == ">="))
    ceiling = Version(next(s.version for s in declared.specifier if s.operator == "<"))
    pins = {}
    for name in ("constraints-lowest.txt", "constraints.txt"):
        lines = (ROOT / ".ci" / name).read_text().splitlines()
        (pin,) = [Requirement(line) for line in lines if line.startswith("transformers==")]
        pins[name] = Version(next(iter(pin.specifier)).version)
        assert pins[name] in declared.specifier, f"{name} pins transformers {pins[name]} outside {declared}"
    assert pins["constraints-lowest.txt"].release[:2] == floor.release[:2]
    assert pins["constraints.txt"].release[:2] == (ceiling.major, ceiling.minor - 1)


def _ci_set(name: str) -> tuple[Version, dict[str, Version]]:
    """The Python a constraints file is for (its ``# python: 3.X`` line) and its pins."""
    lines = (ROOT / ".ci" / name).read_text().splitlines()
    (python,) = [line.split(":", 1)[1].strip() for line in lines if line.startswith("# python:")]
    pins = {
        Requirement(line).name.lower(): Version(next(iter(Requirement(line).specifier)).version)
        for line in lines
        if line.strip() and not line.startswith("#")
    }
    return Version(python), pins


def test_ci_runs_the_lowest_and_the_newest_python_and_torch():
    """requires-python admits 3.11 to 3.13; CI's lowest set is the oldest of those with the declared torch floor, its
    newest set the newest Python with a newer torch; the README says the same next to ``pip install modelpatch``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pythons = SpecifierSet(project["requires-python"])
    supported = [Version(f"3.{minor}") for minor in range(8, 16) if Version(f"3.{minor}") in pythons]
    assert supported == [Version("3.11"), Version("3.12"), Version("3.13")], supported
    (torch_range,) = [Requirement(r).specifier for r in project["dependencies"] if Requirement(r).name == "torch"]
    torch_floor = Version(next(s.version for s in torch_range if s.operator == ">="))
    lowest_python, lowest = _ci_set("constraints-lowest.txt")
    newest_python, newest = _ci_set("constraints.txt")
    assert (lowest_python, newest_python) == (supported[0], supported[-1])
    assert lowest["torch"] == torch_floor and newest["torch"] > torch_floor
    assert newest["torch"] in torch_range
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("pip install modelpatch") :][:1500]
    assert "Python 3.11, 3.12 and 3.13" in install and f"torch `>={torch_floor}" in install, install


def test_this_venv_is_one_of_ci_sets():
    """A venv set up by scripts/setup.sh from a constraints file runs that file's Python, torch and transformers."""
    installed = {name: Version(metadata.version(name)) for name in ("torch", "transformers")}
    for name in ("constraints.txt", "constraints-lowest.txt"):
        python, pins = _ci_set(name)
        if pins["transformers"] == installed["transformers"]:
            assert Version("{}.{}".format(*sys.version_info[:2])) == python, f"{name} is for Python {python}"
            assert Version(installed["torch"].base_version) == pins["torch"], f"{name} pins torch {pins['torch']}"
            return
    pytest.skip("this venv was not set up from .ci's constraints")
