"""The report's traced-memory tables: the trace stage's peaks (reports/trace.json) against what was measured,
the GPU card table from the trace, and the tutorial's GPU figures beside the traced allocation."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from gradaccum.params import Roles
from gradaccum.records import Plan, VariantRecord
from gradaccum.report import rules
from gradaccum.report.claims import COSTS, SAVES, verdict
from gradaccum.report.findings import CLAIMED_SHARE, holds
from gradaccum.report.results import Results, fmt, load_variants, peak_mib
from gradaccum.tutorial import CLAIMS

FIXED_KINDS = ("parameters_mib", "buffers_mib", "gradients_mib", "optimizer_mib", "data_mib")


def fixed_mib(r: dict[str, Any]) -> float:
    """What does not grow with the micro-batch: weights, gradients, optimizer state, resident data."""
    return sum(r[k] for k in FIXED_KINDS)


def gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.2f}"


def rows_at(trace: dict[str, Any], scale: str) -> dict[str, dict[str, Any]]:
    return {r["variant"]: r for r in trace["rows"] if r["scale"] == scale}


PREDICTED = (  # the study scale's predicted GPU figures (gradaccum/allocator.py) and what a GPU measures of each
    ("allocated", "gpu_allocated_mib", "torch_max_allocated_mib"),
    ("reserved", "gpu_reserved_mib", "torch_max_reserved_mib"),
    ("nvidia-smi", "gpu_nvidia_smi_mib", "nvidia_smi_peak_mib"),
)


def gpu_answers(trace: dict[str, Any], roles: Roles) -> dict[str, str]:
    """The report's first screen, by question: what the trace predicts for a GPU at the study scale."""
    rows = rows_at(trace, "study")
    acc, base, gn = (rows.get(n) for n in (roles.treatment, roles.baseline, roles.norm_control))
    out = {COSTS: "Not predicted: speed needs a GPU run (scripts/gpu_check.sh)."}
    if acc and base:
        text = (
            f"Yes: {gib(acc['peak_mib'])} against {gib(base['peak_mib'])} GiB of tensors "
            f"({acc['peak_mib'] / base['peak_mib']:.2f}); {gib(acc['gpu_nvidia_smi_mib'])} against "
            f"{gib(base['gpu_nvidia_smi_mib'])} GiB in nvidia-smi"
        )
        if gn:
            text += f"; GroupNorm at full batch: {gib(gn['peak_mib'])} GiB"
        out[SAVES] = text + "."
    return out


def measured_ratios(trace: dict[str, Any], results: Results) -> Measured:
    """Per variant a GPU trained: each predicted figure's measurement and predicted / measured, worked out once."""
    out = {}
    for name, r in rows_at(trace, "study").items():
        if name in results and (m := results[name].record).completed:
            out[name] = {
                label: (measured, r[key] / measured)
                for label, key, measured_key in PREDICTED
                if key in r and (measured := getattr(m.memory, measured_key))
            }
    return out


Measured = dict[str, dict[str, tuple[float, float]]]  # variant -> figure -> (measured MiB, predicted / measured)


def study_rows(trace: dict[str, Any], measured: Measured) -> list[dict[str, Any]]:
    """Every variant's traced peak at the study scale, by kind, and the GPU figures it predicts: PyTorch's
    allocated and reserved peaks and nvidia-smi's; where a GPU ran the study, each beside what it measured."""
    out = []
    for name, r in rows_at(trace, "study").items():
        if "peak_mib" not in r:
            out.append({"variant": name, "traced peak (GiB)": "-", "note": r.get("note", "-")})
            continue
        row = {
            "variant": name,
            "accum x micro-batch": f"{r['accum']} x {r['micro_batch']}",
            "autocast": r["amp"],
            "policy": r["autocast_policy"],
            "traced peak (GiB)": gib(r["peak_mib"]),
            "activations": gib(r["activations_mib"]),
            "temporaries": gib(r["temporaries_mib"]),
            "weights, gradients, optimizer, data": gib(fixed_mib(r)),
        }
        for label, key, _ in PREDICTED:
            row[f"{label}, predicted (GiB)"] = gib(r.get(key))
        for label, (mib, ratio) in measured.get(name, {}).items():
            row[f"{label}, measured (GiB)"] = gib(mib)
            row[f"{label}: predicted / measured"] = fmt(ratio, 3)
        out.append(row)
    return out


