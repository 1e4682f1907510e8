"""The per-variant tables: every record, the seeds, the gradient check, where the time went, metrics.json."""

from __future__ import annotations

from typing import Any

from gradaccum.records import Plan, VariantRecord
from gradaccum.report.findings import Findings
from gradaccum.report.results import Results, fmt, peak_mib, seed_mean, seed_text
from gradaccum.tutorial import kept_mistakes


def kept_labels(m: VariantRecord) -> list[str]:
    """The tutorial's mistakes a variant ran with, as the report names them."""
    return [c.label for c in kept_mistakes(m.model_dump())]


def code_label(m: VariantRecord) -> str:
    """Which of the tutorial's three mistakes a variant ran with; "exact" when none."""
    kept = kept_labels(m)
    return "tutorial: " + ", ".join(kept) if kept else "exact"


def cudnn_label(m: VariantRecord) -> str:
    """The cuDNN flags the variant trained under: set on a GPU, none on a CPU (where the switch changes nothing)."""
    c = m.cudnn
    if not c.applied:
        return f"{c.setting}: nothing set ({c.note})" if c.note else c.setting
    return f"{c.setting}: enabled={c.enabled}, deterministic={c.deterministic}, benchmark={c.benchmark}"


def variants_table(results: Results) -> list[dict[str, Any]]:
    """One row per variant; on a GPU, nvidia-smi's peak beside PyTorch's allocated and reserved peaks."""
    rows = []
    for name, r in results.items():
        m = r.record
        mem, failed = m.memory, m.did_not_fit
        row = {
            "variant": name,
            "norm": m.norm,
            "accum": m.accum,
            "micro-batch": m.micro_batch,
            "lr": m.lr,
            "code": code_label(m),
            "cuDNN": cudnn_label(m),
            "final train loss": seed_text(m, "final_train_loss"),
            "test accuracy": seed_text(m, "test_accuracy"),
            "peak memory (MiB)": fmt(peak_mib(m), 1),
        }
        if m.world_size > 1:  # the headline peak is the largest process's; each process's here
            row["processes"] = m.world_size if not m.sync_batchnorm else f"{m.world_size} (SyncBatchNorm)"
            row["peak per process (MiB)"] = " / ".join(fmt(peak_mib(m, rank), 0) for rank in mem.per_rank)
        if m.device == "cuda":
            row["memory source"] = mem.nvidia_smi_source or "-"
            row["torch max allocated (MiB)"] = fmt(mem.torch_max_allocated_mib, 1)
            row["torch max reserved (MiB)"] = fmt(mem.torch_max_reserved_mib, 1)
        row |= {
            "images/s (not comparable: sequential runs)": fmt(m.images_per_second, 1),
            "optimizer steps": m.optimizer_steps,
            "skipped steps": m.skipped_steps,
            "fit": "yes" if m.completed else "not run" if m.not_run else "did not fit",
            "why not": f"{failed.reason} (at {failed.memory_at_failure_mib} of {failed.device_total_mib} MiB)"
            if failed
            else m.not_run or "-",
        }
        rows.append(row)
    return rows


def seed_rows(results: Results) -> list[dict[str, Any]]:
    """Each variant's end point per seed, and their mean and range: what another seed would give."""
    rows = []
    for name, r in results.items():
        m = r.record
        if not m.seeds:
            continue
        rows.append(
            {
                "variant": name,
                "seeds": ", ".join(str(s.seed) for s in m.seeds),
                "final train loss per seed": ", ".join(f"{s.final_train_loss:.4f}" for s in m.seeds),
                "mean (range)": seed_text(m, "final_train_loss"),
                "test accuracy per seed": ", ".join(f"{s.test_accuracy:.4f}" for s in m.seeds),
                "accuracy mean (range)": seed_text(m, "test_accuracy"),
            }
        )
    return rows


def summary_metrics(f: Findings, speed: dict[str, Any] | None = None) -> dict[str, Any]:
    """reports/metrics.json: what `dvc exp show` compares across experiments, a few numbers per variant."""
    get = {name: r.record for name, r in f.results.items()}
    fair = speed["variants"] if speed else {}
    out: dict[str, Any] = {
        "memory_ratio": round(f.memory_ratio, 4) if f.memory_ratio is not None else None,
        "world_size": max(m.world_size for m in get.values()),
    }
    for name, m in get.items():
        out[name] = {
            "peak_mib": round(peak_mib(m), 1) if peak_mib(m) is not None else None,
            "loss": round(seed_mean(m, "final_train_loss"), 4) if m.final_train_loss is not None else None,
            "acc": round(seed_mean(m, "test_accuracy"), 4) if m.test_accuracy is not None else None,  # seeds' mean
            "img_s": fair.get(name, {}).get("median_images_per_s"),  # interleaved, never the sequential runs
        }
    return out


def gradcheck_rows(grad: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "norm": r["norm"],
            "weighting": r.get("weighting", "exact"),
            "accum": r["accum"],
            "micro-batch": r["micro_batch"],
            "relative difference": f"{r['relative_difference']:.3e}",
        }
        for r in grad["rows"]
    ]


def stage_times(
    records: dict[str, VariantRecord],
    plan: Plan | None,
    grad: dict[str, Any] | None,
    speed: dict[str, Any] | None = None,
    trace: dict[str, Any] | None = None,
) -> dict[str, tuple[float, float]]:
    """Each timed stage's process seconds and, of those, the study's own computation: the sweep's points,
    the gradient check, the timed rounds, each variant's training loop. The rest is start-up, evaluation,
    sampling, writing."""
    grad, speed, trace = grad or {}, speed or {}, trace or {}
    sweep_seconds = sum(r.get("seconds") or 0 for r in plan.points) if plan else 0
    stages = {
        "sweep": (plan.stage_seconds if plan else None, sweep_seconds),
        "gradcheck": (grad.get("stage_seconds"), grad.get("compute_seconds")),
        "speed": (speed.get("stage_seconds"), speed.get("compute_seconds")),
        "trace": (trace.get("stage_seconds"), trace.get("compute_seconds")),
        **{f"train@{n}": (m.stage_seconds, m.train_seconds) for n, m in records.items()},
    }
    return {name: (total, work or 0.0) for name, (total, work) in stages.items() if total is not None}


def time_rows(
    results: Results,
    plan: Plan | None,
    grad: dict[str, Any] | None,
    speed: dict[str, Any] | None = None,
    trace: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Where this run's time went: each timed stage's process, and the study's computation's share of it."""
    timed = stage_times({n: r.record for n, r in results.items()}, plan, grad, speed, trace)
    if not timed:
        return []
    timed["all timed stages"] = (sum(t for t, _ in timed.values()), sum(w for _, w in timed.values()))
    whole = timed["all timed stages"][0]
    return [
        {
            "stage": name,
            "seconds": fmt(total, 1),
            "share": f"{total / whole:.0%}",
            "computation (s)": fmt(done, 1),
            "the rest: start-up, evaluation, sampling, writing (s)": fmt(total - done, 1),
        }
        for name, (total, done) in timed.items()
    ]
