"""Run modelpatch's suite against a transformers release (one outside the supported range, typically) and report
what broke.

Following a new transformers release is routine: run this script with the release, read the report, fix what it
names (the door, ``src/modelpatch/_transformers.py``, and ``_transformers_mapping.py`` first), then widen
the range in pyproject.toml and ``_transformers.SUPPORTED``, repin ``.ci/constraints.txt`` and update the door's
``CHECKED`` (docs/transformers_releases.md).

What it does, in a throwaway virtual environment (removed afterwards unless ``--venv`` names where to keep it):

1. installs the exact pins of ``.ci/constraints.txt`` (the newest supported set, its torch too), except transformers
   and the packages the requested release itself requires (read from its wheel's metadata: its huggingface_hub,
   tokenizers, ...), which pip resolves for that release;
2. installs modelpatch from this checkout **without its transformers pin** (``--no-deps``, its other dependencies
   and the test extra installed explicitly);
3. reports which private names of transformers the door lists (``PRIVATE_API``) the release lacks, and whether its
   conversion registry translates (``builtin_mapping`` of every key);
4. runs the suite (``-x`` not set: every failure is reported) and prints the count of passed / failed / skipped tests,
   the failing tests per file, and per failing test the first line of its error; the door's refusals
   (``TransformersVersionError``: "lacks <name>, which <feature> needs") are counted by name.

It needs only the standard library (run it with any Python 3.11 or newer) and the network (or a package index) for pip.
The venv is made with the Python that ``.ci/constraints.txt`` names (its ``# python: 3.X`` line; ``--python`` to
choose another). The whole suite takes ~5-8 minutes on a 2-core machine.

Usage::

    python3 scripts/check_transformers_release.py 5.25.0
    python3 scripts/check_transformers_release.py 5.25.0 --venv /tmp/t525              # keep the venv to debug
    python3 scripts/check_transformers_release.py 5.25.0 -- tests/conversion -k zoo    # a part of the suite

Exit status: 0 when the suite passed, 1 when tests failed, 2 when the release could not be installed.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ElementTree
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"

# Run inside the new venv: the door's private names the release lacks, and the mappings that do not translate.
PROBE = """
import transformers
from modelpatch import _transformers as door
from modelpatch import _transformers_mapping as transformers_mapping
print("transformers", transformers.__version__, "| supported:", door.SUPPORTED)
missing = [path for path in door.PRIVATE_API if not door.available(path)]
for path in missing:
    print("  lacks", path, "-", door.PRIVATE_API[path][1])
print(f"door: {len(door.PRIVATE_API) - len(missing)} of {len(door.PRIVATE_API)} private names present")
refused = {}
keys = sorted(transformers_mapping.builtin_keys())
for key in keys:
    try:
        transformers_mapping.builtin_mapping(key)
    except Exception as error:
        refused[key] = f"{type(error).__name__}: {error}"
for key, reason in refused.items():
    print("  mapping", repr(key), "-", reason)
print(f"conversion registry: {len(keys) - len(refused)} of {len(keys)} mappings translate")
"""


def name_of(requirement: str) -> str:
    """The normalised project name a requirement line starts with (PEP 503), so that this script needs nothing but
    the standard library."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match[1]).lower()


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(part if "\n" not in part else "<script>" for part in command), flush=True)
    return subprocess.run(command, check=False, **kwargs)