def validation_summary(validation: dict[str, Any]) -> str:
    """The same engine (gradaccum.fit) against GPU figures other people measured and published: by what each
    measured, how many rows came within the goal, from how many sources."""
    parts = [
        f"{s['measured']}: {s['within_goal']} of {s['rows']} within {s['goal']:.0%} (predicted / published "
        f"{s['min_ratio']:.3f} to {s['max_ratio']:.3f}, {s['sources']} source{'s' * (s['sources'] > 1)})"
        for s in validation["summary"]
    ]
    rows, sources = len(validation["rows"]), len({rules.measured_by(r) for r in validation["rows"]})
    return (
        f"The engine behind these predictions, checked against {rows} published GPU measurements from {sources} "
        f"independent sources (`{validation['command']}`; docs/validation.md has every row, its setup and why "
        "the misses miss): " + "; ".join(parts) + "."
    )


def gpu_verdicts(measured: Measured) -> str:
    """Where a GPU ran: how many variants each prediction brought within its goal, and the worst ratio."""
    parts = []
    for label, goal in rules.GOALS.items():
        ratios = [v[label][1] for v in measured.values() if label in v]
        if ratios:
            within = sum(abs(x - 1) <= goal for x in ratios)
            worst = max(ratios, key=lambda x: abs(x - 1))
            parts.append(f"{label}: {within} of {len(ratios)} variants within {goal:.0%} (worst {worst:.3f})")
    return "; ".join(parts) + "." if parts else "No variant measured on a GPU to hold the predictions against."


@dataclass(frozen=True)
class NormCost:
    """GroupNorm's activations against BatchNorm's at the same micro-batch, both traced under CUDA's autocast rules
    (the treatment against its BatchNorm control)."""

    accum: int
    micro_batch: int
    group: dict[str, Any]  # the two trace rows
    batch: dict[str, Any]

    @property
    def ratio(self) -> float:
        return self.group["activations_mib"] / self.batch["activations_mib"]

    @property
    def more_kib_per_sample(self) -> float:
        return (self.group["activations_mib"] - self.batch["activations_mib"]) / self.micro_batch * 1024

    @property
    def costs(self) -> bool:
        """Whether the swap costs memory: more than rules.SAME_ACTIVATIONS times BatchNorm's activations."""
        return self.ratio > rules.SAME_ACTIVATIONS


def norm_cost(trace: dict[str, Any], roles: Roles) -> NormCost | None:
    """The treatment's traced step against its BatchNorm control's, where both traced at one micro-batch."""
    study = rows_at(trace, "study")
    group, batch = study.get(roles.treatment, {}), study.get(roles.accum_control, {})
    if "peak_mib" not in group or "peak_mib" not in batch or group["micro_batch"] != batch["micro_batch"]:
        return None
    return NormCost(group["accum"], group["micro_batch"], group, batch)


def groupnorm_cost(trace: dict[str, Any], roles: Roles) -> str:
    """The finding: what GroupNorm costs over BatchNorm on a GPU, per sample at the same micro-batch."""
    cost = norm_cost(trace, roles)
    if cost is None:
        return ""
    at = f"{cost.accum} x {cost.micro_batch}"
    traced = f"({cost.group['peak_mib'] / 1024:.2f} against {cost.batch['peak_mib'] / 1024:.2f} GiB traced)"
    if not cost.costs:
        return (
            f"GroupNorm and BatchNorm keep the same activations at {at} ({cost.ratio:.2f}x) "
            f"{traced}: the norm swap costs no memory here."
        )
    return (
        f"**GroupNorm is not free on a GPU.** Under CUDA's autocast `group_norm` runs in float32 and `batch_norm` "
        f"in float16, so at the same micro-batch ({at}) the GroupNorm model keeps "
        f"{cost.ratio:.2f}x BatchNorm's activations, {cost.more_kib_per_sample:.0f} KiB more per sample {traced}. The "
        "tutorial swapped the norm so that accumulation would be exact; on a GPU that swap takes back part of what the "
        "micro-batch saved." + fast_norm_text(trace, cost.group)
    )


