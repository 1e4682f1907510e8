"""Stage `trace`: every variant's peak memory at both scales, traced without a GPU (gradaccum/study_trace.py).

Runs on any machine, re-runs only when what it traces changes (the model, the variants, the scales'
batches, the precisions), and refuses a model that cannot take the data's images before anything else.
"""

from __future__ import annotations

from gradaccum import models, params, study_trace
from gradaccum.machine import process_seconds
from gradaccum.refusal import refusing
from stages.paths import TRACE, write_record


def main() -> None:
    p = params.load()
    models.check_input(p.model)
    result = study_trace.trace_all(p, log=lambda line: print(line, flush=True))
    write_record(TRACE, result | {"stage_seconds": process_seconds()})


if __name__ == "__main__":
    refusing(main)
