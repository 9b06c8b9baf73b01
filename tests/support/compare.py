"""Comparisons: bitwise (state dicts, tensors, checkpoint files) and within a tolerance (model outputs)."""

from __future__ import annotations

import filecmp
from collections.abc import Mapping
from pathlib import Path

import torch

ATOL = 1e-5

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as integers of its item size: comparison that is exact for NaNs and -0.0."""
    tensor = tensor.detach().cpu()
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
    else:  # a standard-strided, aligned copy
        flat = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor).reshape(-1)
    if tensor.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_SAME_SIZE_INT[flat.element_size()])


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (works for dtypes without comparison kernels: float8, uint64)."""
    return (
        actual.dtype == expected.dtype
        and tuple(actual.shape) == tuple(expected.shape)
        and torch.equal(bits(actual), bits(expected))
    )


def assert_tensor_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    """Same dtype, shape and bytes; the message names ``name`` and what differs."""
    assert (actual.dtype, tuple(actual.shape)) == (expected.dtype, tuple(expected.shape)), (
        f"{name}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
    )
    assert torch.equal(bits(actual), bits(expected)), f"{name}: values differ"


def assert_bitwise_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Same keys, and under each the same dtype, shape and bytes."""
    assert sorted(actual) == sorted(expected), (
        f"only in actual: {sorted(actual.keys() - expected.keys())[:5]}; "
        f"only in expected: {sorted(expected.keys() - actual.keys())[:5]}"
    )
    for key, tensor in expected.items():
        assert_tensor_bitwise_equal(actual[key], tensor, key)


def bitwise_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> bool:
    """:func:`assert_bitwise_equal` as a predicate (for waiting on, or counting, identical states)."""
    try:
        assert_bitwise_equal(actual, expected)
    except AssertionError:
        return False
    return True


def assert_same_files(saved: Path, source: Path) -> None:
    """Every safetensors file (and shard index) of ``source`` exists in ``saved`` with identical bytes, and ``saved``
    has no other safetensors file."""
    names = sorted(p.name for p in source.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".index.json"))
    assert names, f"no tensor files in {source}"
    assert sorted(p.name for p in saved.iterdir() if p.name in names or p.suffix == ".safetensors") == names
    for name in names:
        assert filecmp.cmp(saved / name, source / name, shallow=False), f"{name} differs from the source checkpoint"


def assert_outputs_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = ATOL):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def assert_outputs_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def module_types(model: torch.nn.Module) -> dict[str, type]:
    """Module name -> its class: two models with equal results have the same structure."""
    return {name: type(module) for name, module in model.named_modules()}


def tied_groups(model: torch.nn.Module) -> set[frozenset[str]]:
    """Parameters sharing one storage, as sets of names (only groups of two or more)."""
    by_ptr: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_ptr.setdefault(param.data_ptr(), set()).add(name)
    return {frozenset(names) for names in by_ptr.values() if len(names) > 1}