def fast_norm_text(trace: dict[str, Any], group: dict[str, Any]) -> str:
    """The lever against that cost, traced: timm's fast norm, with its caveat."""
    fast = next(iter(trace.get("fast_norm", [])), None)
    if not fast or "peak_mib" not in fast:
        return ""
    smi = f", nvidia-smi {fast['gpu_nvidia_smi_mib'] / 1024:.2f} predicted" if "gpu_nvidia_smi_mib" in fast else ""
    return (
        f" The lever that avoids it: timm's fast norm (`timm.layers.set_fast_norm()` before the model is built) runs "
        f"GroupNorm in the autocast dtype; `{fast['variant']}` with it traces to {fast['peak_mib'] / 1024:.2f} GiB "
        f"({group['peak_mib'] / 1024:.2f} without{smi}). Caveat: GroupNorm then normalises float16 inputs, which "
        "PyTorch's autocast avoids on purpose (AMP keeps norms in float32 for accuracy); this study has not measured "
        "what it does to the loss, and the tutorial's plain nn.GroupNorm ignores the switch."
    )


def assumptions(trace: dict[str, Any]) -> list[dict[str, str]]:
    """What the predicted nvidia-smi figures assume beyond the traced tensors and the allocator's rules."""
    return [{"on top of the allocator": k, "assumed (source)": v} for k, v in trace.get("gpu_assumptions", {}).items()]


def cpu_rows(trace: dict[str, Any], results: Results, plan: Plan | None) -> list[dict[str, Any]]:
    """The CPU scale, where the trace can be held against real tensors: the same step with the CPU allocator's
    every allocation recorded (the profiler), and the training run's RSS less the sweep's fixed part."""
    out = []
    for name, r in rows_at(trace, "cpu").items():
        if "peak_mib" not in r:
            continue
        allocated = r["allocated_peak_mib"]
        off = r["peak_mib"] / allocated - 1
        row = {
            "variant": name,
            "accum x micro-batch": f"{r['accum']} x {r['micro_batch']}",
            "traced (MiB)": fmt(r["peak_mib"], 0),
            "activations, temporaries": fmt(r["activations_mib"] + r["temporaries_mib"], 0),
            "weights, gradients, optimizer, data": fmt(fixed_mib(r), 0),
            "allocated, real tensors (MiB)": fmt(allocated, 0),
            "traced / allocated": fmt(r["peak_mib"] / allocated, 3),
            "verdict": f"within {rules.CLOSE:.0%}"
            if abs(off) <= rules.CLOSE
            else f"trace {'over' if off > 0 else 'under'} by {abs(off):.1%}",
        }
        m = results[name].record if name in results else None
        if plan and m is not None and m.completed:
            fixed = plan.lines[m.checkpointing].fixed_mib
            grown = peak_mib(m) - fixed
            row["training RSS less the sweep's fixed part (MiB)"] = fmt(grown, 0)
            row["traced / that"] = fmt(r["peak_mib"] / grown, 2) if grown > 0 else "-"
        out.append(row)
    return out


def cpu_note(trace: dict[str, Any]) -> str:
    """What the CPU validation found off by more than rules.CLOSE, per sample (it grows with the micro-batch)."""
    off = [
        f"{r['variant']} ({r['peak_mib'] / r['allocated_peak_mib'] - 1:+.1%}: the real step allocated "
        f"{(r['allocated_peak_mib'] - r['peak_mib']) / r['micro_batch']:.3f} MiB per sample more)"
        for r in rows_at(trace, "cpu").values()
        if "peak_mib" in r and abs(r["peak_mib"] / r["allocated_peak_mib"] - 1) > rules.CLOSE
    ]
    if not off:
        return f"The trace is within {rules.CLOSE:.0%} of the real allocations for every variant."
    return (
        f"Off by more than {rules.CLOSE:.0%}: "
        + "; ".join(off)
        + ". Where that is a checkpointing variant, the real step "
        "holds more per sample than the trace sees in backward's recompute, a gap MemTracker documents for "
        "activation checkpointing; the same variant's GPU trace above is likely short by the same share."
    )


