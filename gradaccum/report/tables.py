"""The report's tables and sentences, each computed from the measured records (nothing typed in by hand)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from gradaccum.params import Params
from gradaccum.records import MemoryPeaks, VariantRecord
from gradaccum.tutorial import CLAIMS, kept_mistakes

TOLERANCE = 0.25  # a claim "holds" within 25% of what was measured


@dataclass
class VariantResult:
    """One variant's outputs: its record, its rows per epoch, its memory timeline."""

    record: VariantRecord
    epochs: pd.DataFrame
    timeline: pd.DataFrame


Results = dict[str, VariantResult]


def peak_mib(m: VariantRecord, memory: MemoryPeaks | None = None) -> float | None:
    """The headline memory figure: what nvidia-smi saw on a GPU, the RSS high-water mark on the CPU.

    `memory`: one process's peaks instead of the record's (the largest process's).
    """
    if m.did_not_fit:
        return m.did_not_fit.memory_at_failure_mib
    if m.not_run:
        return None
    mem = memory or m.memory
    if m.device == "cuda":
        return mem.nvidia_smi_peak_mib or mem.torch_max_reserved_mib
    return mem.rss_peak_mib


def memory_label(device: str) -> str:
    return "peak GPU memory, nvidia-smi (MiB)" if device == "cuda" else "peak host memory, RSS (MiB)"


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fitted(results: Results) -> dict[str, VariantRecord]:
    """The records of the variants that ran to the end."""
    return {name: r.record for name, r in results.items() if r.record.fit}


def code_label(m: VariantRecord) -> str:
    """Which of the tutorial's three mistakes a variant ran with; "exact" when none."""
    kept = kept_mistakes(m.model_dump())
    return "tutorial: " + ", ".join(c.label for c in kept) if kept else "exact"


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
            "final train loss": fmt(m.final_train_loss),
            "test accuracy": fmt(m.test_accuracy),
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
            "images/s": fmt(m.images_per_second, 1),
            "optimizer steps": m.optimizer_steps,
            "skipped steps": m.skipped_steps,
            "fit": "yes" if m.fit else "not run" if m.not_run else "did not fit",
            "why not": f"{failed.reason} (at {failed.memory_at_failure_mib} of {failed.device_total_mib} MiB)"
            if failed
            else m.not_run or "-",
        }
        rows.append(row)
    return rows


def verdict(measured_over_claimed: float | None) -> str:
    if measured_over_claimed is None:
        return "not measured"
    if abs(measured_over_claimed - 1) <= TOLERANCE:
        return "holds"
    return f"does not hold: measured {measured_over_claimed:.2f}x the claim"


def claim(text: str, measured: str, over: float | None, result: str | None = None) -> dict[str, str]:
    return {
        "tutorial's claim": text,
        "measured": measured,
        "measured / claimed": fmt(over, 2),
        "verdict": result or verdict(over),
    }


def absolute_claims(results: Results, study_on_gpu: bool) -> list[dict[str, str]]:
    """The tutorial's two memory figures; comparable only when the study itself ran on a GPU."""
    rows = []
    for name, text, gb in (
        ("baseline", "about 30 GB at batch 32768 (BatchNorm)", CLAIMS["baseline_gb"]),
        ("accumulation", "about 13.7 GB with 8192 x 4 (GroupNorm)", CLAIMS["accumulation_gb"]),
    ):
        m = results[name].record if name in results else None
        if m is None:
            rows.append(claim(text, "-", None, f"not run: no {name} variant"))
        elif m.not_run:
            rows.append(claim(text, "-", None, f"not run: {m.not_run}"))
        elif not m.fit:
            failed = m.did_not_fit
            at = f"{failed.memory_at_failure_mib} of {failed.device_total_mib} MiB"
            rows.append(claim(text, f"did not fit ({at})", None, "did not fit on this machine"))
        elif study_on_gpu:
            measured = peak_mib(m) / 1024
            rows.append(claim(text, f"{measured:.1f} GB", measured / gb))
        else:
            measured_text = f"{peak_mib(m):.0f} MiB host RSS (CPU scale)"
            rows.append(claim(text, measured_text, None, "scale differs: compare the ratio below"))
    return rows


