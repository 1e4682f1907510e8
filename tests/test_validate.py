"""docs/validation.json, the validation's rows and summary the report shows, against benchmarks/validate.py."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks import validate
from gradaccum.report import rules, traced
from stages.paths import read_validation


def test_the_committed_validation_has_every_row_of_the_benchmark_at_its_setup() -> None:
    """A row added or changed in benchmarks/validate.py without `--write` leaves the report's summary stale."""
    done = read_validation()
    assert done["command"] == "python -m benchmarks.validate --write docs/validation.json"
    setups = [{k: v for k, v in r.items() if k not in ("predicted_mib", "ratio")} for r in done["rows"]]
    assert setups == [asdict(row) | {"input": list(row.input)} for row in validate.ROWS]
    for r in done["rows"]:
        assert r["ratio"] == round(r["predicted_mib"] / r["mib"], 3)
    for s in done["summary"]:
        ratios = [r["ratio"] for r in done["rows"] if r["measured"] == s["measured"]]
        assert s["rows"] == len(ratios) and s["goal"] == rules.GOALS[s["measured"]]
        assert s["within_goal"] == sum(abs(x - 1) <= s["goal"] for x in ratios)


def test_the_reports_summary_counts_rows_sources_and_rows_within_each_goal() -> None:
    rows = [{"source": "a", "measured": "nvidia-smi"}, {"source": "b", "measured": "nvidia-smi"}]
    summary = [
        {"measured": "nvidia-smi", "rows": 2, "sources": 2, "goal": 0.1, "within_goal": 1, "min_ratio": 0.62,
         "max_ratio": 1.02, "median_ratio": 0.8},
    ]  # fmt: skip
    command = "python -m benchmarks.validate --write docs/validation.json"
    text = traced.validation_summary({"command": command, "summary": summary, "rows": rows})
    assert "checked against 2 published GPU measurements from 2 independent sources" in text
    assert "nvidia-smi: 1 of 2 within 10% (predicted / published 0.620 to 1.020, 2 sources)" in text


def test_the_committed_runs_are_the_benchmarks_and_resnet50_fits_24_gb_only_by_freeing_the_cache() -> None:
    """timm's RTX 3090 benchmark ran resnet50 at batch 512: on a card with room the step would reserve more than
    the 24 GB card, but its allocated peak fits under the card less the context, so the allocator frees its cache
    and retries, and the card fits."""
    done = read_validation()
    assert [{k: r[k] for k in ("source", "model", "batch", "ran")} for r in done["runs"]] == [
        asdict(run) for run in validate.TIMM_RUNS
    ]
    (resnet50,) = (r for r in done["runs"] if r["model"] == "resnet50")
    card = resnet50["margins"]["0.0"]
    assert resnet50["ran"] and card["fits"] and card["cache_frees"] >= 1
    assert card["room_nvidia_smi_mib"] > 24 * 1024 > card["allocated_mib"] + 500
    assert validate.on_the_card(validate.TIMM_RUNS[0], 0.0) == card  # re-derived, not only read
