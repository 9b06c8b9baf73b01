"""The identity by which a fusion family recognises a stock forward is the same under every Python the project
supports: computed here by each interpreter the machine has, on the real source of every experts forward of the
installed transformers, it agrees with the in-process digest (``ast.dump`` did not: 0 of 65 matched on 3.12)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from modelpatch.fusions import source_digest
from modelpatch.fusions.linear_experts.spec import KNOWN_FORWARDS, UNKNOWN_FORWARDS
from support.zoo import experts_classes

SUPPORTED_AND_OLDER = [(3, 10), (3, 11), (3, 12), (3, 13)]


def _interpreter(version: tuple[int, int]) -> str | None:
    """A Python of ``version`` on this machine (the running one, pyenv's, or one on PATH), or None."""
    if sys.version_info[:2] == version:
        return sys.executable
    name = f"python{version[0]}.{version[1]}"
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(os.path.join(root, "versions", f"{version[0]}.{version[1]}.*", "bin", name)))
    for candidate in [*candidates, name]:
        try:
            found = subprocess.run(
                [candidate, "-c", "import sys; print(*sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except OSError:
            continue
        if found.returncode == 0 and found.stdout.split() == [str(v) for v in version]:
            return candidate
    return None


@pytest.fixture(scope="module")
def forwards() -> dict[str, list[str]]:
    """Every experts class of the installed transformers -> the sources of its forward and what that wraps."""
    found = {f"{c.__module__}.{c.__qualname__}": source_digest.wrapped_sources(c.forward) for c in experts_classes()}
    assert len(found) > 50, sorted(found)
    return found


@pytest.mark.parametrize("version", SUPPORTED_AND_OLDER, ids=lambda v: f"py{v[0]}.{v[1]}")
def test_every_interpreter_computes_the_same_digests(tmp_path, forwards, version):
    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version[0]}.{version[1]} on this machine")
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps(forwards))
    # The other interpreter has neither torch nor modelpatch: it loads the standard-library module by path.
    script = textwrap.dedent(
        """
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("source_digest", sys.argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sources = json.load(open(sys.argv[2]))
        print(json.dumps({name: module.sources_digest(s) for name, s in sources.items()}))
        """
    )
    result = subprocess.run(
        [python, "-I", "-c", script, source_digest.__file__, str(sources)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout)
    ours = {name: source_digest.sources_digest(s) for name, s in forwards.items()}
    assert theirs == ours


# One class of each table entry (where the installed transformers has it) -> the entry its forward must match.
TABLE_EXAMPLES = {
    "mixtral.modeling_mixtral.MixtralExperts": "b72644b25fa73ab1",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts": "b72644b25fa73ab1",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts": "ea43cfd877ba0c93",
    "step3p7.modeling_step3p7.Step3p7Experts": "de26a0bb41d25d0f",
    "aria.modeling_aria.AriaExperts": "52e3c262c4cc8276",
    "llama4.modeling_llama4.Llama4TextExperts": "8ac1264123e72278",
    "gpt_oss.modeling_gpt_oss.GptOssExperts": "2ff5ba2d53b7b2b3",
    "longcat_flash.modeling_longcat_flash.LongcatFlashExperts": "8813924efe89dd09",
    "inkling2.modeling_inkling2.Inkling2Experts": "052d35834090a2df",
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterExperts": "1d005de17766c9ea",
}
# What transformers 5.15-5.17 wrote instead (no padding slot in the experts forward; Aria's experts were another class,
# with no 3-D weights, which stays unfused).
BEFORE_5_18 = {
    "mixtral.modeling_mixtral.MixtralExperts": "d4395a57ef82f8e6",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts": "d4395a57ef82f8e6",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts": "0be2624a2d484849",
    "aria.modeling_aria.AriaExperts": None,
}


def test_the_known_forwards_are_recognised_on_this_interpreter(forwards):
    """Each table entry is the digest of the stock classes it describes, and the plain experts forward is most of
    them, whatever Python runs this."""
    old = {digest for digest in BEFORE_5_18.values() if digest}
    assert set(TABLE_EXAMPLES.values()) | old == set(KNOWN_FORWARDS) | set(UNKNOWN_FORWARDS)
    digests = {name: source_digest.sources_digest(s) for name, s in forwards.items()}
    before = Version(transformers.__version__) < Version("5.18")
    release = {**TABLE_EXAMPLES, **BEFORE_5_18} if before else TABLE_EXAMPLES
    examples = {f"transformers.models.{name}": digest for name, digest in release.items() if digest}
    present = {name: digests[name] for name in examples if name in digests}
    assert "transformers.models.mixtral.modeling_mixtral.MixtralExperts" in present
    assert present == {name: examples[name] for name in present}
    assert sum(d in KNOWN_FORWARDS for d in digests.values()) >= 50  # 50 classes in 5.15.1, more in later releases


FORWARD = '''
    def forward(self, x, weights):
        """Adds the routed outputs."""
        out = self.act(x @ self.w)  # the projection
        return (out * weights[None]).sum(0)
'''


def test_formatting_comments_and_docstring_do_not_change_the_digest_but_code_does():
    reformatted = """
def forward(self,
            x,
            weights):
    # another comment
    out = self.act( x @ self.w )
    return (out * weights[None]).sum(0)
"""
    changed = FORWARD.replace(".sum(0)", ".sum(1)")
    assert source_digest.sources_digest([FORWARD]) == source_digest.sources_digest([reformatted])
    assert source_digest.sources_digest([FORWARD]) != source_digest.sources_digest([changed])
    assert source_digest.sources_digest([FORWARD]) != source_digest.sources_digest([FORWARD, FORWARD])


def test_the_module_needs_only_the_standard_library():
    """What lets the test above run it on interpreters without torch: it imports nothing else."""
    tree = Path(source_digest.__file__).read_text()
    imported = {line.split()[1].split(".")[0] for line in tree.splitlines() if line.startswith(("import ", "from "))}
    assert imported <= {"__future__", "ast", "hashlib", "inspect", "textwrap", "collections", "typing"}, imported