def traced_card_rows(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per GPU card: the fewest micro-batches a step of the study's batch needs, plain and with checkpointing,
    each replayed on the card by the trace stage (gradaccum.cards.study_cards)."""
    cards = trace["study_cards"]
    return [
        {"card (GB)": plain["card_gb"], "usable (MiB)": plain["usable_mib"]}
        | {kind: accum_text(rows[i]) for kind, rows in cards.items()}
        for i, plain in enumerate(cards["plain"])
    ]


def accum_text(card: dict[str, Any]) -> str:
    if card["accum"] is None:
        return "does not fit even at micro-batch 2"
    text = f"accum {card['accum']} (micro-batch {card['micro_batch']}): {card['nvidia_smi_mib'] / 1024:.1f} GiB"
    return text + (", cache freed" if card["cache_frees"] else "")


@dataclass(frozen=True)
class ClaimedFigure:
    """One of the tutorial's nvidia-smi figures against the predicted figure of the step it measured (traced at its
    settings), with this run's own step where its settings differ and, where a GPU ran the study, its record."""

    variant: str
    text: str
    claimed_gib: float  # the claimed GB read as GiB, as nvidia-smi's MiB divided by 1024
    row: dict[str, Any]  # traced at the tutorial's settings
    own: dict[str, Any]  # traced at this run's
    record: VariantRecord | None

    def gib(self, key: str) -> float:
        return self.row[key] / 1024

    @property
    def differs(self) -> bool:
        return (self.own.get("accum"), self.own.get("micro_batch")) != (self.row["accum"], self.row["micro_batch"])

    @property
    def gpu_gib(self) -> float | None:
        """What this run's GPU measured, where it trained to the end."""
        m = self.record
        return m.memory.nvidia_smi_peak_mib / 1024 if m and m.completed and m.memory.nvidia_smi_peak_mib else None

    @property
    def held(self) -> float | None:
        """The GPU's measurement over the claim, where it ran the tutorial's own step."""
        return self.gpu_gib / self.claimed_gib if self.gpu_gib and not self.differs else None

    @property
    def unexplained_gib(self) -> float:
        """The claim less the predicted nvidia-smi figure (negative: the prediction is over it)."""
        return self.claimed_gib - self.gib("gpu_nvidia_smi_mib")


def claimed_figures(trace: dict[str, Any], results: Results, on_gpu: bool, roles: Roles) -> list[ClaimedFigure]:
    """The baseline's 30 GB and the tutorial's own code's 13.7 GB, each against its step traced at the tutorial's
    settings (4 x 8192 of 32768, whatever params.yaml says)."""
    this_run = rows_at(trace, "study")
    study = this_run | {r["variant"]: r for r in trace["tutorial_settings"]}
    base_gb, acc_gb = CLAIMS["baseline_gb"], CLAIMS["accumulation_gb"]
    claims = (
        (roles.baseline, f"about {base_gb:g} GB at batch {CLAIMS['batch']} (BatchNorm), in nvidia-smi", base_gb),
        (
            roles.tutorial_code,
            f"about {acc_gb:g} GB with {CLAIMS['micro']} x {CLAIMS['accum']} (GroupNorm), in nvidia-smi",
            acc_gb,
        ),
    )
    out = []
    for name, text, gb in claims:
        r = study.get(name, {})
        if "gpu_nvidia_smi_mib" in r:
            m = results[name].record if on_gpu and name in results else None
            out.append(ClaimedFigure(name, text, gb, r, this_run.get(name, r), m))
    return out


def figure_row(c: ClaimedFigure) -> dict[str, str]:
    """A claimed figure as the claims table words it: the prediction, this run's, and what explains the claim."""
    m, r = c.record, c.row
    tensors, reserved, smi, context = (c.gib(k) for k in KEYS_GIB)
    at = f" (at this run's {m.accum} x {m.micro_batch})" if m and c.differs else ""
    measured = f"; on this GPU: {m.why_not()}" if m and not m.completed else ""
    measured += f"; nvidia-smi on this GPU {c.gpu_gib:.1f} GiB{at}" if c.gpu_gib else ""
    if c.differs and "gpu_nvidia_smi_mib" in c.own:
        measured = (
            f"; this run's settings differ ({c.own['accum']} x {c.own['micro_batch']}): tensors "
            f"{c.own['peak_mib'] / 1024:.1f} GiB, nvidia-smi {c.own['gpu_nvidia_smi_mib'] / 1024:.1f} predicted"
            + measured
        )
    gb, left = c.claimed_gib, c.unexplained_gib
    return {
        "tutorial's claim": c.text,
        "measured": f"`{c.variant}` predicted at the tutorial's settings: tensors {tensors:.1f} GiB ({r['amp']}, "
        f"{r['accum']} x {r['micro_batch']}, CUDA's autocast rules), reserved {reserved:.1f}, nvidia-smi "
        f"{smi:.1f}" + measured,
        "measured / claimed": fmt(c.held or smi / gb, 2),
        "verdict": (f"measured on this GPU: {verdict(c.held)}; " if c.held else "")
        + f"of the claim, the tensors explain {tensors / gb:.0%}, the caching allocator's reserve "
        f"(rounding, cache, cuBLAS workspaces) {(reserved - tensors) / gb:.0%}, the CUDA context (assumed) "
        f"{context / gb:.0%}; "
        + (
            f"{left / gb:.0%} ({left:.1f} GiB) is still unexplained"
            if left > 0
            else f"the prediction is {-left:.1f} GiB over it"
        ),
    }


