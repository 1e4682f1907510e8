"""The speed stage's rounds (gradaccum/speed.py): every variant timed in every round, interleaved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradaccum import params, speed
from gradaccum.records import Cpu, Hardware, Plan
from gradaccum.report.findings import SpeedRatio, speed_ratios
from gradaccum.spec import resolve
from gradaccum.speed import time_variants


def test_every_variant_is_timed_in_every_round(workdir: Path) -> None:
    text = (workdir / "params.yaml").read_text().replace("    batch: 256\n", "    batch: 8\n")  # the CPU scale, tiny
    (workdir / "params.yaml").write_text(text)
    p = params.load()
    data = {"train_x": torch.randint(0, 256, (8, 28, 28), dtype=torch.uint8), "train_y": torch.arange(8) % 10}
    hw = Hardware(format=1, device="cpu", scale="cpu", cpu=Cpu(name="a CPU", native_bfloat16=False))
    result = time_variants([resolve(p, v, hw) for v in p.variants], data, rounds=2, steps=1)
    assert set(result["variants"]) == set(p.variants) and result["compute_seconds"] > 0
    for name, row in result["variants"].items():
        if name == "groupnorm_precision":  # bfloat16 on a CPU that would emulate it: not run, as in training
            assert "no bfloat16 kernels" in row["not_run"]
            continue
        assert len(row["images_per_s"]) == 2 and all(x > 0 for x in row["images_per_s"])  # the warm-up not kept
        assert row["accum"] == (4 if p.variants[name].accum == "accum" else p.variants[name].accum)
        assert row["micro_batch"] == 8 // row["accum"]
    twin = result["variants"]["batchnorm_lr"]  # the baseline's step at another lr: timed once, shared
    assert twin["same_step_as"] == "baseline" and twin["images_per_s"] == result["variants"]["baseline"]["images_per_s"]
    ratios = speed_ratios(result, "groupnorm")
    assert set(ratios) == set(p.variants) - {"groupnorm_precision"}  # a variant not run has no ratio
    assert all(r.rounds == 2 for r in ratios.values())


def test_a_speed_ratio_pairs_each_round_with_the_references_same_round() -> None:
    """Per round 50/100, 300/200, 90/100 = 0.5, 1.5, 0.9: median 0.9, faster in one round, slower in two.
    Pairing medians instead (80/100) or rounds out of order would give other figures."""
    speed = {"variants": {"groupnorm": {"images_per_s": [100.0, 200.0, 100.0]}, "accumulation": {}}}
    speed["variants"]["accumulation"]["images_per_s"] = [50.0, 300.0, 90.0]
    got = speed_ratios(speed, "groupnorm")["accumulation"]
    assert got == SpeedRatio(median=0.9, min=0.5, max=1.5, rounds=3, faster=1, slower=2)


def test_a_variant_the_planner_puts_over_the_host_budget_is_not_stepped(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The train stage leaves such a variant out (the kernel would kill it, not raise); the speed stage must too."""
    p = params.load()
    hw = Hardware(format=1, device="cpu", scale="cpu", cpu=Cpu(name="a CPU", native_bfloat16=True))
    line = {"fixed_mib": 800.0, "per_sample_mib": 1000.0}  # 1000 MiB a sample: any micro-batch is over 16 GB
    plan = Plan.model_validate(
        {"format": 2, "device": "cpu", "scale": "cpu", "batch": 32, "measure": "peak RSS", "points": []}
        | {"line": line, "line_checkpointing": line, "auto_accum": 1, "auto_accum_checkpointing": 1}
        | {"this_machine": {"memory_mib": 1000, "what": "host memory", "safety_margin": 0.1}}
    )
    specs = [resolve(p, v, hw, plan) for v in p.variants]
    assert all(s.over_budget for s in specs)
    monkeypatch.setattr(speed, "variant_model", lambda *a: pytest.fail("an over-budget variant was built"))
    data = {"train_x": torch.zeros(256, 28, 28, dtype=torch.uint8), "train_y": torch.zeros(256, dtype=torch.long)}
    result = time_variants(specs, data, rounds=1, steps=1)
    for s in specs:
        row = result["variants"][s.variant]
        assert row["did_not_fit"] == s.over_budget.reason and "over memory.host_budget_gb" in row["did_not_fit"]
