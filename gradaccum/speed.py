"""Speed, measured fairly: every variant's optimizer steps timed in rounds, the variants interleaved.

The training stages run one after another, so their images/s carry the machine's drift (up to 1.9x on a
shared 2-core machine). Here each round times `steps` optimizer steps of every variant, in an order that
rotates from round to round, so drift hits every variant alike; a ratio is taken within each round and
reported as the median with its range over rounds (gradaccum/report/tables.py). One process, world size 1.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gradaccum.accumulation import micro_batch_size, schedule
from gradaccum.experiment import cudnn_settings, emulation_check, variant_accum, variant_model
from gradaccum.loop import amp_dtype, make_optimizer, make_scaler, train_epoch
from gradaccum.memory import is_out_of_memory
from gradaccum.params import Params, step_twin


def prepare(p: Params, variant: str, hw: dict[str, Any], plan: dict[str, Any] | None, device: torch.device):
    """The model, optimizer, scaler, dtype and schedule arguments of one variant, as its training builds them."""
    v = p.variants[variant]
    accum = variant_accum(p, variant, plan, hw["scale"])
    dtype = amp_dtype(device, p.train, v.precision)
    model = variant_model(p, variant, p.seed, device, sync_bn=False)  # one process: no DDP, no SyncBatchNorm
    opt, scaler = make_optimizer(model, v.lr, p.train.weight_decay), make_scaler(device, dtype)
    return model, opt, scaler, dtype, accum


def time_variants(
    p: Params, hw: dict[str, Any], data: dict[str, torch.Tensor], plan: dict[str, Any] | None, rounds: int, steps: int
) -> dict[str, Any]:
    """images/s of every variant per round, interleaved; variants not run or out of memory say why; a variant
    whose step differs from an earlier one's only in its lr gets that one's rounds, named in `same_step_as`."""
    device = data["train_x"].device
    batch = p.scale_settings(hw["scale"]).batch
    n = steps * batch
    images, labels, order = data["train_x"][:n], data["train_y"][:n], torch.arange(n, device=device)
    arms, out = {}, {}
    twins = {name: twin for name in p.variants if (twin := step_twin(p, name))}
    for name, v in p.variants.items():
        if name in twins:  # the same step as an earlier variant but for its lr: timed once, as that one
            continue
        why = emulation_check(p, hw, amp_dtype(device, p.train, v.precision))
        if why:  # decided before any model is built
            out[name] = {"not_run": why}
            continue
        model, opt, scaler, dtype, accum = prepare(p, name, hw, plan, device)
        plan_ = schedule(n, micro_batch_size(batch, accum), accum, v.weighting, v.epoch_end_step)
        arms[name] = (model, opt, scaler, dtype, plan_, accum)
        out[name] = {"accum": accum, "micro_batch": micro_batch_size(batch, accum), "images_per_s": []}
    names, compute = list(arms), 0.0
    for r in range(rounds + 1):  # round 0 warms every variant up (allocator, kernels) and is not kept
        for name in names[r % len(names) :] + names[: r % len(names)] if names else []:
            if "did_not_fit" in out[name]:
                continue
            model, opt, scaler, dtype, plan_, _ = arms[name]
            try:
                with cudnn_settings(p.variants[name].cudnn, device):  # as the variant trains (a GPU only)
                    start = time.perf_counter()
                    train_epoch(model, opt, scaler, images, labels, order, plan_, dtype)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - start
                compute += seconds
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                out[name] = {"did_not_fit": f"out of memory: {str(err).splitlines()[0][:200]}"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if r:
                out[name]["images_per_s"].append(round(n / seconds, 2))
    for row in out.values():
        if row.get("images_per_s"):
            row["median_images_per_s"] = statistics.median(row["images_per_s"])
    for name, twin in twins.items():
        out[name] = out[twin] | {"same_step_as": twin}
    out = {name: out[name] for name in p.variants}  # params.yaml's order
    return {
        "rounds": rounds,
        "steps": steps,
        "batch": batch,
        "device": hw["device"],
        "variants": out,
        "compute_seconds": compute,
    }
