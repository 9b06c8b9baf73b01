"""Options of every command: ``--import``, ``--dtype``, ``-q`` and progress bars, the ``--fusion`` help."""

from __future__ import annotations

import sys
import textwrap

import pytest
from safetensors import safe_open

import modelpatch
from modelpatch.cli.arguments import BUILTIN_FUSIONS
from modelpatch.fusions import get_fusion
from modelpatch.loading import load as load_module
from modelpatch.loading import materialize

USER_FUSIONS = """
    import modelpatch
    from transformers.models.llama.modeling_llama import LlamaMLP


    class PlainMLP(LlamaMLP):
        pass


    class PlainMLPFusion(modelpatch.ModuleFusionSpec):
        target_modules_patterns = (r"layers\\.\\d+\\.mlp$",)

        def is_fusable(self, module):
            return type(module) is LlamaMLP

        def make_fused_class(self, original_cls):
            return PlainMLP


    modelpatch.register_fusion("plain_mlp", PlainMLPFusion())
"""

USER_PATCHES = """
    import modelpatch
    from cli_patches import DoubledMLP

    modelpatch.register_patch_mapping({"LlamaMLP": DoubledMLP})
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``user_module(name, source)`` writes an importable module; what it registers is unregistered afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    fusions, patches = set(modelpatch.available_fusions()), modelpatch.get_patch_mapping()
    names = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)
    for name in set(modelpatch.available_fusions()) - fusions:
        modelpatch.unregister_fusion(name)
    modelpatch.clear_patch_mapping()
    modelpatch.register_patch_mapping(patches)


def test_the_fusion_help_names_the_built_in_fusions():
    built_in = {n for n in modelpatch.available_fusions() if type(get_fusion(n)).__module__.startswith("modelpatch.")}
    assert sorted(BUILTIN_FUSIONS) == sorted(built_in)


@pytest.mark.parametrize("where", ["global", "command"])
def test_import_makes_user_fusions_available(cli, llama_checkpoint, user_module, where):
    assert cli("plan", llama_checkpoint, "--fusion", "plain_mlp")[0] == 2
    module = user_module("user_fusions", USER_FUSIONS)
    before, after = (["--import", module], []) if where == "global" else ([], ["--import", module])

    code, out, err = cli(*before, "inspect", llama_checkpoint, *after)
    assert code == 0, err
    assert "plain_mlp          2 modules of LlamaMLP" in out
    code, out, err = cli(*before, "plan", llama_checkpoint, "--fusion", "plain_mlp", *after)
    assert code == 0, err


def test_registered_patches_apply_to_the_candidate_and_not_to_the_reference(cli, llama_checkpoint, user_module):
    module = user_module("user_patches", USER_PATCHES)
    code, out, _ = cli("verify", llama_checkpoint, "--import", module)
    assert code == 1 and "FAILED" in out  # the doubled MLP differs from the stock one
    assert "LlamaMLP" in modelpatch.get_patch_mapping()  # emptied only for the reference load


def test_a_module_that_fails_on_import_is_one_line_naming_it(cli, llama_checkpoint, user_module):
    module = user_module("broken_module", 'raise RuntimeError("cannot register\\nmy fusion")')
    code, out, err = cli("--import", module, "inspect", llama_checkpoint)
    assert code == 2 and out == ""
    assert err == (
        "modelpatch inspect: error: cannot import --import module 'broken_module': RuntimeError: cannot register "
        "my fusion\n"
    )


def test_convert_dtype(cli, llama_checkpoint, tmp_path):
    code, _, err = cli("convert", llama_checkpoint, tmp_path / "dst", "--dtype", "bfloat16")
    assert code == 0, err
    with safe_open(tmp_path / "dst" / "model.safetensors", "pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}


@pytest.mark.parametrize("dtype, expected", [(None, "float32"), ("bfloat16", "bfloat16")])
def test_verify_loads_in_the_given_dtype(cli, llama_checkpoint, monkeypatch, dtype, expected):
    loaded = []

    def from_pretrained(*args, **kwargs):
        loaded.append(kwargs["dtype"])
        return original(*args, **kwargs)

    original = load_module.from_pretrained
    monkeypatch.setattr(load_module, "from_pretrained", from_pretrained)
    given = ["--dtype", dtype] if dtype else []
    code, out, err = cli("verify", llama_checkpoint, *given, "--atol", "1", "--rtol", "1")
    assert code == 0, out + err
    assert loaded == [expected, expected]


@pytest.mark.parametrize(
    "tty, flags, shown",
    [(True, [], True), (False, [], False), (True, ["-q"], False), (True, ["--quiet", "convert"], False)],
)
def test_progress_bars_only_on_a_terminal_and_without_quiet(
    cli, llama_checkpoint, tmp_path, monkeypatch, tty, flags, shown
):
    monkeypatch.setattr(materialize, "PROGRESS_BAR_MIN_BYTES", 0)  # the tiny checkpoint counts as a long load
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    # A trailing "convert" puts -q before the command (global); otherwise the flags follow it.
    before, after = ([flags[0]], []) if flags[-1:] == ["convert"] else ([], flags)
    code, _, err = cli(*before, "convert", llama_checkpoint, tmp_path / "dst", *after)
    assert code == 0, err
    assert ("Converting weights" in err) is shown
    assert materialize.PROGRESS_BAR_MIN_BYTES == 0  # restored after the command
