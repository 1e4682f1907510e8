"""docs/validation.json, the validation's rows and summary the report shows, against benchmarks/validate.py."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks import validate
from gradaccum.report import traced
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
        assert s["rows"] == len(ratios) and s["goal"] == traced.GOALS[s["measured"]]
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
