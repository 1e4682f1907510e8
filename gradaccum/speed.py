"""Speed, measured fairly: every variant's optimizer steps timed in rounds, the variants interleaved.

The training stages run one after another, so their images/s carry the machine's drift (up to 1.9x on a
shared 2-core machine). Here each round times `steps` optimizer steps of every variant, in an order that
rotates from round to round, so drift hits every variant alike; a ratio is taken within each round and
reported as the median with its range over rounds (gradaccum/report/findings.py). One process, world size 1.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gradaccum.accumulation import schedule
from gradaccum.experiment import cudnn_settings, oom_record, variant_model
from gradaccum.loop import Learner, train_epoch
from gradaccum.memory import is_out_of_memory
from gradaccum.spec import RunSpec


def time_variants(specs: list[RunSpec], data: dict[str, torch.Tensor], rounds: int, steps: int) -> dict[str, Any]:
    """images/s of every variant per round, interleaved; variants not run or out of memory say why; a variant
    whose step differs from an earlier one's only in its lr gets that one's rounds, named in `same_step_as`."""
    device = data["train_x"].device
    batch = specs[0].batch
    n = steps * batch
    images, labels, order = data["train_x"][:n], data["train_y"][:n], torch.arange(n, device=device)
    arms, out = {}, {}
    for spec in specs:
        if spec.same_step_as:  # the same step as an earlier variant but for its lr: timed once, as that one
            continue
        if not spec.runs():  # decided before any model is built, as the train stage decides it
            out[spec.variant] = spec.why_not()
            continue
        model = variant_model(spec, spec.seed, device)  # one process: no DDP, no SyncBatchNorm
        batches = schedule(n, spec.micro_batch, spec.accum, spec.weighting, spec.epoch_end_step)
        arms[spec.variant] = (spec, Learner.of(model, spec, device), batches)
        out[spec.variant] = {"accum": spec.accum, "micro_batch": spec.micro_batch, "images_per_s": []}
    names, compute = list(arms), 0.0
    for r in range(rounds + 1):  # round 0 warms every variant up (allocator, kernels) and is not kept
        for name in names[r % len(names) :] + names[: r % len(names)] if names else []:
            if "did_not_fit" in out[name]:
                continue
            spec, learner, batches = arms[name]
            try:
                with cudnn_settings(spec.cudnn, device):  # as the variant trains (a GPU only)
                    start = time.perf_counter()
                    train_epoch(learner, images, labels, order, batches)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - start
                compute += seconds
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                out[name] = {"did_not_fit": oom_record(err, device).reason}
                continue
            if r:
                out[name]["images_per_s"].append(round(n / seconds, 2))
    for row in out.values():
        if row.get("images_per_s"):
            row["median_images_per_s"] = statistics.median(row["images_per_s"])
    for spec in specs:
        if spec.same_step_as:
            out[spec.variant] = out[spec.same_step_as] | {"same_step_as": spec.same_step_as}
    return {
        "rounds": rounds,
        "steps": steps,
        "batch": batch,
        "device": specs[0].device,
        "variants": {spec.variant: out[spec.variant] for spec in specs},  # params.yaml's order
        "compute_seconds": compute,
    }