def release_requirements(python: Path, version: str, work: Path) -> set[str]:
    """The names of the packages transformers ``version`` requires (no extras), from its wheel's metadata."""
    download = work / "wheel"
    result = run(
        [str(python), "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(download), f"transformers=={version}"]
    )
    if result.returncode != 0:
        raise SystemExit(f"transformers {version} could not be downloaded (pip exited {result.returncode}).")
    (wheel,) = download.glob("transformers-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    return {name_of(line) for line in metadata.get_all("Requires-Dist") or [] if "extra ==" not in line}


def constraints_without(names: set[str], work: Path) -> Path:
    """``.ci/constraints.txt`` without the pins of ``names`` (and of transformers)."""
    dropped = names | {"transformers"}
    kept = [
        line
        for line in CONSTRAINTS.read_text().splitlines()
        if line.strip() and not line.startswith("#") and name_of(line) not in dropped
    ]
    path = work / "constraints.txt"
    path.write_text("\n".join(kept) + "\n")
    return path


def constraints_version() -> str:
    """The Python ``.ci/constraints.txt`` is for (its ``# python: 3.X`` line)."""
    (version,) = re.findall(r"^# python: *([0-9.]+) *$", CONSTRAINTS.read_text(), flags=re.MULTILINE)
    return version


def constraints_python() -> str | None:
    """An interpreter of :func:`constraints_version`: this one, one on PATH, or one of pyenv's, else None."""
    version = constraints_version()
    if "{}.{}".format(*sys.version_info[:2]) == version:
        return sys.executable
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in [f"python{version}", *map(str, sorted(pyenv.glob(f"versions/{version}.*/bin/python{version}")))]:
        try:
            found = subprocess.run(
                [candidate, "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError:
            continue
        if found.returncode == 0 and found.stdout.strip() == version:
            return candidate
    return None


def install(python: Path, version: str, work: Path) -> bool:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dependencies = [r for r in project["dependencies"] if name_of(r) != "transformers"]
    dependencies += project["optional-dependencies"]["test"]
    constraints = constraints_without(release_requirements(python, version, work), work)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    steps = [
        [*pip, "torch", "-c", str(constraints)],  # first, alone: the pinned build, not one another package asks for
        [*pip, f"transformers=={version}", *dependencies, "-c", str(constraints)],
        [*pip, "--no-deps", "-e", str(ROOT)],  # modelpatch itself, without its transformers pin
    ]
    return all(run(step).returncode == 0 for step in steps)


def summary(report: Path) -> tuple[Counter, list[tuple[str, str]]]:
    """Outcome counts and ``(test id, first line of its error)`` per failing test, from pytest's JUnit XML."""
    counts: Counter = Counter()
    failures = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = next((child for child in case if child.tag in {"failure", "error", "skipped"}), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        counts[{"failure": "failed", "error": "errors", "skipped": "skipped"}[outcome.tag]] += 1
        if outcome.tag != "skipped":
            message = (outcome.get("message") or outcome.text or "").strip().splitlines() or [""]
            failures.append((test, message[0][:300]))
    return counts, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the transformers release to check, e.g. 5.25.0")
    parser.add_argument("--venv", type=Path, help="make the venv here and keep it (default: a temporary one)")
    parser.add_argument(
        "--python", help="the interpreter that creates the venv (default: the Python .ci/constraints.txt names)"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the whole suite)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix=f"modelpatch-transformers-{args.version}-"))
    venv = args.venv or work / "venv"
    try:
        interpreter = args.python or constraints_python()
        if interpreter is None:
            print(f"\nno Python {constraints_version()} found (on PATH or in pyenv): pass --python.")
            return 2
        if run([interpreter, "-m", "venv", str(venv)]).returncode != 0:
            return 2
        python = venv / "bin" / "python"
        if not install(python, args.version, work):
            print(f"\ntransformers {args.version}: installing it beside modelpatch's pins failed (see pip above).")
            return 2
        print("\n== what the door and the conversion registry find", flush=True)
        run([str(python), "-c", PROBE], cwd=work)
        print("\n== the suite", flush=True)
        report = work / "report.xml"
        pytest = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        result = run([*pytest, *(args.pytest_args or [])], cwd=ROOT)
        if not report.exists():
            print(f"\ntransformers {args.version}: pytest produced no report (exit {result.returncode}).")
            return 1
        counts, failures = summary(report)
        print(f"\n== transformers {args.version}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        by_file = Counter(test.split("::")[0] for test, _ in failures)
        for file, count in by_file.most_common():
            print(f"  {count:4d} failing in {file}")
        for test, message in failures:
            print(f"  FAILED {test}: {message}")
        refusals = Counter(m for _, m in failures for m in re.findall(r"lacks [\w.]+, which [^;]+", m))
        for refusal, count in refusals.most_common():
            print(f"  refused by name ({count} tests): transformers {args.version} {refusal}")
        return 0 if result.returncode == 0 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the venv with it, unless --venv put it elsewhere
        if args.venv:
            print(f"\nkept: {venv}")


if __name__ == "__main__":
    sys.exit(main())
