"""The tutorial's claims and the study's controls: each verdict worded as a table row or a sentence."""

from __future__ import annotations

import math
from typing import Any

from gradaccum.params import Params
from gradaccum.records import VariantRecord
from gradaccum.report import rules
from gradaccum.report.findings import CLAIMED_SHARE, Findings, Versus, holds
from gradaccum.report.results import fmt, peak_mib, relative, seed_text
from gradaccum.report.throughput import ratio_text, speed_verdict
from gradaccum.report.variants import kept_labels
from gradaccum.tutorial import CLAIMS


def lr_text(lr: float) -> str:
    """A learning rate as params.yaml and the tutorial write it: 3e-4, not 0.0003."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def facets(m: VariantRecord, groups: int) -> dict[str, str]:
    """What a control is, from its record: its norm, lr, accum and whether it runs the tutorial's code."""
    return {
        "norm": f"GroupNorm({groups})" if m.norm == "group" else "BatchNorm",
        "lr": f"lr {lr_text(m.lr)}",
        "accum": f"accum {m.accum}",
        "code": f"the tutorial's code ({', '.join(kept)})" if (kept := kept_labels(m)) else "the corrected code",
    }


def contrast(a: VariantRecord, b: VariantRecord, groups: int) -> str:
    """How two runs differ and what they share, from their records: "BatchNorm, lr 3e-4 against lr 1e-3, both
    accum 1", so a changed setting in params.yaml changes the sentence."""
    fa, fb = facets(a, groups), facets(b, groups)
    differ = [k for k in fa if fa[k] != fb[k]]
    shared = [fa[k] for k in fa if fa[k] == fb[k]]
    text = f"{', '.join(fa[k] for k in differ)} against {', '.join(fb[k] for k in differ)}" if differ else "the same"
    return text + (f", both {', '.join(shared)}" if shared else "")


def spread(v: Versus, short: bool = False) -> str:
    """Whether a difference is larger than what another seed gives, with its figures unless `short`."""
    if v.width is None:
        return "one seed" if short else "one seed: not compared with a seed spread"
    word = "larger than the seed spread" if v.beyond_seeds else "within the seed spread"
    return word if short else f"{word} ({abs(v.a - v.b):.4f} against a range of {v.width:.4f} over {v.seeds} seeds)"


ENDPOINTS = {"final_train_loss": "final train loss", "test_accuracy": "test accuracy"}


def endpoints(f: Findings, a: str, b: str) -> str:
    """Role `a`'s final train loss and test accuracy against role `b`'s, each the seeds' mean and range."""
    ma, mb = f.role(a), f.role(b)
    return "; ".join(f"{label} {seed_text(ma, key)} vs {seed_text(mb, key)}" for key, label in ENDPOINTS.items())


def verdict(measured_over_claimed: float | None) -> str:
    if measured_over_claimed is None:
        return "not measured"
    if holds(measured_over_claimed):
        return "holds"
    return f"does not hold: measured {measured_over_claimed:.2f}x the claim"


def claim(text: str, measured: str, over: float | None, result: str | None = None) -> dict[str, str]:
    return {
        "tutorial's claim": text,
        "measured": measured,
        "measured / claimed": fmt(over, 2),
        "verdict": result or verdict(over),
    }


