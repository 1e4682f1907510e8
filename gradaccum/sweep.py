"""The memory sweep: peak memory at a ladder of micro-batch sizes, and the planner's fit on it.

Each point (gradaccum/sweep_point.py) runs in a fresh interpreter of its own, so the kernel's RSS
high-water mark (CPU) and the CUDA context and caches (GPU) belong to that point alone, as they do
in a train stage. Not forked from a process that has imported torch: that saves 3-4 s of imports a
point, but a forked child's RSS leaves out the library pages its parent faulted in, and the fit's
fixed part came out ~290 MiB low (529 against 817 MiB, measured), an under-estimate of every
training peak. Every point measures the same run spec (spec.sweep_spec) at a micro-batch of its own (at_micro).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import psutil

from gradaccum import params, planner
from gradaccum.memory import MIB
from gradaccum.params import Memory
from gradaccum.records import PLAN_FORMAT, Budget, Hardware, Plan
from gradaccum.refusal import check_child
from gradaccum.spec import RunSpec, sweep_spec

POINT_COLUMNS = (
    "micro_batch",
    "checkpointing",
    "images_per_s",
    "seconds",
    "fit",
    "peak_mib",
    "rss_peak_mib",
    "torch_max_allocated_mib",
    "torch_max_reserved_mib",
    "cuda_context_mib",
    "error",
)


class SweepError(RuntimeError):
    """A sweep point failed for a reason other than memory: the stage stops with it."""


POINT_COMMAND = (sys.executable, "-m", "gradaccum.sweep_point")  # reads the spec as JSON on stdin, prints the row


def run_point(
    spec: RunSpec,
    memory: Memory,
    command: tuple[str, ...] = POINT_COMMAND,
    test_samples: int = 1000,
    last: int = 0,
) -> dict[str, Any]:
    """measure_point of `spec` (at its micro-batch: `RunSpec.at_micro`) in a fresh interpreter, whose last line of
    output is the row as JSON.

    A point that refuses its input raises refusal.Refused with its one line, no traceback.
    Out of memory is a row that did not fit: PyTorch's OutOfMemoryError inside the point (GPU), a failed
    allocation (CPU), or the kernel's out-of-memory killer ending it with SIGKILL (CPU). Any other failure,
    and a point still running after memory.sweep_timeout_s, raises SweepError with what the point printed last.
    """
    micro = spec.micro_batch
    args = [*command, "--steps", str(memory.sweep_steps), "--test-samples", str(test_samples), "--last", str(last)]
    what = f"sweep point micro-batch {micro}{' (checkpointing)' if spec.checkpointing else ''}"
    try:
        proc = subprocess.run(
            args,
            input=spec.model_dump_json(),
            check=False,
            capture_output=True,
            text=True,
            timeout=memory.sweep_timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise SweepError(
            f"{what} was still running after memory.sweep_timeout_s = {memory.sweep_timeout_s} s"
        ) from None
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode == -signal.SIGKILL:  # what the kernel's out-of-memory killer sends
        row: dict[str, Any] = dict.fromkeys(POINT_COLUMNS)
        error = "killed by SIGKILL, as the kernel's out-of-memory killer ends a process"
        return row | {"micro_batch": micro, "checkpointing": spec.checkpointing, "fit": False, "error": error}
    check_child(proc.returncode, proc.stderr)  # bad input, said in one line: passed on, no traceback
    lines = proc.stderr.strip().splitlines()
    tail = "\n".join(lines[-15:])  # a crash: its traceback
    raise SweepError(f"{what} failed with exit code {proc.returncode}:\n{tail}")


def device_memory_mib(hw: Hardware, p: params.Params) -> tuple[float, str]:
    if hw.gpu is not None and hw.device == "cuda":
        return hw.gpu.memory_total_mib, f"{hw.gpu.name} memory"
    host = psutil.virtual_memory().total / MIB
    budget = p.memory.host_budget_gb * planner.GIB_MIB
    return min(host, budget), "host memory (min of RAM and memory.host_budget_gb)"


def sweep(p: params.Params, hw: Hardware, log: Any = print) -> Plan:
    """Every point of the ladder, plain then with checkpointing; the fits and `accum: auto` from them.

    What `train` needs and nothing the report alone reads: the card table is built from this by the report,
    so a report-only setting (memory.cards_gb) re-runs the report only.
    """
    scale = p.scale_settings(hw.scale)
    rows = []
    for checkpointing in (False, True):  # the plain model, then with activation checkpointing
        spec = sweep_spec(p, hw, checkpointing)
        for micro in scale.sweep_micro_batches:
            last = scale.train_samples % micro  # training's epoch ends with this short micro-batch
            row = run_point(spec.at_micro(micro), p.memory, test_samples=scale.test_samples, last=last)
            log(
                f"sweep: micro-batch {micro}{' (checkpointing)' if checkpointing else ''}: "
                + (f"peak {row['peak_mib']} MiB" if row["fit"] else f"did not fit ({row['error']})")
            )
            rows.append(row)
    lines = {}
    for checkpointing in (False, True):
        fitted = [r for r in rows if r["fit"] and r["checkpointing"] == checkpointing]
        lines[checkpointing] = planner.line_through_points(
            [r["micro_batch"] for r in fitted], [r["peak_mib"] for r in fitted]
        )
    memory_mib, memory_what = device_memory_mib(hw, p)
    usable = planner.usable_mib(memory_mib, p.memory.safety_margin)
    return Plan(
        format=PLAN_FORMAT,
        device=hw.device,
        scale=hw.scale,
        batch=scale.batch,
        measure="reserved + CUDA context (what nvidia-smi shows)" if hw.device == "cuda" else "peak RSS (host memory)",
        line=lines[False],
        line_checkpointing=lines[True],
        points=rows,
        this_machine=Budget(memory_mib=round(memory_mib), what=memory_what, safety_margin=p.memory.safety_margin),
        auto_accum=planner.smallest_accum_by_line(lines[False], usable, scale.batch),  # no checkpointing: faster
        auto_accum_checkpointing=planner.smallest_accum_by_line(lines[True], usable, scale.batch),
    )
