"""The report's tables and sentences, each computed from the measured records (nothing typed in by hand)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import ValidationError

from gradaccum.outputs import MissingInput
from gradaccum.params import Params, Roles
from gradaccum.planner import predict_mib
from gradaccum.records import MemoryPeaks, Plan, VariantRecord, invalid
from gradaccum.tutorial import CLAIM_TOLERANCE, CLAIMS, kept_mistakes


@dataclass
class VariantResult:
    """One variant's outputs: its record, its rows per epoch, its memory timeline, its rows per step."""

    record: VariantRecord
    epochs: pd.DataFrame
    timeline: pd.DataFrame
    steps: pd.DataFrame | None = None  # a row per optimizer step (steps.tsv)


Results = dict[str, VariantResult]


def load_variants(names: list[str], folder: Path) -> Results:
    """Each variant's record, epochs and memory timeline from `folder/<variant>/`; variants not run are left out."""
    results = {}
    for name in names:
        d = folder / name
        if not (d / "metrics.json").exists():
            continue
        try:
            results[name] = VariantResult(
                record=VariantRecord.read(d / "metrics.json"),
                epochs=pd.read_csv(d / "epochs.tsv", sep="\t"),
                timeline=pd.read_csv(d / "memory.csv"),
                steps=pd.read_csv(d / "steps.tsv", sep="\t"),
            )
        except (OSError, ValueError) as err:  # a missing curve, a damaged record (pydantic's error is a ValueError)
            first = invalid(err) if isinstance(err, ValidationError) else str(err).splitlines()[0]
            raise MissingInput(
                f"{d}/ cannot be read ({type(err).__name__}: {first}): `dvc repro -f train@{name}` makes it again"
            ) from None
    if not results:
        raise MissingInput(f"no variant has a metrics.json under {folder}/: `dvc repro train` makes them")
    return results


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


@dataclass(frozen=True)
class SpeedRatio:
    """A variant's speed over the reference's, taken within each interleaved round."""

    median: float
    min: float
    max: float
    rounds: int
    faster: int  # rounds in which it beat the reference
    slower: int

    @property
    def agreed(self) -> str | None:
        """ "faster" or "slower" when every round says so, else None."""
        return next((side for side in ("slower", "faster") if getattr(self, side) == self.rounds), None)

    @property
    def p(self) -> float:
        """A two-sided sign test of that agreement: it assumes nothing about the noise. With no difference, all
        of three rounds agree one time in four (p = 0.25), all of five one time in sixteen (p = 0.06)."""
        return min(1.0, 2 * 0.5**self.rounds)


@dataclass(frozen=True)
class Versus:
    """Two variants' end point (the seeds' means), against what another seed gives: the wider of their ranges."""

    a: float
    b: float
    width: float | None  # None with one seed: nothing to hold the difference against
    seeds: int

    @property
    def change(self) -> float:
        """a relative to b."""
        return self.a / self.b - 1

    @property
    def beyond_seeds(self) -> bool | None:
        return None if self.width is None else abs(self.a - self.b) > self.width


SAME_LOSS, BARELY = 0.01, 0.10  # relative loss changes called "nothing" (the same training) and "barely"


@dataclass(frozen=True)
class Findings:
    """The report's numbers, worked out once from the records: the variant in each role (params.yaml `roles`),
    where it trained to the end, and the ratios between them. The wording reads this; tests assert on it."""

    roles: Roles
    results: Results
    done: dict[str, VariantRecord]  # the variants that trained to the end
    speed: dict[str, SpeedRatio]  # each variant's interleaved speed over the norm control's
    loss: dict[str, float]  # each finished variant's final train loss, the seeds' mean
    fixed_mib: float | None  # on the CPU, the sweep's fitted fixed part of every peak (Python, libraries, weights)

    def role(self, key: str) -> VariantRecord | None:
        """The record of the variant playing `key` (baseline, treatment, ...), if it trained to the end."""
        return self.done.get(self.name(key))

    def name(self, key: str) -> str:
        """The variant playing `key`."""
        return getattr(self.roles, key)

    def mean_loss(self, key: str) -> float:
        """The final train loss of the variant playing `key`, the seeds' mean."""
        return self.loss[self.name(key)]

    def versus(self, a: str, b: str, key: str = "final_train_loss") -> Versus:
        """Role `a`'s end point (final_train_loss or test_accuracy) against role `b`'s; both trained."""
        va, vb = (seed_values(self.role(r), key) for r in (a, b))
        seeds = min(len(va), len(vb))
        width = max(max(va) - min(va), max(vb) - min(vb)) if seeds > 1 else None
        return Versus(statistics.fmean(va), statistics.fmean(vb), width, seeds)

    def ratio(self, a: str, b: str) -> float | None:
        """Peak memory of role `a` over role `b`'s, where both trained."""
        ma, mb = self.role(a), self.role(b)
        return peak_mib(ma) / peak_mib(mb) if ma and mb else None

    @property
    def memory_ratio(self) -> float | None:
        return self.ratio("treatment", "baseline")

    @property
    def growing(self) -> tuple[float, float] | None:
        """On the CPU, the treatment's and the baseline's peaks less the fixed part: what grows with the batch."""
        acc, base = self.role("treatment"), self.role("baseline")
        if self.fixed_mib is None or not (acc and base) or acc.device != "cpu":
            return None
        parts = (peak_mib(acc) - self.fixed_mib, peak_mib(base) - self.fixed_mib)
        return parts if parts[1] > 0 else None

    @property
    def loss_split(self) -> tuple[float, float, float] | None:
        """The baseline-to-norm-control change in final loss, and its lr and norm parts (through lr_control)."""
        names = (self.roles.baseline, self.roles.lr_control, self.roles.norm_control)
        if not all(n in self.loss for n in names):
            return None
        lb, ll, lg = (self.loss[n] for n in names)
        return lg - lb, ll - lb, lg - ll