KEYS_GIB = ("peak_mib", "gpu_reserved_mib", "gpu_nvidia_smi_mib", "gpu_context_mib")  # tensors, reserved, smi, context


def tutorial_claims(trace: dict[str, Any], results: Results, on_gpu: bool, roles: Roles) -> list[dict[str, str]]:
    """The tutorial's nvidia-smi figures against the predicted nvidia-smi figure of the same step (`claimed_figures`),
    what share of each the traced tensors, the caching allocator's cache and the CUDA context explain and what is
    left; where a GPU ran the study, its measurement beside the prediction, held to the claim itself where it ran
    the tutorial's step. Then the memory share the two figures make, predicted at the study's scale."""
    figures = claimed_figures(trace, results, on_gpu, roles)
    out = [figure_row(c) for c in figures]
    rows = {c.variant: c.row for c in figures}
    base, acc = rows.get(roles.baseline), rows.get(roles.tutorial_code)
    if base and acc:
        claimed = CLAIMED_SHARE
        ratio = acc["gpu_nvidia_smi_mib"] / base["gpu_nvidia_smi_mib"]
        tensors = acc["peak_mib"] / base["peak_mib"]
        out.append(
            {
                "tutorial's claim": f"accumulation needs {claimed:.0%} of the baseline's memory, at the study's scale",
                "measured": f"`{roles.tutorial_code}` over `{roles.baseline}` at the tutorial's settings "
                f"({acc['accum']} x {acc['micro_batch']} against 1 x {base['micro_batch']}), predicted nvidia-smi: "
                f"{ratio:.2f} "
                f"({acc['gpu_nvidia_smi_mib'] / 1024:.1f} / {base['gpu_nvidia_smi_mib'] / 1024:.1f} GiB); "
                f"the tensors alone {tensors:.2f}",
                "measured / claimed": fmt(ratio / claimed, 2),
                "verdict": "about what the tutorial saw"
                if holds(ratio / claimed)
                else (
                    "accumulation shrinks memory more than the tutorial saw"
                    if ratio < claimed
                    else "accumulation shrinks memory less than the tutorial saw"
                ),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m gradaccum.report.traced [REPORTS]`: each study-scale variant's predicted GPU figures beside what
    the GPU measured, with their ratios; scripts/gpu_check.sh prints it last, so the first GPU run validates the
    allocator's model or refutes it at a glance."""
    folder = Path((argv or sys.argv[1:] or ["reports"])[0])
    trace = json.loads((folder / "trace.json").read_text())
    hardware = folder / "hardware.json"
    hw = json.loads(hardware.read_text()) if hardware.exists() else {}
    on_gpu = hw.get("scale") == "study" and hw.get("device") == "cuda"
    try:
        results = load_variants([r["variant"] for r in rows_at(trace, "study").values()], folder / "variants")
    except FileNotFoundError:
        results = {}
    measured = measured_ratios(trace, results) if on_gpu else {}
    rows = study_rows(trace, measured)
    columns = dict.fromkeys(c for r in rows for c in r)  # a variant that did not fit has no measured columns
    keep = ["variant", "accum x micro-batch"] + [c for c in columns if "predicted" in c or "measured" in c]
    print(pd.DataFrame(rows).reindex(columns=keep).to_string(index=False, na_rep="-"))
    print(
        "Predicted against measured: " + gpu_verdicts(measured)
        if on_gpu
        else "No GPU ran the study here: predictions only."
    )


if __name__ == "__main__":
    main()
