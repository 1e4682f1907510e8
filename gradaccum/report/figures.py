"""The report's figures (seaborn), each added to the report with a caption that says what it shows."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import matplotlib.ticker
import pandas as pd
import seaborn as sns

from gradaccum.params import Roles
from gradaccum.planner import predict_mib
from gradaccum.records import Plan
from gradaccum.report import claims
from gradaccum.report.document import Report
from gradaccum.report.findings import SpeedRatio
from gradaccum.report.results import Results, memory_label, peak_split

sns.set_theme(style="whitegrid", context="notebook")  # every figure alike


def missing_note(results: Results) -> str:
    """The variants a figure cannot show, and why, for its caption."""
    missing = {n: r.record for n, r in results.items() if not r.record.completed}
    return "".join(f" {n}: {m.why_not().split(':')[0]}." for n, m in missing.items())


def panels(names: list[str], roles: Roles) -> list[tuple[str, list[str]]]:
    """The variants grouped by what they compare, by their roles: one panel each, a few lines per panel, only
    the variants present (the levers in the variants' order); any other variant gets a panel of its own."""
    comparisons = (
        ("accumulation against its control", (roles.norm_control, roles.treatment, roles.tutorial_code)),
        (
            "BatchNorm: accumulation, the lr, the norm",
            (roles.baseline, roles.accum_control, roles.lr_control, roles.norm_control),
        ),
        (
            "the other memory levers",
            (roles.norm_control, *(n for n in names if n in roles.levers and n != roles.treatment)),
        ),
    )
    out = [(title, [n for n in group if n in names]) for title, group in comparisons]
    grouped = {n for _, group in comparisons for n in group}
    out.append(("other variants", [n for n in names if n not in grouped]))
    return [(title, group) for title, group in out if group]


def small_multiples(
    rep: Report,
    frames: dict[str, pd.DataFrame],
    roles: Roles,
    x: str,
    y: str,
    labels: tuple[str, str],
    name: str,
    caption: str,
) -> None:
    """One panel per comparison, every variant in one colour throughout, each legend under its panel."""
    names = [n for n, f in frames.items() if f is not None and len(f.dropna(subset=[y]))]
    groups = panels(names, roles)
    colors = dict(zip(list(frames), sns.color_palette("tab10", n_colors=max(len(frames), 1)), strict=False))
    fig, axes = plt.subplots(1, max(len(groups), 1), figsize=(4.2 * max(len(groups), 1), 3.8), sharey=True)
    for ax, (title, group) in zip(axes if len(groups) > 1 else [axes], groups or [("no data", [])], strict=True):
        for n, style in zip(group, ("-", "--", ":", "-."), strict=False):  # identical curves stay visible
            f = frames[n].dropna(subset=[y])
            marker = "o" if len(f) <= 12 else None  # a few points (epochs) are shown as points
            ax.plot(f[x], f[y], color=colors[n], marker=marker, linestyle=style, linewidth=1.8, label=n)
        ax.set(title=title, xlabel=labels[0], ylabel=labels[1])
        if x in ("epoch", "step"):
            ax.xaxis.get_major_locator().set_params(integer=True)
        if group:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize="small", frameon=False)
    rep.figure(name, fig, caption)


def epoch_figures(rep: Report, results: Results, roles: Roles) -> None:
    """Training loss per optimizer step and test accuracy per epoch, the variants grouped in panels."""
    note = missing_note(results)
    small_multiples(
        rep,
        {n: r.steps for n, r in results.items()},
        roles,
        "step",
        "train_loss",
        ("optimizer step", "training loss (window mean)"),
        "train_loss.png",
        f"Training loss at every optimizer step (the mean over the step's window), grouped by what the variants "
        f"compare; the first seed's run. Identical curves overlap (solid, dashed, dotted).{note}",
    )
    small_multiples(
        rep,
        {n: r.epochs for n, r in results.items()},
        roles,
        "epoch",
        "test_accuracy",
        ("epoch", "test accuracy"),
        "test_accuracy.png",
        f"Test accuracy after each epoch, grouped by what the variants compare.{note}",
    )


def memory_timeline(rep: Report, results: Results, device: str, roles: Roles) -> None:
    column = "process_mib" if device == "cuda" else "rss_mib"
    frames = {n: r.timeline for n, r in results.items() if not r.record.not_run}  # not run: no timeline
    interval = next(iter(results.values())).record.memory.interval_ms
    source = "nvidia-smi snapshots" if device == "cuda" else "RSS"
    small_multiples(
        rep,
        frames,
        roles,
        "seconds",
        column,
        ("seconds since the variant started", memory_label(device).replace("peak ", "")),
        "memory_timeline.png",
        f"Memory over time ({source}, every {interval} ms).{missing_note(results)}",
    )


def peak_memory(rep: Report, results: Results, device: str) -> None:
    """Peak per variant, stacked: PyTorch's allocations, its cache, the rest nvidia-smi saw (or host RSS)."""
    order = list(results)[::-1]  # horizontal bars, read top-down in the variants' order
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(order)
    for part, color in (
        ("allocated by PyTorch", "#4c72b0"),
        ("cached by PyTorch", "#8fb0d8"),
        ("CUDA context and the rest", "#dd8452"),
        ("host RSS", "#55a868"),
        ("did not fit (memory at failure)", "#c44e52"),
    ):
        heights = [peak_split(results[n].record).get(part, 0.0) for n in order]
        if any(heights):
            ax.barh(order, heights, left=bottoms, label=part, color=color)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set(xlabel=memory_label(device))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small", frameon=False, ncols=3)
    split = (
        ", split into PyTorch's allocations, its cache, and what else nvidia-smi saw"
        if device == "cuda"
        else " (host RSS high-water mark)"
    )
    note = missing_note(results)
    rep.figure("peak_memory.png", fig, f"Peak memory per variant{split}.{note}")