def findings(results: Results, roles: Roles, speed: dict[str, Any] | None = None, plan: Plan | None = None) -> Findings:
    done = {name: r.record for name, r in results.items() if r.record.completed}  # the variants that trained to the end
    return Findings(
        roles=roles,
        results=results,
        done=done,
        speed=speed_ratios(speed, roles.norm_control) if speed else {},
        loss={n: mean for n, m in done.items() if (mean := seed_mean(m, "final_train_loss")) is not None},
        fixed_mib=plan.line.fixed_mib if plan and plan.device == "cpu" else None,
    )


def speed_ratios(speed: dict[str, Any], reference: str) -> dict[str, SpeedRatio]:
    """Each variant's speed over the reference's within each interleaved round: the median ratio and its range."""
    ref = speed["variants"].get(reference, {}).get("images_per_s")
    out = {}
    for name, row in speed["variants"].items():
        if ref and (mine := row.get("images_per_s")) and len(mine) == len(ref):
            per_round = [m / r for m, r in zip(mine, ref, strict=True)]
            n, faster, slower = len(per_round), sum(x > 1 for x in per_round), sum(x < 1 for x in per_round)
            out[name] = SpeedRatio(statistics.median(per_round), min(per_round), max(per_round), n, faster, slower)
    return out


def seed_values(m: VariantRecord, key: str) -> list[float]:
    """A variant's end points (final_train_loss or test_accuracy) over its seeds; the record's own without them."""
    values = [getattr(r, key) for r in m.seeds]
    return values or ([getattr(m, key)] if getattr(m, key) is not None else [])


def seed_mean(m: VariantRecord, key: str) -> float | None:
    values = seed_values(m, key)
    return statistics.fmean(values) if values else None


def seed_text(m: VariantRecord, key: str) -> str:
    """The mean over seeds and its range; the single value with one seed."""
    values = seed_values(m, key)
    if len(values) < 2:
        return fmt(values[0] if values else None)
    return f"{statistics.fmean(values):.4f} ({min(values):.4f} to {max(values):.4f})"


def spread(v: Versus, short: bool = False) -> str:
    """Whether a difference is larger than what another seed gives, with its figures unless `short`."""
    if v.width is None:
        return "one seed" if short else "one seed: not compared with a seed spread"
    word = "larger than the seed spread" if v.beyond_seeds else "within the seed spread"
    return word if short else f"{word} ({abs(v.a - v.b):.4f} against a range of {v.width:.4f} over {v.seeds} seeds)"


def relative(change: float) -> str:
    """A relative change: in percent, or in powers of ten where it is too small for a percent to show."""
    return f"{change:+.1%}" if abs(change) >= 1e-3 else f"{change:+.1e}"


ENDPOINTS = {"final_train_loss": "final train loss", "test_accuracy": "test accuracy"}


def endpoints(f: Findings, a: str, b: str) -> str:
    """Role `a`'s final train loss and test accuracy against role `b`'s, each the seeds' mean and range."""
    ma, mb = f.role(a), f.role(b)
    return "; ".join(f"{label} {seed_text(ma, key)} vs {seed_text(mb, key)}" for key, label in ENDPOINTS.items())


def code_label(m: VariantRecord) -> str:
    """Which of the tutorial's three mistakes a variant ran with; "exact" when none."""
    kept = kept_mistakes(m.model_dump())
    return "tutorial: " + ", ".join(c.label for c in kept) if kept else "exact"


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


