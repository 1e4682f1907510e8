"""All-reduces and time per window with and without `no_sync`, on 2 gloo processes (run by benchmarks.run).

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.ddp [--repeats 5]

The real model and loop, GroupNorm, float32 on the CPU; the two modes alternate window by window so
that drift on a shared machine hits both alike. Rank 0 prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradaccum import distributed, params
from gradaccum.accumulation import micro_batch_size, schedule
from gradaccum.loop import Learner, make_optimizer, make_scaler, train_epoch
from gradaccum.models import build_model

BATCH, ACCUM = 64, 4  # per window: 4 micro-batches of 8 on each of 2 ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    p = params.load()
    rank, world, device = distributed.setup("cpu")
    model = distributed.wrap(build_model(p.model, "group", p.seed), device, sync_batchnorm=False)
    calls: list[int] = []

    def counting_allreduce(state, bucket):  # no annotations: DDP checks them
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_allreduce)
    learner = Learner(model, make_optimizer(model, lr=1e-4), make_scaler(device, None), None)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (BATCH, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    batches = schedule(BATCH, micro_batch_size(BATCH, ACCUM * world), ACCUM, rank=rank, world=world)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    allreduces: dict[bool, list[int]] = {True: [], False: []}
    train_epoch(learner, images, labels, torch.arange(BATCH), batches)  # warm-up
    for _ in range(args.repeats):
        for no_sync in (True, False):
            before = len(calls)
            start = time.perf_counter()
            train_epoch(learner, images, labels, torch.arange(BATCH), batches, no_sync=no_sync)
            seconds[no_sync].append(time.perf_counter() - start)
            allreduces[no_sync].append(len(calls) - before)  # bucket all-reduces (hook calls) in this window
    buckets = len(set(calls))
    if rank == 0:
        with_, without = statistics.median(seconds[True]), statistics.median(seconds[False])
        result = {
            "world": world,
            "batch": BATCH,
            "accum": ACCUM,
            "micro_batch": micro_batch_size(BATCH, ACCUM * world),
            "buckets": buckets,
            "allreduces_per_window_no_sync": allreduces[True][0] / buckets,
            "allreduces_per_window_every_micro_batch": allreduces[False][0] / buckets,
            "seconds_per_window_no_sync": with_,
            "seconds_per_window_every_micro_batch": without,
            "every_micro_batch_over_no_sync": without / with_,
        }
        print(json.dumps(result), flush=True)
    distributed.teardown()


if __name__ == "__main__":
    main()
