"""The report's traced-memory tables: the trace stage's peaks (reports/trace.json) against what was measured,
the GPU card table from the trace, and the tutorial's GPU figures beside the traced allocation."""

from __future__ import annotations

import math
from typing import Any

from gradaccum import planner
from gradaccum.report.tables import Results, fmt, peak_mib
from gradaccum.tutorial import CLAIMS

FIXED_KINDS = ("parameters_mib", "buffers_mib", "gradients_mib", "optimizer_mib", "data_mib")


def fixed_mib(r: dict[str, Any]) -> float:
    """What does not grow with the micro-batch: weights, gradients, optimizer state, resident data."""
    return sum(r[k] for k in FIXED_KINDS)


def gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.2f}"


def rows_at(trace: dict[str, Any], scale: str) -> dict[str, dict[str, Any]]:
    return {r["variant"]: r for r in trace["rows"] if r["scale"] == scale}


def study_rows(trace: dict[str, Any], results: Results, on_gpu: bool) -> list[dict[str, Any]]:
    """Every variant's traced peak at the study scale, by kind; beside it, where the study ran on a GPU,
    PyTorch's allocated and reserved peaks and nvidia-smi's, and the trace over the allocated peak."""
    out = []
    for name, r in rows_at(trace, "study").items():
        if "peak_mib" not in r:
            out.append({"variant": name, "traced peak (GiB)": "-", "note": r.get("note", "-")})
            continue
        row = {
            "variant": name,
            "accum x micro-batch": f"{r['accum']} x {r['micro_batch']}",
            "autocast": r["amp"],
            "policy": r.get("autocast_policy", "not recorded (traced before it was)"),
            "traced peak (GiB)": gib(r["peak_mib"]),
            "activations": gib(r["activations_mib"]),
            "temporaries": gib(r["temporaries_mib"]),
            "weights, gradients, optimizer, data": gib(fixed_mib(r)),
        }
        m = results[name].record if name in results else None
        if on_gpu and m is not None and m.fit and m.memory.torch_max_allocated_mib:
            allocated = m.memory.torch_max_allocated_mib
            row |= {
                "allocated (GiB)": gib(allocated),
                "traced / allocated": fmt(r["peak_mib"] / allocated, 3),
                "reserved (GiB)": gib(m.memory.torch_max_reserved_mib),
                "nvidia-smi (GiB)": gib(m.memory.nvidia_smi_peak_mib),
            }
        out.append(row)
    return out


def cpu_rows(trace: dict[str, Any], results: Results, plan: dict[str, Any] | None) -> list[dict[str, Any]]:
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
            "verdict": "within 5%" if abs(off) <= 0.05 else f"trace {'over' if off > 0 else 'under'} by {abs(off):.1%}",
        }
        m = results[name].record if name in results else None
        if plan and m is not None and m.fit:
            fixed = plan["fit_checkpointing" if m.checkpointing else "fit"]["fixed_mib"]
            grown = peak_mib(m) - fixed
            row["training RSS less the sweep's fixed part (MiB)"] = fmt(grown, 0)
            row["traced / that"] = fmt(r["peak_mib"] / grown, 2) if grown > 0 else "-"
        out.append(row)
    return out


def cpu_note(trace: dict[str, Any]) -> str:
    """What the CPU validation found off by more than 5%, per sample (it grows with the micro-batch)."""
    off = [
        f"{r['variant']} ({r['peak_mib'] / r['allocated_peak_mib'] - 1:+.1%}: the real step allocated "
        f"{(r['allocated_peak_mib'] - r['peak_mib']) / r['micro_batch']:.3f} MiB per sample more)"
        for r in rows_at(trace, "cpu").values()
        if "peak_mib" in r and abs(r["peak_mib"] / r["allocated_peak_mib"] - 1) > 0.05
    ]
    if not off:
        return "The trace is within 5% of the real allocations for every variant."
    return (
        "Off by more than 5%: " + "; ".join(off) + ". Where that is a checkpointing variant, the real step "
        "holds more per sample than the trace sees in backward's recompute, a gap MemTracker documents for "
        "activation checkpointing; the same variant's GPU trace above is likely short by the same share."
    )


