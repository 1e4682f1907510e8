"""Stage `report`: reports/report.html (one file, figures embedded, opens offline), report.md + figures/,
and reports/metrics.json (what `dvc exp show` compares). The content is built by gradaccum/report/.
"""

from __future__ import annotations

from pathlib import Path

from gradaccum import params
from gradaccum.outputs import atomic_path, write_json, write_text
from gradaccum.refusal import refusing
from gradaccum.report import Inputs, build, findings, load_variants, variants
from stages.paths import (
    GRADCHECK,
    PROVENANCE,
    SPEED,
    TRACE,
    VARIANTS,
    hardware,
    read,
    read_if_there,
    read_validation,
    sweep_plan,
    variant_dir,
)

REPORT_MD = Path("reports/report.md")
REPORT_HTML = Path("reports/report.html")
FIGURES = Path("reports/figures")
SUMMARY = Path("reports/metrics.json")


def main() -> None:
    p = params.load(model_names=False)  # builds no model: no timm import to check model.name
    results = load_variants(list(p.variants), VARIANTS)
    snapshots = {
        n: (variant_dir(n) / "nvidia-smi.txt").read_text()
        for n in results
        if (variant_dir(n) / "nvidia-smi.txt").exists()
    }
    histories = {
        n: (f"variants/{n}/{f.name}", f.stat().st_size)
        for n in results
        if (f := variant_dir(n) / "memory_snapshot.pickle").exists()
    }
    inputs = Inputs(
        params=p,
        hardware=hardware(),
        provenance=read(PROVENANCE),
        results=results,
        plan=sweep_plan(),
        grad=read_if_there(GRADCHECK),
        speed=read_if_there(SPEED),
        trace=read_if_there(TRACE),
        validation=read_validation(),
        snapshots=snapshots,
        histories=histories,
    )
    groups = p.model.group_norm_groups  # the sentences name the norm by it
    found = findings.findings(results, p.roles, groups, inputs.speed, inputs.plan, inputs.trace)  # every number worded
    rep = build(inputs, found)
    for name, png in rep.figures.items():
        with atomic_path(FIGURES / name) as tmp:
            tmp.write_bytes(png)
    write_json(SUMMARY, variants.summary_metrics(found, inputs.speed))
    write_text(REPORT_MD, rep.markdown())
    write_text(REPORT_HTML, rep.html())
    print(f"report: {REPORT_HTML} and {REPORT_MD} ({len(rep.figures)} figures in {FIGURES})")


if __name__ == "__main__":
    refusing(main)
