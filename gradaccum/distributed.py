"""Data parallelism on PyTorch's own engine: torchrun starts one process per device, DDP all-reduces.

The train stage calls `relaunch` when `distributed.nproc_per_node` > 1 and it was not started by
torchrun; under torchrun, `setup` joins the process group (NCCL on GPUs, gloo on the CPU) and
`wrap` puts the model in DistributedDataParallel. With one process every function is a no-op,
so the single-device path is the plain loop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def launched() -> bool:
    """True in a process that torchrun started (it sets these for each worker)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def relaunch(nproc: int, module: str, args: list[str]) -> int:
    """Run `python -m module args` in `nproc` processes under torchrun; a failing rank fails them all.

    On Ctrl-C, torchrun is given the time to stop its ranks (SIGTERM, then up to 30 s): they run in
    sessions of their own, so the terminal's SIGINT never reaches them, and subprocess.run's kill of
    torchrun 0.25 s after the signal would leave them running.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.Popen([*cmd, "-m", module, *args])
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def setup(device_type: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this process's device); joins the process group when torchrun started us."""
    if not launched():
        return 0, 1, torch.device(device_type)
    local = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


def wrap(model: nn.Module, device: torch.device, sync_batchnorm: bool) -> nn.Module:
    """DDP around the model; SyncBatchNorm first if asked (timm's converter keeps the fused activations)."""
    if not dist.is_initialized():
        return model
    if sync_batchnorm:
        from timm.layers import convert_sync_batchnorm

        model = convert_sync_batchnorm(model)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a list of one without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_sum(*values: float) -> list[float]:
    """Sums across ranks (the values themselves without a process group)."""
    if not dist.is_initialized():
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors, gloo CPU ones
    dist.all_reduce(t)
    return t.tolist()


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