def card_rows(trace: dict[str, Any], batch: int, cards_gb: list[float], margin: float) -> list[dict[str, Any]]:
    """Per GPU card: the fewest micro-batches a step of the study's batch needs, from the traced lines."""
    out = []
    for card in cards_gb:
        usable = card * planner.GIB_MIB * (1 - margin)
        row: dict[str, Any] = {"card (GB)": card, "usable (MiB)": round(usable)}
        for lever, line in trace["study_lines"].items():
            accum = planner.smallest_accum(line, usable, batch)
            if accum is None:
                row[lever] = "does not fit even at micro-batch 1"
                continue
            micro = math.ceil(batch / accum)  # as planner.card_table: the report imports no torch
            row[lever] = f"accum {accum} (micro-batch {micro}): {planner.predict_mib(line, micro) / 1024:.1f} GiB"
        out.append(row)
    return out


def tutorial_claims(trace: dict[str, Any], results: Results, on_gpu: bool) -> list[dict[str, str]]:
    """The tutorial's nvidia-smi figures against the traced allocation of the same step, and what is left over:
    the CUDA context and the caching allocator's reserve, measured where a GPU ran and unknown where not."""
    study = rows_at(trace, "study")
    out = []
    for name, text, gb in (
        ("baseline", "about 30 GB at batch 32768 (BatchNorm), in nvidia-smi", CLAIMS["baseline_gb"]),
        ("accumulation", "about 13.7 GB with 8192 x 4 (GroupNorm), in nvidia-smi", CLAIMS["accumulation_gb"]),
    ):
        r = study.get(name, {})
        if "peak_mib" not in r:
            continue
        traced = r["peak_mib"] / 1024
        m = results[name].record if name in results else None
        if on_gpu and m is not None and m.fit and m.memory.nvidia_smi_peak_mib:
            smi = m.memory.nvidia_smi_peak_mib / 1024
            extra = f"nvidia-smi here {smi:.1f} GB, {smi - traced:.1f} GB over the trace (context and cache, measured)"
        else:
            extra = "what nvidia-smi adds (CUDA context, cuDNN workspaces, the allocator's cache): unknown, no GPU ran"
        left = gb - traced
        verdict = f"the step's tensors are {traced / gb:.0%} of the claim; " + (
            f"the other {left:.1f} GB are not tensors the step holds: a CUDA context takes a few hundred MB, the "
            "rest would be the caching allocator's reserve and cuDNN workspaces, unmeasured without a GPU"
            if left < traced
            else f"the other {left:.1f} GB, more than the step's own tensors, are unexplained without a GPU run"
        )
        out.append(
            {
                "tutorial's claim": text,
                "measured": f"traced allocation {traced:.1f} GiB ({r['amp']}, accum {r['accum']} x {r['micro_batch']}, "
                f"activations {r['activations_mib'] / 1024:.1f}); {extra}",
                "measured / claimed": fmt(traced / gb, 2),
                "verdict": verdict,
            }
        )
    base, acc = study.get("baseline", {}), study.get("accumulation", {})
    if "peak_mib" in base and "peak_mib" in acc:
        claimed = CLAIMS["accumulation_gb"] / CLAIMS["baseline_gb"]
        ratio = acc["peak_mib"] / base["peak_mib"]
        out.append(
            {
                "tutorial's claim": f"accumulation needs {claimed:.0%} of the baseline's memory, at the study's scale",
                "measured": f"traced: {ratio:.2f} ({acc['peak_mib'] / 1024:.1f} / {base['peak_mib'] / 1024:.1f} GiB)",
                "measured / claimed": fmt(ratio / claimed, 2),
                "verdict": "the tensors alone shrink more than the tutorial's nvidia-smi figures did"
                if ratio < claimed
                else "the tensors shrink less than the tutorial saw",
            }
        )
    return out