def verdict(measured_over_claimed: float | None) -> str:
    if measured_over_claimed is None:
        return "not measured"
    if abs(measured_over_claimed - 1) <= CLAIM_TOLERANCE:
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
    claimed = CLAIMS["accumulation_gb"] / CLAIMS["baseline_gb"]
    text = f"accumulation needs {claimed:.0%} of the baseline's memory (13.7 / 30)"
    acc, base = f.role("treatment"), f.role("baseline")
    if not (acc and base):
        return [claim(text, "-", None, "not measured: the baseline or the accumulation variant did not run or fit")]
    if acc.accum != CLAIMS["accum"]:  # a share of the micro-batch: another accum, another share
        text += f"; this run at accum {acc.accum}, the tutorial's {CLAIMS['accum']}"
    a, b = peak_mib(acc), peak_mib(base)
    if f.growing:
        a2, b2 = f.growing
        measured = (
            f"{a2 / b2:.2f} of the part that grows with the batch ({a2:.0f} / {b2:.0f} MiB: peak less the sweep's "
            f"fixed {f.fixed_mib:.0f} MiB); whole process {a / b:.2f} ({a:.0f} / {b:.0f} MiB)"
        )
        memory = claim(text, measured, a2 / b2 / claimed)
    else:
        memory = claim(text, f"{a / b:.2f} ({a:.0f} / {b:.0f} MiB)", a / b / claimed)
    loss = f.versus("treatment", "baseline")
    judged = (
        "holds (within 10%)"
        if abs(loss.change) <= BARELY
        else f"the loss is {'higher' if loss.change > 0 else 'lower'} by {abs(loss.change):.0%}"
    )
    judged += f", {spread(loss)}; but norm and lr changed too: the control rows below separate them"
    measured = endpoints(f, "treatment", "baseline")
    return [memory, claim("the loss is barely affected", measured, loss.a / loss.b, judged)]


