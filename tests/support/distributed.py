"""Launching a worker script on several CPU processes with ``torchrun`` (gloo), as the distributed tests do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