def throughput(rep: Report, speed: dict[str, Any]) -> None:
    """images/s per interleaved round (points) and their median (bar), every variant that ran."""
    rows = [
        {"variant": name, "images/s": x}
        for name, row in speed["variants"].items()
        for x in row.get("images_per_s") or []
    ]
    if not rows:
        return
    data = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.barplot(data, y="variant", x="images/s", estimator="median", errorbar=None, color="#c6d4e8", ax=ax)
    sns.stripplot(data, y="variant", x="images/s", color="#4c72b0", size=6, jitter=False, ax=ax)  # re-renders alike
    ax.set(ylabel="", xlabel="images/s (bar: median; dots: one per round)")
    skipped = [n for n, row in speed["variants"].items() if not row.get("images_per_s")]
    rep.figure(
        "throughput.png",
        fig,
        f"Training speed per variant, interleaved: {speed['rounds']} rounds of {speed['steps']} optimizer step(s)."
        + (f" Not run: {', '.join(skipped)}." if skipped else ""),
    )


def sweep(rep: Report, plan: Plan, cards: list[dict[str, Any]]) -> None:
    """The sweep's points, the fitted lines and, on a GPU, each card's usable memory."""
    points = pd.DataFrame([pt for pt in plan.points if pt["fit"]])
    points["model"] = ["checkpointing" if pt.get("checkpointing") else "plain" for pt in points.to_dict("records")]
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.scatterplot(points, x="micro_batch", y="peak_mib", hue="model", style="model", s=60, ax=ax)
    xs = sorted({0, *points["micro_batch"].tolist(), max(points["micro_batch"]) * 1.1})
    for checkpointing, label, color in ((False, "plain", "#4c72b0"), (True, "checkpointing", "#dd8452")):
        line = plan.lines[checkpointing]
        legend = f"{label} planner: points joined, {line.per_sample_mib:.3f} MiB/sample beyond"
        ax.plot(xs, [predict_mib(line, x) for x in xs], color=color, linewidth=1, label=legend)
    on_gpu = plan.device == "cuda"
    for card in cards if on_gpu else []:  # the card sizes the planner's table answers for
        ax.axhline(card["usable_mib"], color="#999", linewidth=0.8, linestyle="--")
        ax.annotate(f"{card['card_gb']} GB", (xs[1], card["usable_mib"]), fontsize=8, va="bottom", ha="right")
    ax.set(xlabel="micro-batch size", ylabel="peak memory (MiB)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small", frameon=False, ncols=2)
    rep.figure(
        "sweep.png",
        fig,
        f"Memory sweep: {plan.measure} at each micro-batch, plain and with activation checkpointing, with "
        "the planner's prediction (the measured points joined, the fitted slope beyond them)"
        + (" and each card's usable memory (dashed)." if on_gpu else " (host memory: card sizes apply to a GPU run)."),
    )


def levers(rep: Report, rows: list[dict[str, Any]], ratios: dict[str, SpeedRatio], reference: str) -> None:
    """Memory saved against speed lost per lever; the speed's range over the interleaved rounds as error bars."""
    rows = [r for r in rows if r["variant"] in ratios and "memory saved (MiB)" in r]  # the levers that ran
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    palette = sns.color_palette(n_colors=len(rows))
    for r, color in zip(rows, palette, strict=True):
        q = ratios[r["variant"]]
        x, y = 1 - float(r[f"peak memory vs {reference}"]), 1 - q.median
        ax.errorbar(
            x,
            y,
            yerr=[[q.max - q.median], [q.median - q.min]],
            fmt="o",
            ms=9,
            capsize=4,
            color=color,
            label=r["lever"].split(" (")[0],
        )
    ax.axhline(0, color="#999", linewidth=0.8)
    ax.axvline(0, color="#999", linewidth=0.8)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set(xlabel=f"peak memory saved against the {reference} control", ylabel="throughput lost (interleaved)")
    ax.legend(fontsize="small", bbox_to_anchor=(1.02, 1), loc="upper left")
    rep.figure(
        "levers.png",
        fig,
        f"Each memory lever: memory saved against speed lost, both against the {reference} control; speed from "
        "the interleaved rounds (dot: median, bar: range). Right and low is better.",
    )


def gradcheck(rep: Report, grad: dict[str, Any]) -> None:
    rows = pd.DataFrame([r for r in grad["rows"] if r["accum"] > 1])  # accum 1 is the reference itself: exactly 0
    rows["method"] = [gradcheck_method(r) for r in rows.to_dict("records")]
    rows["relative_difference"] = rows["relative_difference"].clip(lower=1e-12)  # log scale: an exact 0 shows at 1e-12
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(
        rows, x="accum", y="relative_difference", hue="method", style="method", markers=True, markersize=9, ax=ax
    )
    ax.axhline(grad["tolerance"], color="#555", linestyle=":", label=f"tolerance {grad['tolerance']:.0e}")
    ax.set(yscale="log", xlabel="accum (micro-batches per step)", ylabel="||g_accum - g_full|| / ||g_full||")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small", frameon=False, ncols=2)
    rep.figure(
        "gradcheck.png",
        fig,
        f"Accumulated against full-batch gradient {claims.gradcheck_scope(grad)} ({grad['precision']}): GroupNorm "
        "stays at float32 rounding, BatchNorm does not, and the tutorial's loss / accum is off where a "
        "micro-batch or the epoch's last window is short.",
    )


def gradcheck_method(row: dict[str, Any]) -> str:
    norm = {"group": "GroupNorm", "batch": "BatchNorm"}[row["norm"]]
    return norm + (", loss / accum (tutorial)" if row.get("weighting") == "divide" else "")