# The controls that separate what the tutorial changed at once, (claim, role, against role): accumulation alone,
# the lr alone and the norm alone (through the lr control: BatchNorm at 3e-4), both together, its code as written.
CONTROLS = (
    ("accumulation alone changes nothing: same norm, same lr, accum 1", "treatment", "norm_control"),
    ("the lr alone: BatchNorm at 3e-4 against 1e-3, both accum 1", "lr_control", "baseline"),
    ("the norm alone: GroupNorm(1) against BatchNorm, both at 3e-4 and accum 1", "norm_control", "lr_control"),
    (
        "the norm swap with its lr: GroupNorm(1) at 3e-4 against BatchNorm at 1e-3, both accum 1",
        "norm_control",
        "baseline",
    ),
    (
        "the tutorial's accumulation code as written (loss / accum, no step at epoch end, plain GroupNorm swap) "
        "against the corrected code",
        "tutorial_code",
        "treatment",
    ),
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
        if a == "treatment" and abs(loss.change) <= SAME_LOSS:
            judged = f"holds: {judged}"
        rows.append(claim(f"(this study) {text}", measured, None, judged))
    return rows


def norm_or_lr_answer(f: Findings) -> str | None:
    """The first screen's sentence: how much of the baseline-to-fix loss change is the lr's, how much the norm's."""
    if f.loss_split is None:
        return None
    total, lr_part, norm_part = f.loss_split
    lr_seeds, norm_seeds = (spread(f.versus(a, b), short=True) for _, a, b in CONTROLS[1:3])

    def share(part: float) -> str:
        return f" ({part / total + 0.0:.0%})" if total else ""  # + 0.0: no "-0%"

    return (
        f"Of the fix's {total:+.4f} in final loss, the lr alone: {lr_part:+.4f}{share(lr_part)}, "
        f"{lr_seeds}; then the norm (at 3e-4): {norm_part:+.4f}{share(norm_part)}, {norm_seeds}."
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


def speed_rows(f: Findings, speed: dict[str, Any]) -> list[dict[str, Any]]:
    """The interleaved measurement per variant: images/s per round, its median, and the ratio to the control."""
    ratios, reference = f.speed, f.roles.norm_control
    rows = []
    for name, row in speed["variants"].items():
        rounds = row.get("images_per_s") or []
        twin = f" (timed as {row['same_step_as']}: the same step, another lr)" if "same_step_as" in row else ""
        rows.append(
            {
                "variant": name + twin,
                "accum x micro-batch": f"{row['accum']} x {row['micro_batch']}" if "accum" in row else "-",
                "images/s per round": ", ".join(f"{x:.1f}" for x in rounds)
                or row.get("not_run")
                or row.get("did_not_fit", "-"),
                "median images/s": fmt(row.get("median_images_per_s"), 1),
                f"vs {reference}: median (range)": ratio_text(ratios.get(name)),
                "verdict": speed_verdict(ratios[name]) if name in ratios and name != reference else "-",
            }
        )
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


def ratio_text(r: SpeedRatio | None) -> str:
    """An interleaved speed ratio: the median over rounds, then its range."""
    return f"{r.median:.2f} ({r.min:.2f} to {r.max:.2f})" if r else "-"


def speed_verdict(r: SpeedRatio) -> str:
    """Faster or slower only where every round agrees, with the sign test's p so a reader can weigh it."""
    if r.agreed:
        chance = "" if r.p <= 0.1 else ": could be chance"
        return f"{r.agreed} in all {r.rounds} rounds (sign test p = {r.p:.2g}{chance})"
    return f"not resolved: faster in {r.faster} of {r.rounds} rounds, slower in {r.slower}"


def lever_table(f: Findings) -> list[dict[str, Any]]:
    """Each memory lever against the norm control (same norm, lr and batch, none of the levers); speed
    from the interleaved measurement only."""
    ref, ratios = f.role("norm_control"), f.speed
    if not ref:
        return []
    rows, against = [], f"vs {f.roles.norm_control}"
    for name, lever in f.roles.levers.items():
        m = f.done.get(name)
        if m is None:
            if name in f.results:  # not run, or did not fit: say so in the lever's row
                rows.append(
                    {"lever": lever, "variant": name, f"peak memory {against}": f.results[name].record.why_not()}
                )
            continue
        rows.append(
            {
                "lever": lever + (f" ({m.amp} instead of {ref.amp})" if m.amp != ref.amp else ""),
                "variant": name,
                f"peak memory {against}": fmt(peak_mib(m) / peak_mib(ref), 2),
                "memory saved (MiB)": fmt(peak_mib(ref) - peak_mib(m), 0),
                f"throughput {against}, interleaved: median (range)": ratio_text(ratios.get(name)),
                "speed verdict": speed_verdict(ratios[name]) if name in ratios else "-",
                "final train loss": seed_text(m, "final_train_loss"),
                "test accuracy": seed_text(m, "test_accuracy"),
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


def options_text(options: list[dict[str, Any]] | None) -> str:
    """The planner's options for one card: checkpointing or not, accum, predicted peak, the sweep's measured speed."""
    if options is None:
        return "-"
    if not options:
        return "none fits"
    return "; ".join(
        f"{'checkpointing, ' if o['checkpointing'] else ''}accum {o['accum']} (micro-batch "
        f"{o['micro_batch']}): {o['predicted_peak_mib']} MiB, {o['images_per_s']:.0f} images/s"
        for o in options
    )


def planner_card_rows(cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def precision_shift_mib(results: Results, name: str, trace: dict[str, Any] | None) -> tuple[float, str] | None:
    """What the other precision changes, from the trace: the variant's traced peak less that of the variant
    that differs from it in precision alone (same norm, swap, checkpointing, micro-batch), at the run's scale;
    with the name of that variant. None without a trace or such a twin."""
    if not trace:
        return None
    m = results[name].record
    traced = {r["variant"]: r for r in trace["rows"] if r["scale"] == m.scale and "peak_mib" in r}
    for other, r in results.items():
        o = r.record
        twin = (o.norm, o.swap, o.checkpointing, o.micro_batch) == (m.norm, m.swap, m.checkpointing, m.micro_batch)
        if twin and o.precision == "default" and name in traced and other in traced:
            return traced[name]["peak_mib"] - traced[other]["peak_mib"], other
    return None


def planner_rows(results: Results, plan: Plan, trace: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every variant: the planner's prediction for its micro-batch against its measured training peak.

    A prediction under the measurement by more than the safety margin is flagged: that is the direction that
    ends in an out-of-memory error. The sweep runs GroupNorm at the default precision; a variant at the other
    precision is predicted as the sweep's figure plus what the trace says the precision changes.
    """
    margin, rows = plan.this_machine.safety_margin, []
    for name, r in results.items():
        m = r.record
        if not m.completed:
            rows.append({"variant": name, "verdict": m.why_not()})
            continue
        predicted, how = predict_mib(plan.lines[m.checkpointing], m.micro_batch), "sweep"
        if m.precision != "default":
            shift = precision_shift_mib(results, name, trace)
            if shift is None:
                rows.append({"variant": name, "verdict": f"no fit for {m.amp}: the sweep runs the default precision"})
                continue
            predicted, how = predicted + shift[0], f"sweep {shift[0]:+.0f} MiB traced for {m.amp} (vs {shift[1]})"
        measured = peak_mib(m)
        under = (measured - predicted) / measured
        rows.append(
            {
                "variant": name,
                "micro-batch": m.micro_batch,
                "predicted (MiB)": fmt(predicted, 0),
                "from": how,
                "measured (MiB)": fmt(measured, 0),
                "predicted / measured": fmt(predicted / measured, 3),
                "verdict": f"UNDER by {under:.1%}, more than the {margin:.0%} margin"
                if under > margin
                else ("within 5%" if abs(under) <= 0.05 else f"{'under' if under > 0 else 'over'} by {abs(under):.1%}"),
            }
        )
    return rows


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
