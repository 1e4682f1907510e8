"""A variant's curves as it trains, through DVCLive (the DVC project's own logger).

DVCLive writes `metrics.json` (the latest values, which `dvc exp show` reads from the workspace while an
experiment runs) and a TSV per metric under `plots/metrics/` (what `dvc plots` and DVC's VS Code extension
draw), rewritten after each epoch: the loop syncs the device once an epoch, so its step losses arrive then.
The variant's full record (metrics.json, steps.tsv, epochs.tsv) stays the stage's own, written once at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EPOCH_METRICS = ("train_loss", "test_loss", "test_accuracy", "images_per_second")


class LiveCurves:
    """`on_epoch` for loop.train: each optimizer step's loss, and each epoch's metrics at its last step."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.live: Any = None  # made at the first epoch: a variant that does not run never imports DVC (1 s);
        # False where DVCLive is not installed

    def __call__(self, epoch: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        if self.live is None:
            try:
                from dvclive import Live  # imports DVC itself: only the process that logs pays for it
            except ImportError:  # a GPU host without DVC (scripts/device_check.sh): the stage's own record stays
                print("note: dvclive is not installed: no live curves; epochs.tsv and steps.tsv hold them", flush=True)
                self.live = False
                return
            self.live = Live(str(self.directory), report=None, save_dvc_exp=False, dvcyaml=None)
        if self.live is False:
            return
        for row in steps:
            self.live.step = row["step"]
            self.live.log_metric("train_loss", row["train_loss"])
        for key in EPOCH_METRICS:
            self.live.log_metric(f"per_epoch/{key}", epoch[key])
        self.live.log_metric("epoch", epoch["epoch"], plot=False)
        self.live.next_step()  # metrics.json now says how far the run is

    def close(self) -> None:
        if self.live:
            self.live.end()


def ensure_outputs(directory: Path) -> None:
    """What dvc.yaml declares, also for a variant that did not fit or did not run (no epoch was logged)."""
    (directory / "plots/metrics").mkdir(parents=True, exist_ok=True)
    if not (directory / "metrics.json").exists():
        (directory / "metrics.json").write_text(json.dumps({}) + "\n")
