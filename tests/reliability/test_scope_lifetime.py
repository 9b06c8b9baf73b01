"""A patch scope lives from its entry to its exit, wherever the exit runs.

Adversarial cases: scopes entered inside generators that are advanced on one thread-pool worker and closed from
another thread (or collected), and asyncio tasks created inside a scope that outlive it. A scope that stayed active
after its exit would silently patch the models of unrelated later work: the next task on that worker, say.
"""

from __future__ import annotations

import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import LlamaModel
from transformers.models.llama.modeling_llama import LlamaAttention

import modelpatch
from modelpatch import Patcher
from support.models import sized_config

pytestmark = pytest.mark.reliability


class TaggedAttention(LlamaAttention):
    """Same math as LlamaAttention; only its type tells it apart."""


class OtherTaggedAttention(LlamaAttention):
    """A second distinguishable LlamaAttention."""


def _attention() -> type:
    config = sized_config(
        "llama", vocab=32, hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, max_position_embeddings=16
    )
    return type(LlamaModel(config).layers[0].self_attn)


def _scope_of(kind: str, replacement: type):
    if kind == "apply_patches":
        modelpatch.register_patch_mapping({"LlamaAttention": replacement}, overwrite=True)
        return modelpatch.apply_patches()
    return Patcher({"LlamaAttention": replacement})


def _models_inside(scope):
    """A generator that builds models inside ``scope``, one per ``next``."""
    with scope:
        while True:
            yield _attention()


@pytest.mark.parametrize("kind", ["apply_patches", "Patcher"])
def test_a_generator_closed_by_another_thread_ends_its_scope_on_the_worker_that_entered_it(kind):
    with ThreadPoolExecutor(max_workers=1) as worker:
        generator = worker.submit(lambda: _models_inside(_scope_of(kind, TaggedAttention))).result()
        assert worker.submit(next, generator).result() is TaggedAttention
        # While the generator is suspended inside its scope, the scope is open in the worker's context: the
        # worker's next task is patched (a generator shares the context of whoever runs it).
        assert worker.submit(_attention).result() is TaggedAttention
        generator.close()  # from the main thread: must neither raise nor leave the scope open on the worker
        assert worker.submit(_attention).result() is LlamaAttention
    assert _attention() is LlamaAttention


def test_a_generator_collected_without_being_closed_ends_its_patcher_scope():
    patcher = Patcher({"LlamaAttention": TaggedAttention})
    generator = _models_inside(patcher)
    assert next(generator) is TaggedAttention
    assert _attention() is TaggedAttention  # the consumer shares the suspended generator's context
    del generator
    gc.collect()
    assert _attention() is LlamaAttention
    with patcher:  # the patcher is usable again, and its exit finds nothing left over
        assert _attention() is TaggedAttention
    assert _attention() is LlamaAttention


def test_generators_entering_one_patcher_end_their_own_entries_when_closed_elsewhere():
    patcher = Patcher({"LlamaAttention": TaggedAttention})
    modelpatch.register_patch_mapping({"LlamaAttention": OtherTaggedAttention})
    with ThreadPoolExecutor(max_workers=1) as worker:
        first = worker.submit(lambda: _models_inside(patcher)).result()
        second = worker.submit(lambda: _models_inside(modelpatch.apply_patches())).result()
        third = worker.submit(lambda: _models_inside(patcher)).result()
        assert worker.submit(next, first).result() is TaggedAttention
        assert worker.submit(next, second).result() is OtherTaggedAttention  # the innermost scope wins
        assert worker.submit(next, third).result() is TaggedAttention
        # Closed from this thread, oldest first: each close ends its own generator's entry, not the latest one.
        first.close()
        assert worker.submit(next, third).result() is TaggedAttention
        third.close()
        assert worker.submit(_attention).result() is OtherTaggedAttention  # only apply_patches' scope is left
        second.close()
        assert worker.submit(_attention).result() is LlamaAttention


def test_a_task_created_inside_a_scope_stops_being_patched_when_the_scope_ends():
    async def main():
        started, scope_ended = asyncio.Event(), asyncio.Event()

        async def task():
            before = _attention()
            started.set()
            await scope_ended.wait()
            return before, _attention()

        with Patcher({"LlamaAttention": TaggedAttention}):
            pending = asyncio.create_task(task())  # its context is a copy of this one: the scope is open there
            await started.wait()
        scope_ended.set()
        return await pending

    assert asyncio.run(main()) == (TaggedAttention, LlamaAttention)


def test_exiting_a_patcher_more_often_than_it_was_entered_names_it():
    patcher = Patcher({"LlamaAttention": TaggedAttention})
    with pytest.raises(RuntimeError, match="exited more often than it was entered"):
        patcher.__exit__(None, None, None)
