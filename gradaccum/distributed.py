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
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum.refusal import REFUSAL_FILE, Refused


def launched() -> bool:
    """True in a process that torchrun started (it sets these for each worker)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def relaunch(nproc: int, module: str, args: list[str]) -> int:
    """Run `python -m module args` in `nproc` processes under torchrun; a failing rank fails them all.

    A rank that refuses its input (refusal.refuse) writes its one line to a file; the parent raises Refused
    with it and leaves out what torchrun prints after it (its ChildFailedError traceback), while a crashing
    rank's traceback and torchrun's report of it come through. torchrun's stderr passes through here, as it
    is written, for that. On Ctrl-C, torchrun is given the time to stop its ranks (SIGTERM, then up to 30 s):
    they run in sessions of their own, so the terminal's SIGINT never reaches them, and subprocess.run's
    kill of torchrun 0.25 s after the signal would leave them running.
    """
    # One node: its ranks meet on loopback, not on the host name, which a container without a network
    # (docker run --network none) cannot resolve, and torchrun's rendezvous would wait 300 s for it.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1"]
    cmd += [f"--nproc_per_node={nproc}"]
    with tempfile.TemporaryDirectory() as tmp:
        refused = Path(tmp) / "refused"
        env = {**os.environ, REFUSAL_FILE: str(refused)}
        proc = subprocess.Popen([*cmd, "-m", module, *args], env=env, stderr=subprocess.PIPE)
        passing = threading.Thread(target=_pass_on, args=(proc.stderr, refused), daemon=True)
        passing.start()
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        passing.join()
        if code != 0 and refused.exists():
            raise Refused(refused.read_text().strip().removeprefix("error: "))
    return code


def _pass_on(stream: IO[bytes], refused: Path) -> None:
    """Copy torchrun's stderr to ours as it comes (progress bars included), until a rank has refused."""
    while chunk := os.read(stream.fileno(), 65536):
        if not refused.exists():
            os.write(2, chunk)  # this process's stderr, which torchrun would otherwise have written to


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
