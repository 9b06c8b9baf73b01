"""Concurrency: loads in many threads at once, each with its own patches and fusions, while the registry changes.

Every result must have exactly its own structure (module classes) and the outputs of stock transformers'
``from_pretrained`` of the same checkpoint; registry changes made during the loads must reach each load either
entirely or not at all (a load reads one snapshot).
"""

from __future__ import annotations

import logging
import shutil
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import LlamaConfig, LlamaModel, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

import modelpatch
from modelpatch import Patcher
from support.compare import assert_bitwise_equal, bitwise_equal
from support.files import siblings

pytestmark = pytest.mark.reliability

ATOL = 1e-5
ROUNDS = 3
LOOP_LOADS = 60


class AttentionA(LlamaAttention):
    """Patcher A's attention: a subclass with the stock forward (outputs must not change)."""


class AttentionB(LlamaAttention):
    """Another Patcher's attention: must never show up in a model built under Patcher A, and vice versa."""


class ChurnMLP(LlamaMLP):
    """Registered and unregistered in a loop by another thread while models are built."""


class ChurnNorm(LlamaRMSNorm):
    """Registered together with ChurnMLP, in the same call: a build sees both or neither."""


def run_threads(workers: list[Callable[[], object]], background: Callable[[threading.Event], None] | None = None):
    """Start every worker at once (a barrier), with ``background`` running until all are done; re-raise failures."""
    barrier = threading.Barrier(len(workers))
    results: list[object] = [None] * len(workers)
    errors: list[str] = []
    stop = threading.Event()

    def wrap(i: int, work: Callable[[], object]) -> None:
        try:
            barrier.wait()
            results[i] = work()
        except BaseException:
            errors.append(f"worker {i}:\n{traceback.format_exc()}")

    def wrap_background() -> None:
        try:
            background(stop)
        except BaseException:
            errors.append(f"background:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=wrap, args=(i, w), daemon=True) for i, w in enumerate(workers)]
    helper = threading.Thread(target=wrap_background, daemon=True) if background else None
    if helper:
        helper.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    if helper:
        helper.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker thread hangs"
    assert not errors, "\n".join(errors)
    return results


def churn_registry(stop: threading.Event, counter: Counter) -> None:
    while not stop.is_set():
        modelpatch.register_patch_mapping({"LlamaMLP": ChurnMLP, "LlamaRMSNorm": ChurnNorm})
        counter["register"] += 1
        modelpatch.unregister_patch_mapping(["LlamaMLP", "LlamaRMSNorm"])
        counter["unregister"] += 1


def class_counts(model: torch.nn.Module) -> Counter:
    return Counter(type(m).__name__ for m in model.modules())


def without_churn(counts: Counter) -> tuple[Counter, bool]:
    """Fold the churned classes into the stock ones; check a model has all of them or none."""
    counts = Counter(counts)
    churned = {"ChurnMLP": "LlamaMLP", "ChurnNorm": "LlamaRMSNorm"}
    present = {name for name in churned if counts[name]}
    if present:
        assert present == set(churned), f"half a registry snapshot: {dict(counts)}"
        for name, stock_name in churned.items():
            assert counts[stock_name] == 0, f"{stock_name} and {name} in one model: {dict(counts)}"
            counts[stock_name] += counts.pop(name)
    return counts, bool(present)


LOADS = {
    # name: (checkpoint, from_pretrained kwargs, class names that must appear, class names that must not)
    "llama_patcher_a": (
        "llama",
        lambda: {"patcher": Patcher({"LlamaAttention": AttentionA})},
        {"AttentionA"},
        {"LlamaAttention", "AttentionB"},
    ),
    "llama_patcher_b": (
        "llama",
        lambda: {"patcher": Patcher({"LlamaAttention": AttentionB})},
        {"AttentionB"},
        {"LlamaAttention", "AttentionA"},
    ),
    "llama_qkv": (
        "llama",
        lambda: {"fusion_config": {"qkv": True}},
        {"QKVFusedLlamaAttention"},
        {"LlamaAttention", "AttentionA", "AttentionB"},
    ),
    "qwen2_moe_linear_experts": (
        "qwen2_moe",
        lambda: {"fusion_config": {"linear_experts": True}},
        {"LinearQwen2MoeExperts"},
        {"Qwen2MoeExperts"},
    ),
    "llama_plain": ("llama", dict, {"LlamaAttention"}, {"AttentionA", "AttentionB", "QKVFusedLlamaAttention"}),
    "bert_plain": ("bert", dict, {"BertSelfAttention"}, set()),
}


@pytest.fixture(scope="module")
def references(stock):
    """Per load: the class counts of the same load done alone, and stock transformers' logits."""
    modelpatch.clear_patch_mapping()
    out = {}
    logits = {}
    for name, (ckpt, kwargs, _, _) in LOADS.items():
        checkpoint = stock(ckpt)
        model = modelpatch.from_pretrained(checkpoint.model_class, checkpoint.path, **kwargs())
        if ckpt not in logits:
            logits[ckpt] = checkpoint.reference_logits()
        out[name] = (checkpoint, class_counts(model), logits[ckpt])
    return out


def check_load(name: str, model: PreTrainedModel, references) -> bool:
    checkpoint, expected_counts, expected_logits = references[name]
    _, _, must, must_not = LOADS[name]
    counts, saw_churn = without_churn(class_counts(model))
    assert counts == expected_counts, f"{name}: {dict(counts)} != {dict(expected_counts)}"
    assert must <= set(counts) and not (must_not & set(counts)), f"{name}: {dict(counts)}"
    assert modelpatch.get_load_report(model) is not None
    fusion_config = getattr(model.config, "modelpatch", {}).get("fusion_config")
    assert fusion_config == LOADS[name][1]().get("fusion_config"), f"{name}: fusion_config {fusion_config}"
    assert all(p.device.type == "cpu" for p in model.parameters()), f"{name}: parameters left on meta"
    with torch.no_grad():
        logits = model(**checkpoint.inputs()).logits
    torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    return saw_churn


def test_concurrent_loads_each_get_their_own_structure_and_outputs(references):
    """Six loads at once per round (two Patchers, two fusions, plain Llama, plain BERT), registry churning meanwhile."""
    churn = Counter()
    seen = Counter()
    dtype, tie_weights = torch.get_default_dtype(), PreTrainedModel.tie_weights
    for _ in range(ROUNDS):

        def load(name):
            checkpoint, kwargs = references[name][0], LOADS[name][1]()
            return lambda: modelpatch.from_pretrained(checkpoint.model_class, checkpoint.path, **kwargs)

        names = list(LOADS)
        models = run_threads([load(n) for n in names], lambda stop: churn_registry(stop, churn))
        for name, model in zip(names, models, strict=True):
            seen[(name, check_load(name, model, references))] += 1
        # The models are independent: writing into one (a private copy-on-write mapping) leaves the others alone.
        plain, patched = models[names.index("llama_plain")], models[names.index("llama_patcher_a")]
        before = patched.model.norm.weight.clone()
        with torch.no_grad():
            plain.model.norm.weight.add_(1.0)
        assert torch.equal(patched.model.norm.weight, before)
    assert churn["register"] > 0
    assert modelpatch.get_patch_mapping() == {}  # the churn thread's last call unregistered
    assert torch.get_default_dtype() == dtype
    assert PreTrainedModel.tie_weights is tie_weights


def test_concurrent_loads_of_different_dtypes_keep_their_own(stock):
    """An fp32 and a bf16 checkpoint loaded at once, repeatedly: every parameter keeps its checkpoint's dtype."""
    fp32, bf16 = stock("llama"), stock("llama_bf16")

    def dtypes(model):
        return {name: p.dtype for name, p in model.named_parameters()}

    expected = {c.name: dtypes(modelpatch.from_pretrained(c.model_class, c.path)) for c in (fp32, bf16)}
    default = torch.get_default_dtype()

    def work(checkpoint):
        def run():
            for _ in range(8):
                model = modelpatch.from_pretrained(checkpoint.model_class, checkpoint.path)
                assert dtypes(model) == expected[checkpoint.name], f"{checkpoint.name}: wrong dtypes"

        return run

    run_threads([work(fp32), work(bf16), work(fp32), work(bf16)])
    assert torch.get_default_dtype() == default


def test_registry_churn_while_scopes_build_models_in_other_threads():
    """apply_patches / Patcher scopes in several threads, registry changing meanwhile: each build is consistent."""
    config = LlamaConfig(
        **{
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    churn = Counter()
    outcomes = Counter()
    lock = threading.Lock()

    def record(kind: str, model) -> None:
        counts, saw_churn = without_churn(class_counts(model))
        with lock:
            outcomes[(kind, saw_churn)] += 1
        return counts

    def with_registry():
        for _ in range(12):
            with modelpatch.apply_patches():
                model = LlamaModel(config)
            counts = record("apply_patches", model)
            assert counts["LlamaAttention"] == 3 and counts["LlamaMLP"] == 3

    def with_patcher(attention: type, other: type):
        def run():
            for _ in range(12):
                with Patcher({"LlamaAttention": attention}):
                    model = LlamaModel(config)
                counts = record(attention.__name__, model)
                assert counts[attention.__name__] == 3 and not counts[other.__name__] and not counts["LlamaAttention"]

        return run

    def unpatched():
        for _ in range(12):
            model = LlamaModel(config)
            counts = class_counts(model)
            assert not {"ChurnMLP", "ChurnNorm", "AttentionA", "AttentionB"} & set(counts), dict(counts)
            assert all(type(m) is LlamaMLP for m in model.modules() if isinstance(m, LlamaMLP))

    run_threads(
        [
            with_registry,
            with_registry,
            with_patcher(AttentionA, AttentionB),
            with_patcher(AttentionB, AttentionA),
            unpatched,
        ],
        lambda stop: churn_registry(stop, churn),
    )
    assert churn["register"] > 0
    assert modelpatch.get_patch_mapping() == {}
    # Outside every scope, construction is stock again in this thread.
    assert all(
        type(m) in (LlamaMLP, LlamaAttention) or not isinstance(m, (LlamaMLP, LlamaAttention))
        for m in LlamaModel(config).modules()
    )


def test_registry_changes_during_loads_leave_the_registry_consistent(stock):
    """Registrations from many threads racing with loads: every registration lands, every load reads a snapshot."""
    checkpoint = stock("llama")
    classes = [type(f"Mlp{i}", (LlamaMLP,), {}) for i in range(16)]

    def register(i):
        return lambda: modelpatch.register_patch_mapping({f"NotAClass{i}": classes[i]})

    def load():
        model = modelpatch.from_pretrained(checkpoint.model_class, checkpoint.path)
        assert all(type(m) is LlamaMLP for m in model.modules() if isinstance(m, LlamaMLP))
        return model

    run_threads([register(i) for i in range(16)] + [load, load])
    assert modelpatch.get_patch_mapping() == {f"NotAClass{i}": classes[i] for i in range(16)}


# ------------------------------------------------------------------------------------------- saves and readers


def _two_versions(stock, tmp_path):
    """Two models of one architecture, loaded from their own directories (which stay in place)."""
    checkpoint = stock("llama_sharded")
    first = modelpatch.from_pretrained(checkpoint.model_class, checkpoint.path)
    second = modelpatch.from_pretrained(checkpoint.model_class, checkpoint.path)
    with torch.no_grad():
        for param in second.parameters():
            param.add_(1.0)
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in (first, second)]
    return checkpoint, [first, second], states


def _which(state, states) -> int:
    found = [i for i, s in enumerate(states) if bitwise_equal(state, s)]
    assert len(found) == 1, "a loaded model is neither version: files of two saves were mixed"
    return found[0]


ROPE_THETAS = (1e4, 1e6)


def _two_configured_versions(stock, tmp_path):
    """:func:`_two_versions` whose configs differ too (``rope_theta``; same keys and shapes)."""
    checkpoint, models, states = _two_versions(stock, tmp_path)
    for model, theta in zip(models, ROPE_THETAS, strict=True):
        model.config.rope_parameters["rope_theta"] = theta
    return checkpoint, models, states


def _which_version(model, states) -> int:
    """The version ``model`` was loaded from; its config must be that version's too."""
    version = _which(model.state_dict(), states)
    theta = model.config.rope_parameters["rope_theta"]
    assert theta == ROPE_THETAS[version], f"the weights of version {version} with the config.json of rope_theta {theta}"
    return version


def test_concurrent_saves_to_one_directory_all_succeed_one_after_another(stock, tmp_path):
    """Saves racing for one directory are serialised: none fails, the result is one complete version, no leftovers."""
    checkpoint, models, states = _two_versions(stock, tmp_path)
    target = tmp_path / "shared"

    def save(i):
        def run():
            for _ in range(4):
                modelpatch.save_pretrained(models[i % 2], target, max_shard_size="40KB")

        return run

    run_threads([save(i) for i in range(4)])
    assert siblings(target) == []
    loaded = modelpatch.from_pretrained(checkpoint.model_class, target)
    _which(loaded.state_dict(), states)


def test_loads_while_the_directory_is_being_saved_over_never_mix_versions(stock, tmp_path):
    """A service reloading a checkpoint that a trainer keeps saving: every load is exactly one saved version."""
    checkpoint, models, states = _two_versions(stock, tmp_path)
    target = tmp_path / "live"
    modelpatch.save_pretrained(models[0], target, max_shard_size="40KB")
    seen = Counter()

    def writer(stop: threading.Event) -> None:
        i = 0
        while not stop.is_set():
            i ^= 1
            modelpatch.save_pretrained(models[i], target, max_shard_size="40KB")

    def reader():
        for _ in range(40):
            loaded = modelpatch.from_pretrained(checkpoint.model_class, target)
            seen[_which(loaded.state_dict(), states)] += 1

    run_threads([reader], writer)
    assert sum(seen.values()) == 40


def test_a_checkpoint_opened_before_a_save_reads_only_its_own_files(tmp_path):
    """Headers are validated on open and the data read later: both must come from the same files, even if a save
    replaces the directory in between (with a different layout: the old offsets would be garbage in the new files)."""
    from modelpatch.checkpoint import Checkpoint, write_checkpoint

    target = tmp_path / "ckpt"
    old = {f"w{i}": torch.arange(64, dtype=torch.float32) + i for i in range(6)}
    write_checkpoint(target, old, max_shard_size=600)  # three shards
    opened = [Checkpoint.open(target), Checkpoint.open(target)]
    first = opened[0].tensor("w0").clone()  # one file mapped before the swap, the others after
    write_checkpoint(target, {f"w{i}": torch.full((3, 7), -1.0, dtype=torch.float64) for i in range(6)})
    for checkpoint in opened:
        assert_bitwise_equal({key: checkpoint.tensor(key) for key in old}, old)
    assert torch.equal(first, old["w0"])
    assert Checkpoint.open(target).tensor("w5").dtype == torch.float64


class _SaveWhenTold(logging.Handler):
    """Saves over ``target`` each time :meth:`save_now` is called (from a load, at the moment under test), and lets the
    load go on once the save is done or waits for the load to open the version it read."""

    def __init__(self, target, model) -> None:
        super().__init__(logging.DEBUG)
        self.target, self.model = target, model
        self.saves: list[threading.Thread] = []
        self.settled = threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:
        # Not under the handler's lock, which the load holds while the save, which logs too, runs.
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "modelpatch.checkpoint.writer" and "waiting" in record.getMessage():
            self.settled.set()

    def save_now(self) -> None:
        self.settled.clear()
        save = threading.Thread(target=self._save, daemon=True)
        self.saves.append(save)
        save.start()
        assert self.settled.wait(60), "the save neither finished nor waited for the load"

    def _save(self) -> None:
        try:
            modelpatch.save_pretrained(self.model, self.target, max_shard_size="40KB")
        finally:
            self.settled.set()

    @contextmanager
    def listening(self) -> Iterator[None]:
        package = logging.getLogger("modelpatch.checkpoint")
        level = package.level
        package.addHandler(self)
        package.setLevel(logging.DEBUG)
        try:
            yield
        finally:
            package.removeHandler(self)
            package.setLevel(level)
            for save in self.saves:
                save.join(60)


class _SaveOnIndexRead(_SaveWhenTold):
    """Saves each time a load has read its index and is about to open the shards it names."""

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if record.name == "modelpatch.checkpoint.checkpoint" and record.getMessage().endswith("shard(s)"):
            self.save_now()


def test_a_save_between_reading_the_index_and_opening_the_shards_never_fails_the_load(stock, tmp_path):
    """The window of a load racing saves over its directory, forced at every try: a save swaps a new version in
    after the load read the index and before it opens the shards. The load gets the version whose index it read,
    whole, however many saves come (the save removes that version once the load has opened it)."""
    checkpoint, models, states = _two_versions(stock, tmp_path)
    target = tmp_path / "live"
    modelpatch.save_pretrained(models[0], target, max_shard_size="40KB")
    hook = _SaveOnIndexRead(target, models[1])
    with hook.listening():
        loaded = modelpatch.from_pretrained(checkpoint.model_class, target)
    assert len(hook.saves) == 1
    assert _which(loaded.state_dict(), states) == 0
    assert _which(modelpatch.from_pretrained(checkpoint.model_class, target).state_dict(), states) == 1
    assert siblings(target) == []


def test_a_save_right_after_the_config_is_read_gives_the_config_of_the_weights_read(stock, tmp_path, monkeypatch):
    """The config is read by path before the weights: a save swapping a new version in right after the load read
    ``config.json`` must not pair that config with the new version's weights (nor the new config with the old
    weights); the load reads config and weights of one version."""
    from modelpatch.loading import load as load_module

    checkpoint, models, states = _two_configured_versions(stock, tmp_path)
    target = tmp_path / "live"
    modelpatch.save_pretrained(models[0], target, max_shard_size="40KB")
    hook = _SaveWhenTold(target, models[1])
    read_config = load_module._model_config

    def then_save(*args, **kwargs):
        config = read_config(*args, **kwargs)
        if not hook.saves:
            hook.save_now()
        return config

    monkeypatch.setattr(load_module, "_model_config", then_save)
    with hook.listening():
        loaded = modelpatch.from_pretrained(checkpoint.model_class, target)
    assert len(hook.saves) == 1
    assert _which_version(loaded, states) == 1
    monkeypatch.undo()
    assert _which_version(modelpatch.from_pretrained(checkpoint.model_class, target), states) == 1
    assert siblings(target) == []


def test_a_save_between_planning_and_loading_is_refused_when_the_config_changed(stock, tmp_path):
    """``plan_pretrained`` then ``load_planned``: a save in between with the same tensor shapes but another
    ``config.json`` is refused by name, never the plan's config with the new weights."""
    checkpoint, models, _ = _two_configured_versions(stock, tmp_path)
    target = tmp_path / "live"
    modelpatch.save_pretrained(models[0], target, max_shard_size="40KB")
    plan = modelpatch.plan_pretrained(checkpoint.model_class, target)
    modelpatch.save_pretrained(models[1], target, max_shard_size="40KB")
    with pytest.raises(modelpatch.CheckpointError, match=r"changed since it was planned \(config.json differ"):
        modelpatch.load_planned(plan)


def test_loads_while_configs_and_weights_are_saved_over_pair_them_by_version(stock, tmp_path):
    """The loop: a trainer saving two versions differing in weights and config over and over, a service loading
    it meanwhile; every load gets the config of the version whose weights it read."""
    checkpoint, models, states = _two_configured_versions(stock, tmp_path)
    target = tmp_path / "live"
    modelpatch.save_pretrained(models[0], target)
    seen = Counter()

    def writer(stop: threading.Event) -> None:
        i = 0
        while not stop.is_set():
            i ^= 1
            modelpatch.save_pretrained(models[i], target)

    def reader():
        for _ in range(LOOP_LOADS):
            seen[_which_version(modelpatch.from_pretrained(checkpoint.model_class, target), states)] += 1

    run_threads([reader], writer)
    assert sum(seen.values()) == LOOP_LOADS


def test_a_save_into_a_subfolder_never_stalls_loads_of_the_folder(stock, tmp_path):
    """A save locks its target's parent while it writes (saves to one place take turns): a load of that parent (a
    trainer's output_dir while it saves checkpoint-500 into it) opens it meanwhile, its own lock is elsewhere."""
    from modelpatch.checkpoint import Checkpoint
    from modelpatch.checkpoint.writer import _parent_lock

    out = tmp_path / "out"
    shutil.copytree(stock("llama_sharded").path, out)
    opened = threading.Event()

    def load() -> None:
        with Checkpoint.open(out):
            opened.set()

    with _parent_lock(out / "checkpoint-500"):
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        assert opened.wait(60), "the load waited for the save into the subfolder"
    loader.join(60)