def ratio_claims(f: Findings) -> list[dict[str, str]]:
    """Accumulation's share of the baseline's memory, and the loss, as the tutorial compared them.

    On the CPU the share is judged on the part of the peak that grows with the batch: host RSS carries a
    fixed part (Python, libraries) that a GPU's memory does not, so the whole-process ratio cannot match.
    """
    share = f.memory_share
    text = (
        f"accumulation needs {CLAIMED_SHARE:.0%} of the baseline's memory "
        f"({CLAIMS['accumulation_gb']:g} / {CLAIMS['baseline_gb']:g})"
    )
    if share is None:
        return [claim(text, "-", None, "not measured: the baseline or the accumulation variant did not run or fit")]
    acc = f.role("treatment")
    if acc.accum != CLAIMS["accum"]:  # a share of the micro-batch: another accum, another share
        text += f"; this run at accum {acc.accum}, the tutorial's {CLAIMS['accum']}"
    a, b = share.treatment_mib, share.baseline_mib
    measured = f"{share.whole:.2f} ({a:.0f} / {b:.0f} MiB)"
    if share.growing:
        a2, b2 = share.growing
        measured = (
            f"{share.judged:.2f} of the part that grows with the batch ({a2:.0f} / {b2:.0f} MiB: peak less the "
            f"sweep's fixed {f.fixed_mib:.0f} MiB); whole process {share.whole:.2f} ({a:.0f} / {b:.0f} MiB)"
        )
    memory = claim(text, measured, share.over_claimed)
    loss = f.versus("treatment", "baseline")
    judged = (
        f"holds (within {rules.BARELY:.0%})"
        if loss.barely
        else f"the loss is {'higher' if loss.change > 0 else 'lower'} by {abs(loss.change):.0%}"
    )
    judged += f", {spread(loss)}; but norm and lr changed too: the control rows below separate them"
    measured = endpoints(f, "treatment", "baseline")
    return [memory, claim("the loss is barely affected", measured, loss.a / loss.b, judged)]


# The controls that separate what the tutorial changed at once, (what it isolates, role, against role):
# accumulation alone, the lr alone and the norm alone (through the lr control), both together, its code as written.
# What each control is comes from its record (`contrast`), never from these words.
CONTROLS = (
    ("accumulation alone changes nothing", "treatment", "norm_control"),
    ("the lr alone", "lr_control", "baseline"),
    ("the norm alone", "norm_control", "lr_control"),
    ("the norm swap with its lr", "norm_control", "baseline"),
    ("the tutorial's accumulation code as written", "tutorial_code", "treatment"),
)


def control_claims(f: Findings) -> list[dict[str, str]]:
    """Each control against its pair: the loss change, against the seed spread; the peaks and the steps."""
    rows = []
    for text, a, b in CONTROLS:
        ma, mb = f.role(a), f.role(b)
        if not (ma and mb):
            continue
        loss = f.versus(a, b)
        measured = (
            f"{endpoints(f, a, b)}; peak {peak_mib(ma):.0f} vs {peak_mib(mb):.0f} MiB; "
            f"{ma.optimizer_steps} vs {mb.optimizer_steps} optimizer steps at accum {ma.accum} vs {mb.accum}"
        )
        acc = f.versus(a, b, "test_accuracy")
        judged = (
            f"the loss changes by {loss.a - loss.b:+.4f} ({relative(loss.change)}), {spread(loss)}; test accuracy "
            f"by {acc.a - acc.b:+.4f}, {spread(acc, short=True)}"
        )
        if a == "treatment" and loss.same:
            judged = f"holds: {judged}"
        rows.append(claim(f"(this study) {text}: {contrast(ma, mb, f.groups)}", measured, None, judged))
    return rows


def norm_or_lr_answer(f: Findings) -> str | None:
    """The first screen's sentence: how much of the baseline-to-fix loss change is the lr's, how much the norm's."""
    if f.loss_split is None:
        return None
    total, lr_part, norm_part = f.loss_split
    lr_seeds, norm_seeds = (spread(f.versus(a, b), short=True) for _, a, b in CONTROLS[1:3])
    at = lr_text(f.role("lr_control").lr)

    def share(part: float) -> str:
        return f" ({part / total + 0.0:.0%})" if total else ""  # + 0.0: no "-0%"

    return (
        f"Of the fix's {total:+.4f} in final loss, the lr alone: {lr_part:+.4f}{share(lr_part)}, "
        f"{lr_seeds}; then the norm (at {at}): {norm_part:+.4f}{share(norm_part)}, {norm_seeds}."
    )


def gradcheck_scope(grad: dict[str, Any]) -> str:
    """What the gradient check ran over: the training loop's shuffled epoch."""
    return f"through the training loop, over a shuffled epoch of {grad['samples']} (batch {grad['batch']})"


