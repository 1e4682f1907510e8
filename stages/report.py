"""Stage `report`: what accumulation saved, what it cost, and whether it is still the same training.

Reads every variant's outputs and writes reports/report.html (one file, figures embedded, opens
with no network) and reports/report.md (figures as PNGs in reports/figures/). Every sentence and
verdict is computed from the measured numbers.
"""

from __future__ import annotations

import base64
import html
import math
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import yaml  # noqa: E402

from stages import params  # noqa: E402
from stages.outputs import atomic_path, read_json, write_json, write_text  # noqa: E402
from stages.paths import GRADCHECK, HARDWARE, PROVENANCE, SWEEP_PLAN, variant_dir  # noqa: E402
from stages.planner import predict_mib  # noqa: E402

REPORT_MD = Path("reports/report.md")
REPORT_HTML = Path("reports/report.html")
FIGURES = Path("reports/figures")
SUMMARY = Path("reports/metrics.json")  # the metrics dvc exp show compares
TUTORIAL = {"baseline_gb": 30.0, "accumulation_gb": 13.7, "batch": 32768, "micro": 8192, "accum": 4}
TOLERANCE = 0.25  # a claim "holds" within 25% of what was measured


@dataclass
class Report:
    """Blocks rendered twice: Markdown for a repository viewer, HTML for a browser."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)
    figures: dict[str, bytes] = field(default_factory=dict)
    stamp: str = ""  # printed on every figure: the scale, when it is not the tutorial's study

    def banner(self, text: str) -> None:
        self.blocks.append(("banner", text))

    def pre(self, text: str) -> None:
        self.blocks.append(("pre", text))

    def heading(self, text: str) -> None:
        self.blocks.append(("h2", text))

    def text(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, rows: list[dict[str, Any]]) -> None:
        self.blocks.append(("table", rows))

    def figure(self, name: str, fig: plt.Figure, caption: str) -> None:
        if self.stamp:
            fig.suptitle(self.stamp, color="#c44e52", fontsize=10, fontweight="bold")
        with atomic_path(FIGURES / name) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        self.figures[name] = (FIGURES / name).read_bytes()
        self.blocks.append(("figure", (name, caption)))

    def markdown(self, title: str) -> str:
        out = [f"# {title}\n"]
        for kind, value in self.blocks:
            if kind == "h2":
                out.append(f"## {value}\n")
            elif kind == "p":
                out.append(f"{value}\n")
            elif kind == "banner":
                out.append(f"> **{value}**\n")
            elif kind == "pre":
                out.append(f"```text\n{value.rstrip()}\n```\n")
            elif kind == "table" and value:
                cols = list(value[0])
                out.append("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
                out += ["| " + " | ".join(str(r[c]).replace("|", "/") for c in cols) + " |" for r in value]
                out.append("")
            elif kind == "figure":
                out.append(f"![{value[1]}](figures/{value[0]})\n\n*{value[1]}*\n")
        return "\n".join(out) + "\n"

    def html(self, title: str) -> str:
        body = [f"<h1>{html.escape(title)}</h1>"]
        for kind, value in self.blocks:
            if kind == "h2":
                body.append(f"<h2>{html.escape(value)}</h2>")
            elif kind == "p":
                body.append(f"<p>{html.escape(value)}</p>")
            elif kind == "banner":
                body.append(f'<p class="banner">{html.escape(value)}</p>')
            elif kind == "pre":
                body.append(f"<pre>{html.escape(value)}</pre>")
            elif kind == "table" and value:
                head = "".join(f"<th>{html.escape(str(c))}</th>" for c in value[0])
                rows = "".join(
                    "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in value
                )
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
            elif kind == "figure":
                data = base64.b64encode(self.figures[value[0]]).decode()
                body.append(
                    f'<figure><img alt="{html.escape(value[1])}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{html.escape(value[1])}</figcaption></figure>"
                )
        style = (
            "body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
            "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3}"
            "img{max-width:100%}figcaption{font-style:italic;color:#555}"
            "pre{background:#f6f6f6;padding:6px;font-size:12px;overflow-x:auto}"
            ".banner{background:#fde8e8;border:2px solid #c44e52;padding:8px;font-weight:bold}"
        )
        return (
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
        )


def load_variants(p: dict[str, Any]) -> dict[str, dict[str, Any]]:
    results = {}
    for name in p["variants"]:
        d = variant_dir(name)
        if not (d / "metrics.json").exists():
            continue
        results[name] = {
            "metrics": read_json(d / "metrics.json"),
            "epochs": pd.read_csv(d / "epochs.tsv", sep="\t"),
            "memory": pd.read_csv(d / "memory.csv"),
        }
    if not results:
        raise FileNotFoundError("no variant has a metrics.json under reports/variants/: run the train stages first")
    return results


def peak_mib(m: dict[str, Any]) -> float | None:
    """The headline memory figure: what nvidia-smi saw on a GPU, the RSS high-water mark on the CPU."""
    if not m["fit"]:
        return m["did_not_fit"]["memory_at_failure_mib"]
    mem = m["memory"]
    if m["device"] == "cuda":
        return mem.get("nvidia_smi_peak_mib") or mem.get("torch_max_reserved_mib")
    return mem["rss_peak_mib"]


def memory_label(device: str) -> str:
    return "peak GPU memory, nvidia-smi (MiB)" if device == "cuda" else "peak host memory, RSS (MiB)"


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def variants_table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant; on a GPU, nvidia-smi's peak beside PyTorch's allocated and reserved peaks."""
    rows = []
    for name, r in results.items():
        m = r["metrics"]
        mem, failed = m["memory"], m["did_not_fit"]
        row = {
            "variant": name,
            "norm": m["norm"],
            "accum": m["accum"],
            "micro-batch": m["micro_batch"],
            "lr": m["lr"],
            "code": code_label(m),
            "final train loss": fmt(m["final_train_loss"]),
            "test accuracy": fmt(m["test_accuracy"]),
            "peak memory (MiB)": fmt(peak_mib(m), 1),
        }
        if m.get("world_size", 1) > 1:  # the headline peak is the largest process's; each process's here
            row["processes"] = m["world_size"] if not m.get("sync_batchnorm") else f"{m['world_size']} (SyncBatchNorm)"
            row["peak per process (MiB)"] = " / ".join(fmt(peak_mib(m | {"memory": r}), 0) for r in mem["per_rank"])
        if m["device"] == "cuda":
            row["memory source"] = mem.get("nvidia_smi_source") or "-"
            row["torch max allocated (MiB)"] = fmt(mem.get("torch_max_allocated_mib"), 1)
            row["torch max reserved (MiB)"] = fmt(mem.get("torch_max_reserved_mib"), 1)
        row |= {
            "images/s": fmt(m["images_per_second"], 1),
            "optimizer steps": m["optimizer_steps"],
            "skipped steps": m["skipped_steps"],
            "fit": "yes" if m["fit"] else "did not fit",
            "why not": f"{failed['reason']} (at {failed['memory_at_failure_mib']} of {failed['device_total_mib']} MiB)"
            if failed
            else "-",
        }
        rows.append(row)
    return rows


