"""Stage `gradcheck`: is the accumulated gradient the large-batch gradient? (see gradaccum/gradcheck.py)"""

from __future__ import annotations

import sys
import time

import torch

from gradaccum import gradcheck, mnist, params
from gradaccum.machine import process_seconds
from gradaccum.models import build_model
from gradaccum.outputs import read_json, write_json, write_table
from stages.paths import DATASET, GRADCHECK, GRADCHECK_TSV, HARDWARE


def main() -> None:
    p = params.load()
    device = torch.device(read_json(HARDWARE)["device"])
    data = mnist.load_tensors(DATASET, device, gradcheck.SAMPLES, 0)
    start = time.perf_counter()
    result = gradcheck.gradient_check(
        lambda norm: build_model(**p.model.model_dump(), norm=norm, seed=p.seed, device=device),
        data["train_x"],
        data["train_y"],
        seed=p.seed,
    )
    write_table(GRADCHECK_TSV, result["rows"], gradcheck.COLUMNS)
    seconds = {"compute_seconds": time.perf_counter() - start, "stage_seconds": process_seconds()}
    write_json(GRADCHECK, result | seconds)


if __name__ == "__main__":
    try:
        main()
    except (params.ParamsError, mnist.DataError) as err:
        sys.exit(f"error: {err}")