def ratio_claims(results: Results) -> list[dict[str, str]]:
    """Accumulation's share of the baseline's memory, and the loss, as the tutorial compared them."""
    claimed = CLAIMS["accumulation_gb"] / CLAIMS["baseline_gb"]
    text = f"accumulation needs {claimed:.0%} of the baseline's memory (13.7 / 30)"
    done = fitted(results)
    if "accumulation" not in done or "baseline" not in done:
        return [claim(text, "-", None, "not measured: the baseline or the accumulation variant did not run or fit")]
    acc, base = done["accumulation"], done["baseline"]
    a, b = peak_mib(acc), peak_mib(base)
    change = acc.final_train_loss / base.final_train_loss - 1
    loss_verdict = (
        "holds (within 10%)"
        if abs(change) <= 0.10
        else f"the loss is {'higher' if change > 0 else 'lower'} by {abs(change):.0%}"
    )
    return [
        claim(text, f"{a / b:.2f} ({a:.0f} / {b:.0f} MiB)", a / b / claimed),
        claim(
            "the loss is barely affected",
            f"final train loss {acc.final_train_loss:.4f} vs {base.final_train_loss:.4f}; test accuracy "
            f"{acc.test_accuracy:.4f} vs {base.test_accuracy:.4f}",
            acc.final_train_loss / base.final_train_loss,
            loss_verdict + "; but norm and lr changed too: the two control rows below separate them",
        ),
    ]


def control_claims(results: Results) -> list[dict[str, str]]:
    """The controls that separate what the tutorial changed at once: accumulation alone, the norm alone, its code."""
    done, rows = fitted(results), []
    acc, gn, base, tut = (done.get(n) for n in ("accumulation", "groupnorm", "baseline", "tutorial_accumulation"))
    if gn and acc:
        diff = abs(acc.final_train_loss - gn.final_train_loss) / gn.final_train_loss
        rows.append(
            claim(
                "(this study) accumulation alone changes nothing: same norm, same lr, accum 1",
                f"final train loss {acc.final_train_loss:.4f} vs {gn.final_train_loss:.4f} ({diff:.1e} relative)",
                None,
                "holds" if diff <= 0.01 else f"differs by {diff:.1%}",
            )
        )
    if gn and base:
        change = gn.final_train_loss / base.final_train_loss - 1
        rows.append(
            claim(
                "(this study) the norm swap alone: GroupNorm(1) against BatchNorm, both accum 1",
                f"final train loss {gn.final_train_loss:.4f} vs {base.final_train_loss:.4f}; test accuracy "
                f"{gn.test_accuracy:.4f} vs {base.test_accuracy:.4f}; peak {peak_mib(gn):.0f} vs "
                f"{peak_mib(base):.0f} MiB",
                None,
                "no change (within 10%)"
                if abs(change) <= 0.10
                else f"the norm (and lr) change the loss by {abs(change):.0%}; memory stays "
                f"{peak_mib(gn) / peak_mib(base):.2f}x",
            )
        )
    if tut and acc:
        change = tut.final_train_loss / acc.final_train_loss - 1
        rows.append(
            claim(
                "(this study) the tutorial's accumulation code as written (loss / accum, no step at epoch end, "
                "plain GroupNorm swap) against the corrected code",
                f"accum {tut.accum}: final train loss {tut.final_train_loss:.4f} vs "
                f"{acc.final_train_loss:.4f}; test accuracy {tut.test_accuracy:.4f} vs "
                f"{acc.test_accuracy:.4f}; {tut.optimizer_steps} vs {acc.optimizer_steps} optimizer steps",
                None,
                f"the corrections change the final loss by {abs(change):.1%}",
            )
        )
    return rows


def batchnorm_claim(results: Results, grad: dict[str, Any]) -> dict[str, str]:
    """BatchNorm must go: the gradient check says whether accumulation with it is the large-batch gradient."""
    done = fitted(results)
    acc_bn, base = done.get("accum_batchnorm"), done.get("baseline")
    also = ""
    if acc_bn and base:
        also = (
            f"; accum_batchnorm ended at loss {acc_bn.final_train_loss:.4f} (test accuracy "
            f"{acc_bn.test_accuracy:.4f}) against the baseline's {base.final_train_loss:.4f}"
        )
    return claim(
        "BatchNorm must go for accumulation (swapped for GroupNorm)",
        f"accumulated gradient vs full batch: BatchNorm differs by at least {grad['batchnorm_min']:.2f}, "
        f"GroupNorm by at most {grad['groupnorm_max']:.1e} (relative){also}",
        None,
        "holds: with BatchNorm, accumulation is not the large-batch gradient (it still trains)"
        if grad["batchnorm_differs"] and grad["groupnorm_equal"]
        else "not shown by this run's gradient check",
    )


