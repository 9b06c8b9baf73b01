"""What the doors to private APIs share (src/modelpatch/_doors.py): the table written by feature, and the lookup that
refuses a missing name in the door's own error. Each door's own names are checked by its test (test_*_door.py)."""

from __future__ import annotations

import json
import re

import pytest

from modelpatch._doors import Door, private_api
from modelpatch.errors import TorchVersionError


def test_the_table_states_the_floor_once_and_lists_a_name_under_each_feature_needing_it():
    table = private_api(
        "1.0",
        {"saving": ["json:dumps", "json.decoder:JSONDecoder"], "loading": ["json:loads", "json:dumps"]},
        since={"json:loads": "1.2"},
    )
    assert table == {
        "json:dumps": ("1.0", "saving; loading"),
        "json.decoder:JSONDecoder": ("1.0", "saving"),
        "json:loads": ("1.2", "loading"),
    }


def test_a_release_for_a_name_no_feature_needs_is_refused():
    with pytest.raises(ValueError, match=re.escape("names no feature needs: ['json:gone']")):
        private_api("1.0", {"saving": ["json:dumps"]}, since={"json:gone": "1.1"})


def test_the_door_looks_names_up_when_asked_and_refuses_a_missing_one_by_name():
    names = private_api(
        "1.0", {"saving": ["json:dumps", "json:JSONEncoder.no_such_method"], "parsing": ["json.no_such_module:x"]}
    )
    door = Door(names, TorchVersionError, lambda: "json 9.9", " (checked against 9.8).")
    assert door.require("json:dumps") is json.dumps and door.available("json:dumps")
    with pytest.raises(TorchVersionError, match=re.escape("json 9.9 lacks json.JSONEncoder.no_such_method, which ")):
        door.require("json:JSONEncoder.no_such_method")
    with pytest.raises(TorchVersionError) as refused:
        door.require("json.no_such_module:x")
    assert str(refused.value) == "json 9.9 lacks json.no_such_module, which parsing needs (checked against 9.8)."
    assert not door.available("json:JSONEncoder.no_such_method")
    names["json:later"] = ("1.1", "a test's own name")  # the table is read at each lookup
    assert not door.available("json:later")


def test_a_broken_install_is_reported_as_it_is_not_as_a_missing_name(tmp_path, monkeypatch):
    # A module that exists but fails importing one of its own dependencies is no missing private name.
    (tmp_path / "brokenlib.py").write_text("import no_such_dependency_of_brokenlib\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    door = Door(private_api("1.0", {"f": ["brokenlib:x"]}), TorchVersionError, lambda: "brokenlib 1.0", ".")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_brokenlib"):
        door.require("brokenlib:x")
