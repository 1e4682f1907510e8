"""`python -m gradaccum.cards`: which variants fit on which GPU card, traced without a GPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gradaccum import cards, params

ROOT = Path(__file__).resolve().parent.parent


def test_the_tutorials_baseline_needs_accumulation_on_a_small_card() -> None:
    p = params.load(ROOT / "params.yaml")
    rows = {r["variant"]: r for r in cards.answer(p, ["baseline", "accumulation"], [8, 40])}
    base, acc = rows["baseline"], rows["accumulation"]
    assert 24 < base["traced GiB"] < 27 and 6 < acc["traced GiB"] < 7  # the trace of issue 22's numbers
    assert base["8 GB"] == "accum 4" and base["40 GB"] == "fits"  # 32768 / 4 = 8192 traces to ~6.4 GiB
    assert acc["8 GB"] == "fits" and acc["accum x micro-batch"] == "4 x 8192"


def test_accum_auto_gets_the_smallest_accum_per_card() -> None:
    p = params.set_values(params.read(ROOT / "params.yaml"), ["accum=auto"])
    (row,) = cards.answer(p, ["accumulation"], [8, 40])
    assert row["accum x micro-batch"] == "auto" and math.isnan(row["traced GiB"])
    assert row["8 GB"] == "accum 4" and row["40 GB"] == "accum 1"  # the GroupNorm model: as the baseline's line


def test_the_command_prints_a_row_per_variant_with_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    cards.main(["-S", "accum=8", "--cards", "8", "--variants", "accumulation"])
    out = capsys.readouterr().out
    assert "effective batch 32768 (study scale)" in out
    assert "accumulation" in out and "8 x 4096" in out and "fits" in out and "baseline" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "nope"], "--variants: nope not in params.yaml"),
        (["-S", "accum=0"], "accum = 0 is not allowed"),
        (["-S", "model.name=vit_tiny_patch16_224"], "model.name = 'vit_tiny_patch16_224' cannot take"),
    ],
)
def test_bad_input_is_refused_before_any_trace(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        cards.main(argv)