def claims_table(results: Results, study_on_gpu: bool, grad: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """The tutorial's claims, then the controls that separate what it changed at once (norm, accumulation)."""
    rows = absolute_claims(results, study_on_gpu) + ratio_claims(results) + control_claims(results)
    return rows + ([batchnorm_claim(results, grad)] if grad else [])


def summary_metrics(results: Results) -> dict[str, Any]:
    """reports/metrics.json: what `dvc exp show` compares across experiments, a few numbers per variant."""
    get = {name: r.record for name, r in results.items()}
    done = fitted(results)
    both = "baseline" in done and "accumulation" in done
    out: dict[str, Any] = {
        "memory_ratio": round(peak_mib(get["accumulation"]) / peak_mib(get["baseline"]), 4) if both else None,
        "world_size": max(m.world_size for m in get.values()),
    }
    for name, m in get.items():
        out[name] = {
            "peak_mib": round(peak_mib(m), 1) if peak_mib(m) is not None else None,
            "loss": round(m.final_train_loss, 4) if m.final_train_loss is not None else None,
            "acc": m.test_accuracy,
            "img_s": round(m.images_per_second, 1) if m.images_per_second is not None else None,
        }
    return out


LEVERS = (  # (variant, lever): the same work as the groupnorm control, with one memory lever or two
    ("groupnorm_precision", "precision"),
    ("accumulation", "accumulation"),
    ("checkpointing", "activation checkpointing"),
    ("accum_checkpointing", "accumulation + checkpointing"),
)


def lever_table(results: Results) -> list[dict[str, Any]]:
    """Each memory lever against the groupnorm control (same norm, lr and batch, none of the levers)."""
    done = fitted(results)
    ref = done.get("groupnorm")
    if not ref:
        return []
    rows = []
    for name, lever in LEVERS:
        m = done.get(name)
        if m is None:
            if name in results:  # not run, or did not fit: say so in the lever's row
                rows.append(
                    {"lever": lever, "variant": name, "peak memory vs groupnorm": results[name].record.why_not()}
                )
            continue
        rows.append(
            {
                "lever": lever + (f" ({m.amp} instead of {ref.amp})" if name == "groupnorm_precision" else ""),
                "variant": name,
                "peak memory vs groupnorm": fmt(peak_mib(m) / peak_mib(ref), 2),
                "memory saved (MiB)": fmt(peak_mib(ref) - peak_mib(m), 0),
                "throughput vs groupnorm": fmt(m.images_per_second / ref.images_per_second, 2),
                "final train loss": fmt(m.final_train_loss),
                "test accuracy": fmt(m.test_accuracy),
            }
        )
    return rows


def steps_note(p: Params, scale_name: str) -> str:
    """How many optimizer steps the tutorial's study and this run make: what a loss comparison can mean."""
    study, ran = p.scales.study, p.scale_settings(scale_name)
    per_epoch = math.ceil(study.train_samples / study.batch)
    ran_steps = math.ceil(ran.train_samples / ran.batch) * ran.epochs
    return (
        f"The tutorial's study makes only {per_epoch * study.epochs} optimizer steps ({study.train_samples:,} "
        f"images / batch {study.batch:,} = {per_epoch} per epoch, {study.epochs} "
        f"epochs), so its loss comparison is between two barely trained models: it cannot tell whether "
        f"accumulation affects the converged result. This run made {ran_steps} steps per variant."
    )


def summary(results: Results, grad: dict[str, Any] | None, device: str) -> str:
    """The findings in a paragraph, every number from the records."""
    get, done = {name: r.record for name, r in results.items()}, fitted(results)
    base, acc, gn = done.get("baseline"), done.get("accumulation"), done.get("groupnorm")
    what = "GPU memory (nvidia-smi)" if device == "cuda" else "host memory (RSS)"
    parts = []
    if "baseline" in get and not base:
        parts.append(f"The baseline (batch {get['baseline'].batch}) {get['baseline'].why_not()}.")
    if acc:
        parts.append(
            f"Accumulation ({acc.accum} x {acc.micro_batch}) peaked at {peak_mib(acc):.0f} MiB of {what} "
            f"and trained at {acc.images_per_second:.0f} images/s."
        )
    if base and acc:
        parts.append(
            f"That is {peak_mib(acc) / peak_mib(base):.0%} of the baseline's {peak_mib(base):.0f} MiB at batch "
            f"{base.batch}, at {acc.images_per_second / base.images_per_second:.2f}x its speed "
            f"({base.images_per_second:.0f} images/s). Final training loss: {acc.final_train_loss:.4f} with "
            f"accumulation, {base.final_train_loss:.4f} for the baseline; test accuracy "
            f"{acc.test_accuracy:.4f} against {base.test_accuracy:.4f}."
        )
    if gn and acc and peak_mib(gn):
        parts.append(
            f"The GroupNorm control at full batch (accum 1) peaked at {peak_mib(gn):.0f} MiB, so the saving "
            f"comes from the {'smaller' if peak_mib(acc) < peak_mib(gn) else 'same-size'} micro-batch, "
            f"not from the norm; its final loss was {gn.final_train_loss:.4f} against "
            f"{acc.final_train_loss:.4f} with accumulation."
        )
    if grad:
        parts.append(
            f"On one fixed batch of {grad['batch']}, the accumulated GroupNorm gradient differed from the "
            f"full-batch gradient by at most {grad['groupnorm_max']:.1e} (relative), "
            f"{'within' if grad['groupnorm_equal'] else 'outside'} float32 rounding "
            f"({grad['tolerance']:.0e}); with BatchNorm it differed by at least {grad['batchnorm_min']:.2f}."
        )
    return " ".join(parts)


def options_text(options: list[dict[str, Any]] | None) -> str:
    """The planner's options for one card: lever, accum, predicted peak and the sweep's measured speed."""
    if options is None:
        return "-"
    if not options:
        return "none fits"
    return "; ".join(
        f"{'checkpointing, ' if o['lever'] == 'checkpointing' else ''}accum {o['accum']} (micro-batch "
        f"{o['micro_batch']}): {o['predicted_peak_mib']} MiB, {o['images_per_s']:.0f} images/s"
        for o in options
    )


def card_rows(cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "card (GB)": c["card_gb"],
            "usable (MiB)": c["usable_mib"],
            "largest micro-batch": c["largest_micro_batch"],
            "smallest accum": fmt(c["smallest_accum"]),
            "micro-batch at that accum": fmt(c["micro_batch"]),
            "predicted peak (MiB)": fmt(c["predicted_peak_mib"]),
            "options that fit, fastest first": options_text(c.get("options")),
        }
        for c in cards
    ]


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


