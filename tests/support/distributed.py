"""Launching a worker script on several CPU processes with ``torchrun`` (gloo), as the distributed tests do."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import modelpatch

# FSDP2 records events on the stream of the ranks' device, which torch 2.6's CPU stream cannot do (record_event).
FSDP2_RUNS_ON_CPU = pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason=f"torch {torch.__version__}'s FSDP2 cannot run on the CPU ranks (torch.cpu.Stream has no record_event)",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(worker: Path, job: Path, ranks: int, timeout: float = 300) -> None:
    """Run ``worker job`` on ``ranks`` processes under ``torchrun``, importing this checkout's modelpatch; fails the
    test with the end of the ranks' output if any rank fails."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(Path(modelpatch.__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        # The ranks run on the CPU with gloo whatever accelerators the machine has: transformers' distributed setup
        # binds rank r to cuda:r (with nccl) whenever CUDA is visible, which fails on a machine with one GPU.
        CUDA_VISIBLE_DEVICES="",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(worker),
        str(job),
    ]
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def joined_job() -> tuple[dict[str, Any], int, DeviceMesh]:
    """In a worker :func:`run_ranks` runs: its job (the JSON file named on its command line), once this rank joined the
    gloo process group, with the rank and a 1-D CPU mesh over every rank."""
    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    return job, dist.get_rank(), init_device_mesh("cpu", (dist.get_world_size(),))


def training_losses(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    steps: int,
    after_first_backward: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The losses of ``steps`` optimizer steps of ``model`` on one batch (cross-entropy of its logits against
    ``targets``), with ``after_first_backward`` called once the first step's gradients exist (to read them)."""
    losses = []
    for step in range(steps):
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        if step == 0 and after_first_backward is not None:
            after_first_backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses)
