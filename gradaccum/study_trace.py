"""The trace stage's work: every variant at both scales, the GPU card table, the tutorial's own step.

gradaccum/trace.py is the engine (one step on fake tensors); this is the list of steps the study traces, run in
worker processes, and what reports/trace.json holds.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from gradaccum import allocator, cards, trace
from gradaccum.params import Params, set_values
from gradaccum.records import DEVICES
from gradaccum.spec import step_twin
from gradaccum.tutorial import CLAIMS


def tutorial_settings(p: Params) -> Params:
    """params at the tutorial's own settings, whatever params.yaml says: its batch and its accum (4 x 8192), so its
    claims are held against the step it measured, not against this run's (after `dvc exp run -S accum=8`)."""
    batch, accum = CLAIMS["batch"], CLAIMS["accum"]
    return set_values(p.model_dump(), [f"scales.study.batch={batch}", f"accum={accum}"])


def run_job(p: Params, job: tuple[str, ...]) -> tuple[tuple[str, ...], Any]:
    """One unit of `trace_all`'s work, in a worker process (one thread: two workers share two cores)."""
    torch.set_num_threads(1)
    kind, *args = job
    if kind == "variant":
        variant, scale = args
        return job, trace.trace_variant(p, variant, scale, allocated=scale == "cpu")
    if kind == "fast_norm":
        return job, trace.trace_variant(p, args[0], "study", fast_norm=True)
    if kind == "tutorial":
        return job, trace.trace_variant(tutorial_settings(p), args[0], "study")
    return job, cards.study_cards(p, checkpointing=args[0] == "checkpointing")


def trace_all(p: Params, workers: int = 2, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant at both scales (the CPU scale with the real allocator's peak beside the trace), and the
    sweep's model's fewest micro-batches (plain, with checkpointing) at the study scale on each of
    memory.cards_gb, replayed on the card (the GPU card table); in `workers` processes."""
    twins = {v: twin for v in p.variants if (twin := step_twin(p, v))}  # the same step but the lr: traced once
    jobs = [("variant", v, scale) for scale in DEVICES for v in p.variants if v not in twins]
    jobs += [("cards", kind) for kind in ("plain", "checkpointing")]
    treatment = p.variants[p.roles.treatment]
    if (treatment.norm, treatment.swap) == ("group", "keep_act"):  # timm's fast norm against GroupNorm's float32
        jobs.append(("fast_norm", p.roles.treatment))
    jobs += [("tutorial", v) for v in (p.roles.baseline, p.roles.tutorial_code)]  # its GPU figures, at its settings
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of a process with threads
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        done = dict(pool.map(partial(run_job, p), jobs))
    seconds = time.perf_counter() - start  # the workers' start-up (imports) included
    for v, twin in twins.items():
        for scale in DEVICES:
            done[("variant", v, scale)] = done[("variant", twin, scale)] | {"variant": v, "same_step_as": twin}
    rows = [done[("variant", v, scale)] for scale in DEVICES for v in p.variants]
    for row in rows:
        log(f"trace: {row['variant']} at the {row['scale']} scale: {row.get('peak_mib', 0):.0f} MiB")
    return {
        "rows": rows,
        "study_cards": {kind: done[("cards", kind)] for kind in ("plain", "checkpointing")},  # replayed on each card
        "fast_norm": [done[job] for job in jobs if job[0] == "fast_norm"],  # timm's fast norm, one variant
        "tutorial_settings": [done[job] for job in jobs if job[0] == "tutorial"],  # at 4 x 8192, whatever accum is
        "torch": torch.__version__,
        "gpu_assumptions": allocator.GPU_ASSUMPTIONS,  # what the study scale's nvidia-smi figures assume
        "compute_seconds": seconds,
    }
