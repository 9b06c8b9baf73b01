"""What an older torch lacks is refused by name (issue 40): whole tensors cut into this rank's shard of a DTensor need
``distribute_tensor(src_data_rank=None)`` (torch 2.7), which does it without a collective."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from support.distributed import free_port
from support.process import run_fresh

SCRIPT = """
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from modelpatch.errors import TorchVersionError
from modelpatch.modes.distributed import shard_like

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
like = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
try:
    shard_like(torch.ones(4, 2), like)
except TorchVersionError as error:
    print(error)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.skipif(
    "src_data_rank" in inspect.signature(distribute_tensor).parameters,
    reason="this torch cuts a DTensor's shard without a collective (distribute_tensor(src_data_rank=))",
)
def test_cutting_a_whole_tensor_into_a_dtensor_shard_is_refused_by_name():
    result = run_fresh(SCRIPT, str(free_port()))
    assert "lacks distribute_tensor(src_data_rank=), which loading whole tensors into DTensor" in result.stdout
    assert "needs torch >= 2.7" in result.stdout