def peak_split(m: VariantRecord) -> dict[str, float]:
    """The peak in parts: PyTorch's allocations, its cache, and what else nvidia-smi saw (or host RSS)."""
    if m.did_not_fit:
        return {"did not fit (memory at failure)": float(m.did_not_fit.memory_at_failure_mib or 0)}
    if m.not_run:
        return {}
    mem = m.memory
    if m.device != "cuda":
        return {"host RSS": mem.rss_peak_mib}
    allocated, reserved = mem.torch_max_allocated_mib, mem.torch_max_reserved_mib
    smi = mem.nvidia_smi_peak_mib or reserved
    return {
        "allocated by PyTorch": allocated,
        "cached by PyTorch": reserved - allocated,
        "CUDA context and the rest": max(smi - reserved, 0.0),
    }


def stage_times(
    records: dict[str, VariantRecord], plan: dict[str, Any] | None, grad: dict[str, Any] | None
) -> dict[str, tuple[float, float]]:
    """Each timed stage's process seconds and, of those, the study's own computation: the sweep's points,
    the gradient check, each variant's training loop. The rest is start-up, evaluation, sampling, writing."""
    plan, grad = plan or {}, grad or {}
    stages = {
        "sweep": (plan.get("stage_seconds"), sum(r.get("seconds") or 0 for r in plan.get("points", []))),
        "gradcheck": (grad.get("stage_seconds"), grad.get("compute_seconds")),
        **{f"train@{n}": (m.stage_seconds, m.train_seconds) for n, m in records.items()},
    }
    return {name: (total, work or 0.0) for name, (total, work) in stages.items() if total is not None}


def time_rows(results: Results, plan: dict[str, Any] | None, grad: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Where this run's time went: each timed stage's process, and the study's computation's share of it."""
    timed = stage_times({n: r.record for n, r in results.items()}, plan, grad)
    if not timed:
        return []
    whole, work = sum(t for t, _ in timed.values()), sum(w for _, w in timed.values())
    rows = [
        {
            "stage": name,
            "seconds": fmt(total, 1),
            "share": f"{total / whole:.0%}",
            "computation (s)": fmt(done, 1),
            "the rest: start-up, evaluation, sampling, writing (s)": fmt(total - done, 1),
        }
        for name, (total, done) in timed.items()
    ]
    rows.append(
        {
            "stage": "all timed stages",
            "seconds": fmt(whole, 1),
            "share": "100%",
            "computation (s)": fmt(work, 1),
            "the rest: start-up, evaluation, sampling, writing (s)": fmt(whole - work, 1),
        }
    )
    return rows
