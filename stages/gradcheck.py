"""Stage `gradcheck`: is the accumulated gradient the large-batch gradient? (see gradaccum/gradcheck.py)"""

from __future__ import annotations

import time

import torch

from gradaccum import gradcheck, mnist, models, params
from gradaccum.machine import process_seconds
from gradaccum.outputs import write_table
from gradaccum.refusal import refusing
from gradaccum.spec import CHECKED, declared_spec
from stages.paths import DATASET, GRADCHECK, GRADCHECK_TSV, hardware, write_record


def main() -> None:
    p = params.load()
    models.check_input(p.model)  # when run alone: a model that cannot take the images, in one line
    hw = hardware()
    specs = {norm: declared_spec(p, hw, f"gradcheck_{norm}", v) for norm, v in CHECKED.items()}
    data = mnist.load_tensors(DATASET, torch.device(hw.device), gradcheck.SAMPLES, 0)
    start = time.perf_counter()
    result = gradcheck.gradient_check(specs, data["train_x"], data["train_y"])
    write_table(GRADCHECK_TSV, result["rows"], gradcheck.COLUMNS)
    seconds = {"compute_seconds": time.perf_counter() - start, "stage_seconds": process_seconds()}
    write_record(GRADCHECK, result | seconds)


if __name__ == "__main__":
    refusing(main)