def code_label(m: dict[str, Any]) -> str:
    """Which of the tutorial's three mistakes a variant ran with; "exact" when none."""
    kept = [
        text
        for key, corrected, text in (
            ("weighting", "exact", "loss / accum"),
            ("epoch_end_step", True, "no step at epoch end"),
            ("swap", "keep_act", "plain GroupNorm swap" if m["norm"] == "group" else None),
        )
        if m.get(key, corrected) != corrected and text
    ]
    return "tutorial: " + ", ".join(kept) if kept else "exact"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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


def claims_table(
    results: dict[str, dict[str, Any]], study_on_gpu: bool, grad: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The tutorial's claims, then the controls that separate what it changed at once (norm, accumulation)."""
    get = {name: r["metrics"] for name, r in results.items()}
    base, acc, gn = get.get("baseline"), get.get("accumulation"), get.get("groupnorm")
    acc_bn = get.get("accum_batchnorm")
    fitted = {name: m for name, m in (("baseline", base), ("accumulation", acc)) if m and m["fit"]}
    rows = []
    for name, text, gb in (
        ("baseline", "about 30 GB at batch 32768 (BatchNorm)", TUTORIAL["baseline_gb"]),
        ("accumulation", "about 13.7 GB with 8192 x 4 (GroupNorm)", TUTORIAL["accumulation_gb"]),
    ):
        m = get.get(name)
        if m is None:
            rows.append(claim(text, "-", None, f"not run: no {name} variant"))
        elif not m["fit"]:
            failed = m["did_not_fit"]
            rows.append(
                claim(
                    text,
                    f"did not fit ({failed['memory_at_failure_mib']} of {failed['device_total_mib']} MiB)",
                    None,
                    "did not fit on this machine",
                )
            )
        elif study_on_gpu:
            measured = peak_mib(m) / 1024
            rows.append(claim(text, f"{measured:.1f} GB", measured / gb))
        else:
            rows.append(
                claim(
                    text, f"{peak_mib(m):.0f} MiB host RSS (CPU scale)", None, "scale differs: compare the ratio below"
                )
            )
    claimed = TUTORIAL["accumulation_gb"] / TUTORIAL["baseline_gb"]
    text = f"accumulation needs {claimed:.0%} of the baseline's memory (13.7 / 30)"
    if len(fitted) == 2:
        a, b = peak_mib(fitted["accumulation"]), peak_mib(fitted["baseline"])
        rows.append(claim(text, f"{a / b:.2f} ({a:.0f} / {b:.0f} MiB)", a / b / claimed))
        a_loss, b_loss = fitted["accumulation"]["final_train_loss"], fitted["baseline"]["final_train_loss"]
        change = a_loss / b_loss - 1
        rows.append(
            claim(
                "the loss is barely affected",
                f"final train loss {a_loss:.4f} vs {b_loss:.4f}; test accuracy "
                f"{fitted['accumulation']['test_accuracy']:.4f} vs {fitted['baseline']['test_accuracy']:.4f}",
                a_loss / b_loss,
                (
                    "holds (within 10%)"
                    if abs(change) <= 0.10
                    else f"the loss is {'higher' if change > 0 else 'lower'} by {abs(change):.0%}"
                )
                + "; but norm and lr changed too: the two control rows below separate them",
            )
        )
    else:
        rows.append(claim(text, "-", None, "not measured: the baseline or the accumulation variant did not run or fit"))
    if gn and acc and gn["fit"] and acc["fit"]:
        diff = abs(acc["final_train_loss"] - gn["final_train_loss"]) / gn["final_train_loss"]
        rows.append(
            claim(
                "(this study) accumulation alone changes nothing: same norm, same lr, accum 1",
                f"final train loss {acc['final_train_loss']:.4f} vs {gn['final_train_loss']:.4f} ({diff:.1e} relative)",
                None,
                "holds" if diff <= 0.01 else f"differs by {diff:.1%}",
            )
        )
    if gn and base and gn["fit"] and base["fit"]:
        change = gn["final_train_loss"] / base["final_train_loss"] - 1
        rows.append(
            claim(
                "(this study) the norm swap alone: GroupNorm(1) against BatchNorm, both accum 1",
                f"final train loss {gn['final_train_loss']:.4f} vs {base['final_train_loss']:.4f}; test accuracy "
                f"{gn['test_accuracy']:.4f} vs {base['test_accuracy']:.4f}; peak {peak_mib(gn):.0f} vs "
                f"{peak_mib(base):.0f} MiB",
                None,
                "no change (within 10%)"
                if abs(change) <= 0.10
                else f"the norm (and lr) change the loss by {abs(change):.0%}; memory stays "
                f"{peak_mib(gn) / peak_mib(base):.2f}x",
            )
        )
    tut = get.get("tutorial_accumulation")
    if tut and acc and tut["fit"] and acc["fit"]:
        change = tut["final_train_loss"] / acc["final_train_loss"] - 1
        rows.append(
            claim(
                "(this study) the tutorial's accumulation code as written (loss / accum, no step at epoch end, "
                "plain GroupNorm swap) against the corrected code",
                f"accum {tut['accum']}: final train loss {tut['final_train_loss']:.4f} vs "
                f"{acc['final_train_loss']:.4f}; test accuracy {tut['test_accuracy']:.4f} vs "
                f"{acc['test_accuracy']:.4f}; {tut['optimizer_steps']} vs {acc['optimizer_steps']} optimizer steps",
                None,
                f"the corrections change the final loss by {abs(change):.1%}",
            )
        )
    if grad:
        also = ""
        if acc_bn and base and acc_bn["fit"] and base["fit"]:
            also = (
                f"; accum_batchnorm ended at loss {acc_bn['final_train_loss']:.4f} (test accuracy "
                f"{acc_bn['test_accuracy']:.4f}) against the baseline's {base['final_train_loss']:.4f}"
            )
        rows.append(
            claim(
                "BatchNorm must go for accumulation (swapped for GroupNorm)",
                f"accumulated gradient vs full batch: BatchNorm differs by at least {grad['batchnorm_min']:.2f}, "
                f"GroupNorm by at most {grad['groupnorm_max']:.1e} (relative){also}",
                None,
                "holds: with BatchNorm, accumulation is not the large-batch gradient (it still trains)"
                if grad["batchnorm_differs"] and grad["groupnorm_equal"]
                else "not shown by this run's gradient check",
            )
        )
    return rows


def summary_metrics(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """reports/metrics.json: what `dvc exp show` compares across experiments, a few numbers per variant."""
    get = {name: r["metrics"] for name, r in results.items()}
    base, acc = get.get("baseline"), get.get("accumulation")
    both = base and acc and base["fit"] and acc["fit"]
    out: dict[str, Any] = {
        "memory_ratio": round(peak_mib(acc) / peak_mib(base), 4) if both else None,
        "world_size": max(m.get("world_size", 1) for m in get.values()),
    }
    for name, m in get.items():
        out[name] = {
            "peak_mib": round(peak_mib(m), 1) if peak_mib(m) is not None else None,
            "loss": round(m["final_train_loss"], 4) if m["final_train_loss"] is not None else None,
            "acc": m["test_accuracy"],
            "img_s": round(m["images_per_second"], 1) if m["images_per_second"] is not None else None,
        }
    return out


LEVERS = (  # (variant, lever): the same work as the groupnorm control, with one memory lever or two
    ("groupnorm_precision", "precision"),
    ("accumulation", "accumulation"),
    ("checkpointing", "activation checkpointing"),
    ("accum_checkpointing", "accumulation + checkpointing"),
)


def lever_table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each memory lever against the groupnorm control (same norm, lr and batch, none of the levers)."""
    get = {name: r["metrics"] for name, r in results.items()}
    ref = get.get("groupnorm")
    if not ref or not ref["fit"]:
        return []
    rows = []
    for name, lever in LEVERS:
        m = get.get(name)
        if m is None or not m["fit"]:
            continue
        rows.append(
            {
                "lever": lever + (f" ({m['amp']} instead of {ref['amp']})" if name == "groupnorm_precision" else ""),
                "variant": name,
                "peak memory vs groupnorm": fmt(peak_mib(m) / peak_mib(ref), 2),
                "memory saved (MiB)": fmt(peak_mib(ref) - peak_mib(m), 0),
                "throughput vs groupnorm": fmt(m["images_per_second"] / ref["images_per_second"], 2),
                "final train loss": fmt(m["final_train_loss"]),
                "test accuracy": fmt(m["test_accuracy"]),
            }
        )
    return rows


def lever_figure(rep: Report, rows: list[dict[str, Any]]) -> None:
    points = pd.DataFrame(
        {
            "lever": [r["lever"].split(" (")[0] for r in rows],
            "memory saved": [1 - float(r["peak memory vs groupnorm"]) for r in rows],
            "speed lost": [1 - float(r["throughput vs groupnorm"]) for r in rows],
        }
    )
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.scatterplot(points, x="memory saved", y="speed lost", hue="lever", style="lever", s=120, ax=ax)
    ax.axhline(0, color="#999", linewidth=0.8)
    ax.axvline(0, color="#999", linewidth=0.8)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set(xlabel="peak memory saved against the groupnorm control", ylabel="throughput lost")
    ax.legend(fontsize="small")
    rep.figure(
        "levers.png",
        fig,
        "Each memory lever: memory saved against speed lost, both against the groupnorm control in the same run "
        "(right and low is better).",
    )


def steps_note(p: dict[str, Any], scale_name: str) -> str:
    """How many optimizer steps the tutorial's study and this run make: what a loss comparison can mean."""
    study, ran = p["scales"]["study"], p["scales"][scale_name]
    study_steps = math.ceil(study["train_samples"] / study["batch"]) * study["epochs"]
    ran_steps = math.ceil(ran["train_samples"] / ran["batch"]) * ran["epochs"]
    return (
        f"The tutorial's study makes only {study_steps} optimizer steps ({study['train_samples']:,} images / batch "
        f"{study['batch']:,} = {math.ceil(study['train_samples'] / study['batch'])} per epoch, {study['epochs']} "
        f"epochs), so its loss comparison is between two barely trained models: it cannot tell whether "
        f"accumulation affects the converged result. This run made {ran_steps} steps per variant."
    )


def summary(results: dict[str, dict[str, Any]], grad: dict[str, Any] | None, device: str) -> str:
    get = {name: r["metrics"] for name, r in results.items()}
    parts = []
    base, acc, gn = get.get("baseline"), get.get("accumulation"), get.get("groupnorm")
    what = "GPU memory (nvidia-smi)" if device == "cuda" else "host memory (RSS)"
    if base and not base["fit"]:
        parts.append(f"The baseline (batch {base['batch']}) did not fit: {base['did_not_fit']['reason']}.")
    if acc and acc["fit"]:
        parts.append(
            f"Accumulation ({acc['accum']} x {acc['micro_batch']}) peaked at {peak_mib(acc):.0f} MiB of {what} "
            f"and trained at {acc['images_per_second']:.0f} images/s."
        )
    if base and acc and base["fit"] and acc["fit"]:
        parts.append(
            f"That is {peak_mib(acc) / peak_mib(base):.0%} of the baseline's {peak_mib(base):.0f} MiB at batch "
            f"{base['batch']}, at {acc['images_per_second'] / base['images_per_second']:.2f}x its speed "
            f"({base['images_per_second']:.0f} images/s). Final training loss: {acc['final_train_loss']:.4f} with "
            f"accumulation, {base['final_train_loss']:.4f} for the baseline; test accuracy "
            f"{acc['test_accuracy']:.4f} against {base['test_accuracy']:.4f}."
        )
    if gn and acc and gn["fit"] and acc["fit"] and peak_mib(gn):
        parts.append(
            f"The GroupNorm control at full batch (accum 1) peaked at {peak_mib(gn):.0f} MiB, so the saving "
            f"comes from the {'smaller' if peak_mib(acc) < peak_mib(gn) else 'same-size'} micro-batch, "
            f"not from the norm; its final loss was {gn['final_train_loss']:.4f} against "
            f"{acc['final_train_loss']:.4f} with accumulation."
        )
    if grad:
        parts.append(
            f"On one fixed batch of {grad['batch']}, the accumulated GroupNorm gradient differed from the "
            f"full-batch gradient by at most {grad['groupnorm_max']:.1e} (relative), "
            f"{'within' if grad['groupnorm_equal'] else 'outside'} float32 rounding "
            f"({grad['tolerance']:.0e}); with BatchNorm it differed by at least {grad['batchnorm_min']:.2f}."
        )
    return " ".join(parts)


def figures(rep: Report, results: dict[str, dict[str, Any]], plan: dict[str, Any] | None, device: str) -> None:
    order = list(results)
    epochs = pd.concat(
        [r["epochs"].assign(variant=n) for n, r in results.items() if len(r["epochs"])]
        or [pd.DataFrame(columns=["epoch", "train_loss", "test_accuracy", "variant"])]
    )
    missing = [n for n, r in results.items() if not r["metrics"]["fit"]]
    note = f" Did not fit: {', '.join(missing)}." if missing else ""
    for column, label, name in (
        ("train_loss", "mean training loss", "train_loss.png"),
        ("test_accuracy", "test accuracy", "test_accuracy.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        if len(epochs):
            sns.lineplot(
                epochs,
                x="epoch",
                y=column,
                hue="variant",
                hue_order=order,
                style="variant",
                style_order=order,
                markers=True,
                dashes=True,
                linewidth=2,
                markersize=8,
                ax=ax,
            )
        ax.set(xlabel="epoch", ylabel=label)
        ax.xaxis.get_major_locator().set_params(integer=True)
        rep.figure(name, fig, f"{label.capitalize()} per epoch, every variant.{note}")

    column = "process_mib" if device == "cuda" else "rss_mib"
    timeline = pd.concat([r["memory"].assign(variant=n) for n, r in results.items()])
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(timeline.dropna(subset=[column]), x="seconds", y=column, hue="variant", hue_order=order, ax=ax)
    ax.set(xlabel="seconds since the variant started", ylabel=memory_label(device).replace("peak ", ""))
    rep.figure(
        "memory_timeline.png",
        fig,
        f"Memory over time ({'nvidia-smi snapshots' if device == 'cuda' else 'RSS'}"
        f", every {results[order[0]]['metrics']['memory']['interval_ms']} ms).",
    )

    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(order)
    for part, color in (
        ("allocated by PyTorch", "#4c72b0"),
        ("cached by PyTorch", "#8fb0d8"),
        ("CUDA context and the rest", "#dd8452"),
        ("host RSS", "#55a868"),
        ("did not fit (memory at failure)", "#c44e52"),
    ):
        heights = [peak_split(results[n]["metrics"]).get(part, 0.0) for n in order]
        if any(heights):
            ax.bar(order, heights, bottom=bottoms, label=part, color=color)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set(ylabel=memory_label(device))
    ax.tick_params(axis="x", labelrotation=25)
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", fontsize="small")
    rep.figure(
        "peak_memory.png",
        fig,
        "Peak memory per variant"
        + (
            ", split into PyTorch's allocations, its cache, and what else nvidia-smi saw"
            if device == "cuda"
            else " (host RSS high-water mark)"
        )
        + f".{note}",
    )

    fig, ax = plt.subplots(figsize=(7, 4))
    speed = pd.DataFrame(
        {"variant": order, "images/s": [results[n]["metrics"]["images_per_second"] or 0 for n in order]}
    )
    sns.barplot(speed, x="variant", y="images/s", hue="variant", ax=ax)
    ax.tick_params(axis="x", labelrotation=25)
    rep.figure("throughput.png", fig, "Training throughput per variant (median over epochs; evaluation not timed).")

    if plan:
        points = pd.DataFrame([pt for pt in plan["points"] if pt["fit"]])
        points["model"] = ["checkpointing" if pt.get("checkpointing") else "plain" for pt in points.to_dict("records")]
        fig, ax = plt.subplots(figsize=(7, 4))
        sns.scatterplot(points, x="micro_batch", y="peak_mib", hue="model", style="model", s=60, ax=ax)
        xs = [0, max(points["micro_batch"]) * 1.1]
        for key, label, color in (("fit", "plain", "#4c72b0"), ("fit_checkpointing", "checkpointing", "#dd8452")):
            if key in plan:
                f = plan[key]
                ax.plot(
                    xs,
                    [predict_mib(f, x) for x in xs],
                    color=color,
                    linewidth=1,
                    label=f"{label} fit: {f['fixed_mib']:.0f} + {f['per_sample_mib']:.3f} MiB x micro-batch",
                )
        cards = plan["device"] == "cuda"
        if cards:  # the card sizes the planner's table answers for
            for card in plan["cards"]:
                ax.axhline(card["usable_mib"], color="#999", linewidth=0.8, linestyle="--")
                ax.annotate(f"{card['card_gb']} GB", (xs[1], card["usable_mib"]), fontsize=8, va="bottom", ha="right")
        ax.set(xlabel="micro-batch size", ylabel="peak memory (MiB)")
        ax.legend()
        rep.figure(
            "sweep.png",
            fig,
            f"Memory sweep: {plan['measure']} at each micro-batch, plain and with activation checkpointing, with "
            "the fitted lines"
            + (
                " and each card's usable memory (dashed)."
                if cards
                else " (host memory: card sizes apply to a GPU run)."
            ),
        )


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


def gradcheck_figure(rep: Report, grad: dict[str, Any]) -> None:
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
    ax.legend()
    rep.figure(
        "gradcheck.png",
        fig,
        f"Accumulated against full-batch gradient on one batch of {grad['batch']} ({grad['precision']}): GroupNorm "
        "stays at float32 rounding, BatchNorm does not, and the tutorial's loss / accum is off where the last "
        "micro-batch is short.",
    )


def gradcheck_method(row: dict[str, Any]) -> str:
    norm = {"group": "GroupNorm", "batch": "BatchNorm"}[row["norm"]]
    return norm + (", loss / accum (tutorial)" if row.get("weighting") == "divide" else "")


def peak_split(m: dict[str, Any]) -> dict[str, float]:
    if not m["fit"]:
        return {"did not fit (memory at failure)": float(m["did_not_fit"]["memory_at_failure_mib"] or 0)}
    mem = m["memory"]
    if m["device"] != "cuda":
        return {"host RSS": mem["rss_peak_mib"]}
    allocated, reserved = mem["torch_max_allocated_mib"], mem["torch_max_reserved_mib"]
    smi = mem.get("nvidia_smi_peak_mib") or reserved
    return {
        "allocated by PyTorch": allocated,
        "cached by PyTorch": reserved - allocated,
        "CUDA context and the rest": max(smi - reserved, 0.0),
    }


def header(rep: Report, p: dict[str, Any], hw: dict[str, Any], prov: dict[str, Any]) -> None:
    rep.heading("What ran")
    scale = p["scales"][hw["scale"]]
    where = (
        f"{hw['gpu']['name']} ({hw['gpu']['memory_total_mib']} MiB), driver {hw['gpu']['driver']}, "
        f"CUDA {hw['gpu']['cuda']}"
        if hw["device"] == "cuda"
        else f"CPU only: {hw['cpu']['name']}, {hw['cpu']['cores']} cores"
    )
    label = "the tutorial's study" if hw["scale"] == "study" else "the CPU scale (smaller than the tutorial's study)"
    fallback = " - the 5,000-digit fallback sample, NOT the full MNIST" if prov["kind"] == "fallback" else ""
    rep.table(
        [
            {"": "scale", "value": f"{hw['scale']}: {label}"},
            {"": "hardware", "value": where},
            {
                "": "dataset",
                "value": f"{prov['dataset']} from {prov['kind']}{fallback}: {prov['counts']['train']} train /"
                f" {prov['counts']['test']} test images",
            },
            {"": "data source", "value": str(prov["source"])},
            *({"": f"file {name}", "value": f"md5 {f['md5']} ({f['from']})"} for name, f in prov["files"].items()),
            {
                "": "training",
                "value": f"{scale['train_samples']} samples (at most), effective batch {scale['batch']}, "
                f"{scale['epochs']} epochs, AdamW (weight decay {p['train']['weight_decay']}), "
                f"seed {p['seed']}, model {p['model']['name']}",
            },
            {"": "precision", "value": f"CUDA: {p['train']['amp_cuda']}, CPU: {p['train']['amp_cpu']}"},
            {"": "accum", "value": str(p["accum"])},
            {"": "versions", "value": f"torch {version('torch')}, timm {version('timm')}, dvc {version('dvc')}"},
            {"": "git commit", "value": git_state()},
        ]
    )
    rep.text("The params that ran (params.yaml):")
    rep.pre(yaml.safe_dump(p, sort_keys=False))


def git_state() -> str:
    """The commit the report was made from, and whether the tree differed from it (an experiment's params do)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty.splitlines()]
    return commit.strip() + (f", with uncommitted changes to {', '.join(changed[:8])}" if changed else ", clean tree")


def main() -> None:
    p = params.load()
    hw, prov = read_json(HARDWARE), read_json(PROVENANCE)
    results = load_variants(p)
    plan = read_json(SWEEP_PLAN) if SWEEP_PLAN.exists() else None
    grad = read_json(GRADCHECK) if GRADCHECK.exists() else None
    device = hw["device"]
    rep = Report()
    sns.set_theme(style="whitegrid", context="notebook")  # every figure alike
    if hw["scale"] != "study":
        scale = p["scales"][hw["scale"]]
        rep.stamp = f"{hw['scale'].upper()} SCALE - not the tutorial's study"
        rep.banner(
            f"{hw['scale'].upper()} SCALE - not the tutorial's study: {scale['train_samples']:,} images, effective "
            f"batch {scale['batch']}, {scale['epochs']} epochs on {device}; memory is host RSS, not GPU memory. "
            "The ratios and the equivalence carry over; absolute memory, speed and accuracy do not."
        )
    rep.heading("Summary")
    rep.text(summary(results, grad, device))
    header(rep, p, hw, prov)
    rep.heading("Variants")
    rep.table(variants_table(results))
    rep.heading("The tutorial's claims against this run")
    rep.table(claims_table(results, study_on_gpu=hw["scale"] == "study" and device == "cuda", grad=grad))
    rep.text(steps_note(p, hw["scale"]))
    levers = lever_table(results)
    if levers:
        rep.heading("The memory levers side by side")
        rep.text(
            "The same work as the groupnorm control (GroupNorm, accum 1, same lr and batch), with one lever or "
            "two. Checkpointing recomputes the blocks' activations in backward instead of keeping them; it is "
            "kept away from BatchNorm, whose running statistics it would update twice per forward "
            "(pytorch#96136). Throughput ratios carry the machine's drift: the variants run one after another."
        )
        rep.table(levers)
        lever_figure(rep, levers)
    figures(rep, results, plan, device)
    if grad:
        rep.heading("Is the accumulated gradient the large-batch gradient?")
        rep.text(
            f"Relative difference ‖g_accum − g_full‖ / ‖g_full‖ on one batch of {grad['batch']} images, "
            f"{grad['precision']}, on {grad['device']}."
        )
        rep.table(
            [
                {
                    "norm": r["norm"],
                    "weighting": r.get("weighting", "exact"),
                    "accum": r["accum"],
                    "micro-batch": r["micro_batch"],
                    "relative difference": f"{r['relative_difference']:.3e}",
                }
                for r in grad["rows"]
            ]
        )
        gradcheck_figure(rep, grad)
    if device == "cuda":
        rep.heading("nvidia-smi at each variant's peak")
        for name in results:
            mem = results[name]["metrics"]["memory"]
            rep.text(f"{name}:" + (f" {mem['nvidia_smi_fallback']}" if mem.get("nvidia_smi_fallback") else ""))
            snapshot = variant_dir(name) / "nvidia-smi.txt"
            rep.pre(snapshot.read_text() if snapshot.exists() else "no snapshot")
            history = variant_dir(name) / "memory_snapshot.pickle"
            if history.exists():
                rep.text(
                    f"PyTorch memory snapshot of {name}'s first optimizer step: variants/{name}/{history.name} "
                    f"({history.stat().st_size / 2**20:.1f} MiB); drop it on pytorch.org/memory_viz to see what "
                    "held memory at the peak."
                )
    if plan:
        rep.heading("Which card fits: the memory planner")
        rep.text(
            f"Fit on the sweep: peak = {plan['fit']['fixed_mib']:.0f} MiB + {plan['fit']['per_sample_mib']:.4f} "
            f"MiB per sample (r2 {plan['fit']['r2']:.4f}), measured as {plan['measure']}. For effective batch "
            f"{plan['batch']}, leaving {plan['this_machine']['safety_margin']:.0%} free. On this machine "
            f"({plan['this_machine']['memory_mib']} MiB, {plan['this_machine']['what']}), accum: auto is "
            f"{plan['auto_accum']}"
            + (
                f" (with checkpointing: {plan['auto_accum_checkpointing']}); the fastest option that fits here: "
                f"{options_text(plan['this_machine']['options'][:1])}. The speeds are the sweep's own "
                "(a few steps, warm-up included)"
                if "options" in plan["this_machine"]
                else ""
            )
            + "."
            + (
                " These are host-memory figures from the CPU scale; a GPU run gives the GPU table."
                if plan["device"] == "cpu"
                else ""
            )
        )
        rep.table(
            [
                {
                    "card (GB)": c["card_gb"],
                    "usable (MiB)": c["usable_mib"],
                    "largest micro-batch": c["largest_micro_batch"],
                    "smallest accum": fmt(c["smallest_accum"]),
                    "micro-batch at that accum": fmt(c["micro_batch"]),
                    "predicted peak (MiB)": fmt(c["predicted_peak_mib"]),
                    "options that fit, fastest first": options_text(c.get("options")),
                }
                for c in plan["cards"]
            ]
        )
    write_json(SUMMARY, summary_metrics(results))
    title = f"Gradient accumulation study: {hw['scale']} scale on {device}"
    write_text(REPORT_MD, rep.markdown(title))
    write_text(REPORT_HTML, rep.html(title))
    print(f"report: {REPORT_HTML} and {REPORT_MD} ({len(rep.figures)} figures in {FIGURES})")


if __name__ == "__main__":
    try:
        main()
    except (params.ParamsError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
