"""One point of the memory sweep, in the fresh process `gradaccum.sweep.run_point` starts.

echo "$PARAMS_JSON" | python -m gradaccum.sweep_point --point 256   # prints the row as JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

import torch

from gradaccum import params
from gradaccum.accumulation import schedule
from gradaccum.loop import evaluate, make_optimizer, make_scaler, train_epoch
from gradaccum.memory import MIB, is_out_of_memory, peak_rss_mib
from gradaccum.models import IMAGE_SIZE, ModelInputError, build_model, check_input
from gradaccum.refusal import refuse
from gradaccum.spec import AMP_DTYPES, amp
from gradaccum.sweep import POINT_COLUMNS


def measure_point(
    p: params.Params,
    device: torch.device,
    micro: int,
    checkpointing: bool = False,
    test_samples: int = 1000,
    last: int = 0,
) -> dict[str, Any]:
    """Optimizer steps of the real training loop at one micro-batch size (GroupNorm, accum 1), as training
    runs them: memory.sweep_steps steps and the epoch's short last micro-batch of `last` samples, an
    evaluation of `test_samples` images, the same again. Each shape the allocator serves leaves the heap
    more fragmented and the next peak higher, so a sweep without the short micro-batch and the evaluation
    would predict a peak below the one training reaches."""
    steps = p.memory.sweep_steps
    model = build_model(**p.model.model_dump(), norm="group", seed=p.seed, checkpointing=checkpointing, device=device)
    dtype = AMP_DTYPES[amp(device.type, p.train)]
    opt, scaler = make_optimizer(model, lr=1e-4), make_scaler(device, dtype)
    n = micro * steps + last
    images = torch.randint(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, device=device)
    labels = torch.randint(0, p.model.num_classes, (n,), device=device)
    test_images = torch.randint(0, 256, (test_samples, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, device=device)
    test_labels = torch.randint(0, p.model.num_classes, (test_samples,), device=device)
    row: dict[str, Any] = dict.fromkeys(POINT_COLUMNS)
    row.update(micro_batch=micro, checkpointing=checkpointing, fit=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    order, batches = torch.arange(n, device=device), schedule(n, micro, 1)
    try:
        seconds = 0.0
        for epoch in range(2):  # steps, the evaluation training does between epochs, steps again
            start = time.perf_counter()
            train_epoch(model, opt, scaler, images, labels, order, batches, dtype)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            if epoch == 0:  # its other-shaped buffers (the last chunk too) leave the allocator's heap fragmented,
                evaluate(model, test_images, test_labels, min(p.train.eval_batch, micro), dtype)  # so later peaks rise
        row["seconds"] = round(seconds, 2)  # the first step's warm-up included
        row["images_per_s"] = round(2 * n / row["seconds"], 1)
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        row.update(fit=False, error=str(err).splitlines()[0][:200])
    row["rss_peak_mib"] = round(peak_rss_mib(), 1)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        row.update(
            torch_max_allocated_mib=round(torch.cuda.max_memory_allocated() / MIB, 1),
            torch_max_reserved_mib=round(torch.cuda.max_memory_reserved() / MIB, 1),
            cuda_context_mib=round((total - free - reserved) / MIB, 1),
        )  # what nvidia-smi adds on top
        row["peak_mib"] = round(row["torch_max_reserved_mib"] + row["cuda_context_mib"], 1)
    else:
        row["peak_mib"] = row["rss_peak_mib"]
    return row


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="measure one micro-batch size of the sweep and print its JSON")
    parser.add_argument("--point", type=int, required=True, help="the micro-batch size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    parser.add_argument("--test-samples", type=int, default=1000, help="images evaluated between the two epochs")
    parser.add_argument("--last", type=int, default=0, help="samples in the short last micro-batch of an epoch")
    args = parser.parse_args()
    p = params.Params.model_validate_json(sys.stdin.read())  # validated by the parent already
    try:
        check_input(p.model)  # a model that cannot take the images, refused by name (0.1 s)
    except ModelInputError as err:  # one line for the sweep stage to pass on, not a traceback
        refuse(err)
    with contextlib.suppress(ImportError):  # a train stage holds DVCLive's modules (39 MiB of RSS) at its peak
        import dvclive  # noqa: F401
    row = measure_point(p, torch.device(args.device), args.point, args.checkpointing, args.test_samples, args.last)
    print(json.dumps(row))
