"""Stage `sweep`: peak memory at a ladder of micro-batch sizes, and the planner's fit on it.

Writes what `train` needs (the fits and `accum: auto`); the card table for readers is the report's.
"""

from __future__ import annotations

import sys

from gradaccum import mnist, models, params
from gradaccum.machine import process_seconds
from gradaccum.outputs import write_json, write_table
from gradaccum.refusal import BadInput, refuse
from gradaccum.sweep import POINT_COLUMNS, SweepError, sweep
from stages.paths import DATASET, SWEEP_PLAN, SWEEP_POINTS, hardware


def main() -> None:
    p = params.load()
    hw = hardware()
    models.check_input(p.model)  # refused here, in seconds, not by the first point
    scale = p.scale_settings(hw.scale)  # as train refuses it, before the points run (a minute or more)
    mnist.check_batch(hw.scale, scale.batch, scale.train_samples, DATASET)
    plan = sweep(p, hw, log=lambda line: print(line, flush=True))
    write_table(SWEEP_POINTS, plan.points, POINT_COLUMNS)
    write_json(SWEEP_PLAN, plan.model_copy(update={"stage_seconds": process_seconds()}).model_dump(mode="json"))
    line = plan.line
    print(
        f"sweep: peak = {line.fixed_mib:.0f} MiB + {line.per_sample_mib:.3f} MiB/sample (r2 {line.r2:.3f}); "
        f"accum auto -> {plan.auto_accum}"
    )


if __name__ == "__main__":
    try:
        main()
    except BadInput as err:  # a point's refusal too (Refused)
        refuse(err)
    except (SweepError, ValueError) as err:  # a point that crashed (its traceback), or too few points fit
        sys.exit(f"error: {err}")