def batchnorm_claim(f: Findings, grad: dict[str, Any]) -> dict[str, str]:
    """BatchNorm must go: the gradient check says whether accumulation with it is the large-batch gradient."""
    also = ""
    if f.role("accum_control") and f.role("baseline"):
        also = f"; {f.roles.accum_control} against the baseline: {endpoints(f, 'accum_control', 'baseline')}, "
        also += spread(f.versus("accum_control", "baseline"))
    return claim(
        "BatchNorm must go for accumulation (swapped for GroupNorm)",
        f"accumulated gradient vs full batch: BatchNorm differs by at least {grad['batchnorm_min']:.2f}, "
        f"GroupNorm by at most {grad['groupnorm_max']:.1e} (relative){also}",
        None,
        "holds: with BatchNorm, accumulation is not the large-batch gradient (it still trains)"
        if grad["batchnorm_differs"] and grad["groupnorm_equal"]
        else "not shown by this run's gradient check",
    )


def claims_table(f: Findings, grad: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """The tutorial's claims this run measured, then the controls that separate what it changed at once."""
    rows = ratio_claims(f) + control_claims(f)
    return rows + ([batchnorm_claim(f, grad)] if grad else [])


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


# The first screen's questions: `answers` asks them, traced.gpu_answers keys the GPU column by them.
SAVES, COSTS, SAME = "Does accumulation save memory?", "What does it cost?", "Is it the same training?"


NORM_OR_LR = "The tutorial's loss change: the norm or the lr?"


MEASURED_HERE = {"cuda": "measured on this GPU (nvidia-smi)", "cpu": "measured on this machine (host RSS)"}


PREDICTED_GPU = "predicted for a GPU (study scale, traced)"


def answers(f: Findings, grad: dict[str, Any] | None, device: str, predicted: dict[str, str]) -> list[dict[str, str]]:
    """The report's first screen: each question answered in a sentence, what this run measured beside what
    the trace predicts for a GPU (`predicted`, by question); the sections below hold the numbers behind each."""
    base, acc, gn = f.role("baseline"), f.role("treatment"), f.role("norm_control")
    here = MEASURED_HERE["cuda" if device == "cuda" else "cpu"]
    rows = []
    if acc and base:
        a, b = peak_mib(acc), peak_mib(base)
        text = f"Yes: {a:.0f} against {b:.0f} MiB, {a / b:.2f} x the baseline's peak"
        if gn:
            text += f"; {a / peak_mib(gn):.2f} x its norm control's, so the micro-batch saves it, not the norm"
        rows.append({"question": SAVES, "answer": text + "."})
    elif acc and f.roles.baseline in f.results:  # the baseline ran out of memory: the answer the tutorial met
        failed = peak_mib(f.results[f.roles.baseline].record)
        at = f" ({failed:.0f} MiB when it failed)" if failed else ""
        answer = f"Yes: it trained at {peak_mib(acc):.0f} MiB; the baseline did not fit{at}."
        rows.append({"question": SAVES, "answer": answer})
    if acc and (r := f.speed.get(f.roles.treatment)):
        answer = f"{ratio_text(r)} x its control's speed: {speed_verdict(r)}."
        rows.append({"question": COSTS, "answer": answer})
    if grad and acc and gn:
        same = "Yes" if grad["groupnorm_equal"] else "No"
        a_loss, g_loss = f.mean_loss("treatment"), f.mean_loss("norm_control")
        rows.append(
            {
                "question": SAME,
                "answer": f"{same}: the gradient matches the full batch's to {grad['groupnorm_max']:.1e}; final loss "
                f"{a_loss:.4f} against {g_loss:.4f} without accumulation.",
            }
        )
    if split := norm_or_lr_answer(f):
        rows.append({"question": NORM_OR_LR, "answer": split})
    return [
        {"question": r["question"], here: r["answer"], PREDICTED_GPU: predicted.get(r["question"], NOT_PREDICTED)}
        for r in rows
    ]


# The first screen's GPU cell where the trace has nothing to say: it predicts memory, not losses or gradients.
NOT_PREDICTED = "Not predicted: the trace gives memory only; a GPU run measures this (scripts/gpu_check.sh)."
