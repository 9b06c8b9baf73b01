"""Compiled generation as transformers runs it (static cache, its own ``CompileConfig``), and what dynamo made of it.

transformers compiles the decoding forward only where the hardware is one it trusts, unless the compile config says
``_compile_all_devices``: set here, so that the CPU compiles as a GPU would. A recording backend keeps every graph
dynamo hands over, then compiles it with inductor (``compile=True``) or runs it as traced; a bytecode hook keeps the
code dynamo wrote for every frame it compiled (the first compile of a frame, a recompile, or a frame resumed after a
graph break). What that code runs after the graph call is Python dynamo replays on every call: the model's outputs
being built, and any side effect on objects that outlive the call.
"""

from __future__ import annotations

import dis
import types
from dataclasses import dataclass, field

import torch
from torch._dynamo import convert_frame
from transformers import CompileConfig, PreTrainedModel

# Products of a traced forward: an ``nn.Linear`` is inlined as one call to torch's linear.
_PRODUCTS = (torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm)


@dataclass
class CompiledRun:
    """One ``generate`` with a compiled decoding forward."""

    tokens: torch.Tensor
    graphs: list[torch.fx.GraphModule] = field(default_factory=list)
    codes: list[types.CodeType] = field(default_factory=list)

    def products(self) -> int:
        """Matrix products in the graphs dynamo traced."""
        return sum(
            node.op == "call_function" and node.target in _PRODUCTS
            for graph in self.graphs
            for node in graph.graph.nodes
        )

    def after_graph(self) -> list[str]:
        """Instruction names of what the compiled frame runs after its graph call (one compiled frame expected)."""
        assert len(self.codes) == 1, f"dynamo compiled {len(self.codes)} frames, expected 1"
        instructions = list(dis.get_instructions(self.codes[0]))
        call = next(
            (
                index
                for index, instruction in enumerate(instructions)
                if instruction.opname == "STORE_FAST" and str(instruction.argval).startswith("graph_out")
            ),
            None,
        )
        assert call is not None, "no graph call found in the compiled frame's code"
        return [instruction.opname for instruction in instructions[call + 1 :]]

    def names(self) -> set[str]:
        """Every attribute name and string constant the compiled frames' code reads or writes."""
        return {
            name for code in self.codes for name in (*code.co_names, *(c for c in code.co_consts if isinstance(c, str)))
        }


def generate_compiled(model: PreTrainedModel, ids: torch.Tensor, new_tokens: int, compile: bool = True) -> CompiledRun:
    """Greedy ``generate`` with a static cache and transformers' compiled decoding forward, from a fresh dynamo."""
    run = CompiledRun(tokens=ids)

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        run.graphs.append(graph)
        if not compile:
            return graph.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph, example_inputs)

    config = CompileConfig(backend=backend, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    handle = convert_frame.register_bytecode_hook(lambda code, new_code: run.codes.append(new_code))
    try:
        run.tokens = model.generate(ids, **_greedy_static(ids, new_tokens), compile_config=config)
    finally:
        handle.remove()
        torch._dynamo.reset()
    return run


def generate_eager(model: PreTrainedModel, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The same greedy ``generate`` as :func:`generate_compiled`, with compilation turned off."""
    return model.generate(ids, **_greedy_static(ids, new_tokens), disable_compile=True)


def _greedy_static(ids: torch.Tensor, new_tokens: int) -> dict:
    """``generate``'s arguments for ``new_tokens`` greedy tokens on a static cache."""
    return dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
    )


def check_compiled_generation(model: PreTrainedModel, stock: PreTrainedModel, ids: torch.Tensor) -> CompiledRun:
    """What compiled decoding of a fused ``model`` must show, against ``stock`` (the same checkpoint, unfused).

    One graph and one compiled frame over every decode step (no graph break, no recompile); the tokens of ``model``'s
    eager ``generate``; and after the graph call, the very instructions stock's compiled frame runs there (building
    the outputs): no side effect on modelpatch's modules replayed on each call, none of their attributes in the code.
    Returns the fused run, for the caller's checks of what its graph computes.
    """
    new_tokens = 6
    run = generate_compiled(model, ids, new_tokens)
    reference = generate_compiled(stock, ids, new_tokens, compile=False)
    assert (len(run.graphs), len(run.codes)) == (1, 1), (
        f"{len(run.graphs)} graphs and {len(run.codes)} compiled frames, expected one of each"
    )
    assert torch.equal(run.tokens, generate_eager(model, ids, new_tokens))
    after, stock_after = run.after_graph(), reference.after_graph()
    assert after == stock_after, f"{len(after)} instructions after the graph call, stock's frame {len(stock_after)}"
    assert not {name for name in run.names() if name.startswith("_modelpatch")}
    return run
