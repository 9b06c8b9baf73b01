"""The global patch registry: validation, all-or-nothing updates, copies, and concurrent registration."""

from __future__ import annotations

import re
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention

import modelpatch
from modelpatch import PatchRegistryError
from modelpatch.patching import registry as registry_module
from support.patching import MarkedLlamaAttention, MarkedLlamaMLP, OtherLlamaAttention


class NotAModule:
    pass


@pytest.mark.parametrize(
    "bad",
    [NotAModule, NotAModule(), "LlamaAttention", None, 3, LlamaAttention.forward],
    ids=["plain-class", "instance-of-plain-class", "string", "none", "int", "function"],
)
def test_replacement_must_be_module_subclass(bad):
    with pytest.raises(TypeError) as info:
        modelpatch.register_patch_mapping({"LlamaAttention": bad})
    message = str(info.value)
    assert "LlamaAttention" in message
    assert "nn.Module" in message
    assert repr(bad) in message
    assert modelpatch.get_patch_mapping() == {}


def test_module_instance_is_not_a_valid_replacement():
    instance = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="LlamaMLP"):
        modelpatch.register_patch_mapping({"LlamaMLP": instance})
    assert modelpatch.get_patch_mapping() == {}


def test_mapping_must_be_a_mapping():
    with pytest.raises(TypeError):
        modelpatch.register_patch_mapping([("LlamaAttention", MarkedLlamaAttention)])
    assert modelpatch.get_patch_mapping() == {}


@pytest.mark.parametrize("key", ["", 5, None])
def test_keys_must_be_non_empty_strings(key):
    with pytest.raises(PatchRegistryError):
        modelpatch.register_patch_mapping({key: MarkedLlamaAttention})
    assert modelpatch.get_patch_mapping() == {}


def test_invalid_regex_names_the_pattern_and_leaves_registry_unchanged():
    modelpatch.register_patch_mapping({"LlamaMLP": MarkedLlamaMLP})
    before = modelpatch.get_patch_mapping()
    with pytest.raises(PatchRegistryError) as info:
        modelpatch.register_patch_mapping(
            {"LlamaAttention": MarkedLlamaAttention, "Llama(Attention": OtherLlamaAttention}
        )
    assert "'Llama(Attention'" in str(info.value)
    assert isinstance(info.value, ValueError)
    # The valid entry of the same call was not registered either.
    assert modelpatch.get_patch_mapping() == before


def test_invalid_replacement_in_a_batch_registers_nothing():
    with pytest.raises(TypeError):
        modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention, "LlamaMLP": object})
    assert modelpatch.get_patch_mapping() == {}


def test_duplicate_key_without_overwrite_is_an_error_and_keeps_the_old_value():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with pytest.raises(PatchRegistryError, match="'LlamaAttention'"):
        modelpatch.register_patch_mapping({"LlamaAttention": OtherLlamaAttention, "LlamaMLP": MarkedLlamaMLP})
    assert modelpatch.get_patch_mapping() == {"LlamaAttention": MarkedLlamaAttention}


def test_duplicate_key_with_overwrite_replaces():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention, ".*MLP": MarkedLlamaMLP})
    modelpatch.register_patch_mapping({"LlamaAttention": OtherLlamaAttention}, overwrite=True)
    assert modelpatch.get_patch_mapping() == {"LlamaAttention": OtherLlamaAttention, ".*MLP": MarkedLlamaMLP}


def test_registration_order_is_kept():
    modelpatch.register_patch_mapping({"b.*": MarkedLlamaMLP})
    modelpatch.register_patch_mapping({"a.*": MarkedLlamaMLP, "LlamaAttention": MarkedLlamaAttention})
    assert list(modelpatch.get_patch_mapping()) == ["b.*", "a.*", "LlamaAttention"]


def test_unregister_known_keys():
    modelpatch.register_patch_mapping(
        {"LlamaAttention": MarkedLlamaAttention, ".*MLP": MarkedLlamaMLP, "X": OtherLlamaAttention}
    )
    modelpatch.unregister_patch_mapping(["LlamaAttention", ".*MLP"])
    assert modelpatch.get_patch_mapping() == {"X": OtherLlamaAttention}
    modelpatch.unregister_patch_mapping("X")  # a single key as a plain string
    assert modelpatch.get_patch_mapping() == {}


def test_unregister_unknown_key_names_it_and_removes_nothing():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with pytest.raises(PatchRegistryError, match="'Nope'"):
        modelpatch.unregister_patch_mapping(["Nope"])
    assert modelpatch.get_patch_mapping() == {"LlamaAttention": MarkedLlamaAttention}


def test_unregister_is_all_or_nothing():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention, ".*MLP": MarkedLlamaMLP})
    with pytest.raises(PatchRegistryError) as info:
        modelpatch.unregister_patch_mapping(["LlamaAttention", "Missing1", ".*MLP", "Missing2"])
    message = str(info.value)
    assert "'Missing1'" in message and "'Missing2'" in message
    assert "'LlamaAttention'" not in message
    assert modelpatch.get_patch_mapping() == {"LlamaAttention": MarkedLlamaAttention, ".*MLP": MarkedLlamaMLP}


def test_unregister_needs_the_key_as_registered():
    modelpatch.register_patch_mapping({".*Attention": MarkedLlamaAttention})
    with pytest.raises(PatchRegistryError):
        modelpatch.unregister_patch_mapping(["LlamaAttention"])  # matched by the pattern, but not a key
    assert modelpatch.get_patch_mapping() == {".*Attention": MarkedLlamaAttention}


