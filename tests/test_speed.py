"""The speed stage's rounds (gradaccum/speed.py): every variant timed in every round, interleaved."""

from __future__ import annotations

from pathlib import Path

import torch

from gradaccum import params
from gradaccum.report.tables import speed_ratios
from gradaccum.speed import time_variants


def test_every_variant_is_timed_in_every_round(workdir: Path) -> None:
    text = (workdir / "params.yaml").read_text().replace("    batch: 256\n", "    batch: 8\n")  # the CPU scale, tiny
    (workdir / "params.yaml").write_text(text)
    p = params.load()
    data = {"train_x": torch.randint(0, 256, (8, 28, 28), dtype=torch.uint8), "train_y": torch.arange(8) % 10}
    hw = {"device": "cpu", "scale": "cpu", "cpu": {"native_bfloat16": False}}
    result = time_variants(p, hw, data, None, rounds=2, steps=1)
    assert set(result["variants"]) == set(p.variants) and result["compute_seconds"] > 0
    for name, row in result["variants"].items():
        if name == "groupnorm_precision":  # bfloat16 on a CPU that would emulate it: not run, as in training
            assert "no bfloat16 kernels" in row["not_run"]
            continue
        assert len(row["images_per_s"]) == 2 and all(x > 0 for x in row["images_per_s"])  # the warm-up not kept
        assert row["accum"] == (4 if p.variants[name].accum == "accum" else p.variants[name].accum)
        assert row["micro_batch"] == 8 // row["accum"]
    ratios = speed_ratios(result)
    assert ratios["groupnorm"] == {"median": 1.0, "min": 1.0, "max": 1.0, "rounds": 2, "faster": 0, "slower": 0}
    assert "groupnorm_precision" not in ratios
