"""What tests/test_distributed.py runs under torchrun (2 processes, gloo): one window of the real loop.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_worker.py gradient OUT.json
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_worker.py fail OUT.json

gradient: for each case, an epoch of a full window and a short last one in a shuffled order (the same on
every rank), the averaged gradient DDP hands the optimizer at each window's end, and how many all-reduces
ran; rank 0 writes them to OUT.json. fail: rank 1 raises while rank 0 waits in an all-reduce.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import distributed, loop
from gradaccum.accumulation import micro_batch_size, schedule

CASES = [  # (effective batch, accum); 45 = 2 ranks x 3 x micro 8 is not a multiple
    (48, 1),
    (48, 3),
    (45, 3),
    (45, 4),
]


def tiny_model() -> nn.Module:
    """GroupNorm, float32: small enough for one DDP bucket, so one all-reduce is one hook call."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2), nn.GroupNorm(1, 8), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 13 * 13, 10)
    )


def epoch_samples(n: int) -> int:
    """An epoch of one full window of `n` samples and a short last one."""
    return n + n // 3


def window_data(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An epoch's uint8 images and labels for effective batch `n`, and its shuffled order (seeded: every rank's)."""
    g = torch.Generator().manual_seed(n)
    m = epoch_samples(n)
    images = torch.randint(0, 256, (m, 28, 28), dtype=torch.uint8, generator=g)
    return images, torch.randint(0, 10, (m,), generator=g), torch.randperm(m, generator=g)


def one_epoch(n: int, accum: int, no_sync: bool, rank: int, world: int) -> tuple[list[list[float]], int]:
    """The gradient the optimizer sees at each window's end of the real loop, and the all-reduces it took."""
    model = DDP(tiny_model())
    calls = []

    def counting_allreduce(state, bucket):  # no annotations: DDP checks them, and these would be strings here
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[list[float]] = []
    opt.register_step_pre_hook(
        lambda *_: seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]).tolist())
    )
    images, labels, perm = window_data(n)
    plan = schedule(len(perm), micro_batch_size(n, accum * world), accum, rank=rank, world=world)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loop.train_epoch(loop.Learner(model, opt, scaler, None), images, labels, perm, plan, no_sync=no_sync)
    return seen, len(calls)


def main(mode: str, out: Path) -> None:
    rank, world, _ = distributed.setup("cpu")
    if mode == "fail":
        if rank == 1:
            raise RuntimeError("rank 1 failed on purpose")
        distributed.all_sum(1.0)  # rank 0 waits here for a rank that is gone
        return
    results = [
        {"n": n, "accum": accum, "no_sync": no_sync, "grads": grads, "allreduces": calls}
        for n, accum in CASES
        for no_sync in (True, False)
        for grads, calls in [one_epoch(n, accum, no_sync, rank, world)]
    ]
    if rank == 0:
        out.write_text(json.dumps({"world": world, "results": results}))
    distributed.teardown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