def test_get_patch_mapping_returns_a_copy():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    copy = modelpatch.get_patch_mapping()
    copy["LlamaMLP"] = MarkedLlamaMLP
    copy["LlamaAttention"] = OtherLlamaAttention
    del copy["LlamaAttention"]
    assert modelpatch.get_patch_mapping() == {"LlamaAttention": MarkedLlamaAttention}
    assert modelpatch.get_patch_mapping() is not modelpatch.get_patch_mapping()


def test_clear_patch_mapping():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention, ".*MLP": MarkedLlamaMLP})
    modelpatch.clear_patch_mapping()
    assert modelpatch.get_patch_mapping() == {}
    modelpatch.clear_patch_mapping()  # clearing an empty registry is fine
    # Keys are free again after a clear.
    modelpatch.register_patch_mapping({"LlamaAttention": OtherLlamaAttention})
    assert modelpatch.get_patch_mapping() == {"LlamaAttention": OtherLlamaAttention}


def _run_threads(count: int, target) -> list[BaseException | None]:
    barrier = threading.Barrier(count)
    results: list[BaseException | None] = [None] * count

    def run(i: int) -> None:
        barrier.wait()
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - recorded and asserted on below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_64_threads_registering_distinct_keys_all_land():
    classes = [type(f"Replacement{i}", (nn.Module,), {}) for i in range(64)]
    results = _run_threads(64, lambda i: modelpatch.register_patch_mapping({f"Class{i}": classes[i]}))
    assert results == [None] * 64
    assert modelpatch.get_patch_mapping() == {f"Class{i}": classes[i] for i in range(64)}


def test_64_threads_registering_the_same_key_exactly_one_wins():
    classes = [type(f"Replacement{i}", (nn.Module,), {}) for i in range(64)]
    results = _run_threads(64, lambda i: modelpatch.register_patch_mapping({"LlamaAttention": classes[i]}))
    winners = [i for i, result in enumerate(results) if result is None]
    assert len(winners) == 1
    assert all(isinstance(r, PatchRegistryError) for i, r in enumerate(results) if i not in winners)
    assert modelpatch.get_patch_mapping() == {"LlamaAttention": classes[winners[0]]}


def test_64_threads_unregistering_the_same_key_exactly_one_wins():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention, "Keep": MarkedLlamaMLP})
    results = _run_threads(64, lambda i: modelpatch.unregister_patch_mapping(["LlamaAttention"]))
    assert sum(result is None for result in results) == 1
    assert modelpatch.get_patch_mapping() == {"Keep": MarkedLlamaMLP}


# --- a model-based property test of the registry and its resolution ----------------------------------------------

# "Attention" and "Self" name no class: like every key, they are also tried as patterns.
_KEYS = [
    "LlamaAttention",
    "LlamaMLP",
    "Attention",
    "Self",
    ".*Attention",
    "Attention$",
    "^Llama",
    ".*MLP$",
    "Qwen2Moe.*",
    "Bert.*Self.*",
]
_CLASS_NAMES = [
    "LlamaAttention",
    "LlamaMLP",
    "LlamaRMSNorm",
    "Qwen2MoeAttention",
    "Qwen2MoeExperts",
    "BertSelfAttention",
    "BertAttention",
    "BertSelfOutput",
    "MyLlamaAttention",
]
_REPLACEMENTS = [type(f"Prop{i}", (nn.Module,), {}) for i in range(3)]

_operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("register"),
            st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(_REPLACEMENTS), min_size=1, max_size=3),
            st.booleans(),
        ),
        st.tuples(st.just("unregister"), st.lists(st.sampled_from(_KEYS), min_size=1, max_size=2, unique=True)),
        st.tuples(st.just("clear")),
    ),
    max_size=8,
)


def _reference_match(entries: dict, class_name: str):
    """transformers' documented resolution: a key naming the class exactly, else the first key ``re.search`` finds."""
    if class_name in entries:
        return class_name, entries[class_name]
    for key, replacement in entries.items():
        if re.search(key, class_name):
            return key, replacement
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_operations)
def test_registry_behaves_like_an_ordered_dict_and_resolves_exact_then_patterns_in_order(operations):
    modelpatch.clear_patch_mapping()
    reference: dict = {}
    for operation in operations:
        if operation[0] == "register":
            _, mapping, overwrite = operation
            clash = any(key in reference for key in mapping)
            if clash and not overwrite:
                with pytest.raises(PatchRegistryError):
                    modelpatch.register_patch_mapping(mapping, overwrite=overwrite)
            else:
                modelpatch.register_patch_mapping(mapping, overwrite=overwrite)
                reference.update(mapping)
        elif operation[0] == "unregister":
            keys = operation[1]
            if all(key in reference for key in keys):
                modelpatch.unregister_patch_mapping(keys)
                for key in keys:
                    del reference[key]
            else:
                with pytest.raises(PatchRegistryError):
                    modelpatch.unregister_patch_mapping(keys)
        else:
            modelpatch.clear_patch_mapping()
            reference.clear()
        assert list(modelpatch.get_patch_mapping().items()) == list(reference.items())
    snapshot = registry_module.snapshot()
    for name in _CLASS_NAMES:
        assert snapshot.match(name) == _reference_match(reference, name), name
