"""modelpatch's drop-in Auto classes (src/modelpatch/auto.py): which names exist, read without importing
transformers."""

from __future__ import annotations

import pytest
import transformers

from modelpatch import auto
from support.process import run_fresh


def _transformers_names() -> list[str]:
    return sorted(name for name in dir(transformers) if name.startswith("AutoModel"))


def test_the_names_read_from_the_source_are_transformers_auto_classes():
    names = auto.auto_class_names()
    assert names == _transformers_names()
    assert "AutoModelForCausalLM" in names and "AutoModel" in names


def test_without_the_source_file_the_package_is_asked(monkeypatch):
    monkeypatch.setattr(auto, "_names_in_source", lambda: None)
    assert auto.auto_class_names() == _transformers_names()


def test_the_import_line_imports_neither_transformers_nor_torch_and_refuses_unknown_names():
    script = (
        "import sys\n"
        "from modelpatch import AutoModelForCausalLM, AutoModelForSequenceClassification\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'\n"
        "try:\n"
        "    from modelpatch import AutoModelForCasualLM\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    assert "cannot import name 'AutoModelForCasualLM'" in run_fresh(script).stdout


def test_a_listed_name_transformers_lacks_is_refused_at_first_use(monkeypatch):
    monkeypatch.setattr(auto, "_names_in_source", lambda: ["AutoModelForTomorrow"])
    monkeypatch.setattr(auto, "_made", {})
    made = auto.auto_class("AutoModelForTomorrow")
    with pytest.raises(TypeError, match="transformers.AutoModelForTomorrow is not one of transformers' Auto"):
        made.from_config(transformers.LlamaConfig())


def test_a_name_the_file_does_not_list_is_asked_of_the_package_before_it_is_refused(monkeypatch):
    monkeypatch.setattr(auto, "_names_in_source", lambda: [])  # a release exporting its Auto classes elsewhere
    monkeypatch.setattr(auto, "_made", {})
    assert auto.auto_class("AutoModelForCausalLM").transformers_class is transformers.AutoModelForCausalLM
    with pytest.raises(AttributeError, match="no Auto model class 'AutoModelForNothing'"):
        auto.auto_class("AutoModelForNothing")
