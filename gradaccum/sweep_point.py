"""One point of the memory sweep, in the fresh process `gradaccum.sweep.run_point` starts.

echo "$SPEC_JSON" | python -m gradaccum.sweep_point --steps 2   # the spec at the point's micro-batch; prints the row
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

import torch

from gradaccum.accumulation import schedule
from gradaccum.experiment import variant_model
from gradaccum.loop import Learner, evaluate, train_epoch
from gradaccum.memory import MIB, is_out_of_memory, peak_rss_mib
from gradaccum.models import IMAGE_SIZE, ModelInputError, check_input
from gradaccum.refusal import refuse
from gradaccum.spec import RunSpec
from gradaccum.sweep import POINT_COLUMNS


def measure_point(spec: RunSpec, steps: int, test_samples: int = 1000, last: int = 0) -> dict[str, Any]:
    """`steps` windows of the real training loop at the spec's micro-batch (the sweep's: accum 1), as training runs
    them: the steps and the epoch's short last micro-batch of `last` samples, an evaluation of
    `test_samples` images, the same again. Each shape the allocator serves leaves the heap more fragmented and
    the next peak higher, so a sweep without the short micro-batch and the evaluation would predict a peak
    below the one training reaches."""
    device = torch.device(spec.device)
    model = variant_model(spec, spec.seed, device)
    learner = Learner.of(model, spec, device)
    micro, classes = spec.micro_batch, spec.model.num_classes
    n = micro * spec.accum * steps + last
    images = torch.randint(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, device=device)
    labels = torch.randint(0, classes, (n,), device=device)
    test_images = torch.randint(0, 256, (test_samples, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, device=device)
    test_labels = torch.randint(0, classes, (test_samples,), device=device)
    row: dict[str, Any] = dict.fromkeys(POINT_COLUMNS)
    row.update(micro_batch=micro, checkpointing=spec.checkpointing, fit=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    order, batches = torch.arange(n, device=device), schedule(n, micro, spec.accum)
    try:
        seconds = 0.0
        for epoch in range(2):  # steps, the evaluation training does between epochs, steps again
            start = time.perf_counter()
            train_epoch(learner, images, labels, order, batches)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            if epoch == 0:  # its other-shaped buffers (the last chunk too) leave the allocator's heap fragmented,
                evaluate(model, test_images, test_labels, spec.eval_batch, spec.dtype)  # so later peaks rise
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
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps per pass (memory.sweep_steps)")
    parser.add_argument("--test-samples", type=int, default=1000, help="images evaluated between the two epochs")
    parser.add_argument("--last", type=int, default=0, help="samples in the short last micro-batch of an epoch")
    args = parser.parse_args()
    spec = RunSpec.model_validate_json(sys.stdin.read())  # resolved by the parent, at the point's micro-batch
    try:
        check_input(spec.model)  # a model that cannot take the images, refused by name (0.1 s)
    except ModelInputError as err:  # one line for the sweep stage to pass on, not a traceback
        refuse(err)
    with contextlib.suppress(ImportError):  # a train stage holds DVCLive's modules (39 MiB of RSS) at its peak
        import dvclive  # noqa: F401
    row = measure_point(spec, args.steps, args.test_samples, args.last)
    print(json.dumps(row))
