"""The report's numbers and verdicts, worked out once from the records: what the tables and sentences word."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from gradaccum.params import Roles
from gradaccum.planner import predict_mib
from gradaccum.records import Plan, VariantRecord
from gradaccum.report import rules
from gradaccum.report.results import Results, peak_mib, seed_mean, seed_values
from gradaccum.tutorial import CLAIMS

CLAIMED_SHARE = CLAIMS["accumulation_gb"] / CLAIMS["baseline_gb"]  # the tutorial's 13.7 / 30


def sign_test_p(rounds: int) -> float:
    """A two-sided sign test of every round agreeing: it assumes nothing about the noise. With no difference, all
    of three rounds agree one time in four (p = 0.25), all of five one time in sixteen (p = 0.06)."""
    return min(1.0, 2 * 0.5**rounds)


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
        """The sign test's p of that agreement (`sign_test_p`)."""
        return sign_test_p(self.rounds)

    @property
    def could_be_chance(self) -> bool:
        return self.p > rules.CHANCE_P


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

    @property
    def same(self) -> bool:
        """A change small enough to call the same training (rules.SAME_LOSS)."""
        return abs(self.change) <= rules.SAME_LOSS

    @property
    def barely(self) -> bool:
        """A change the tutorial's "barely affected" covers (rules.BARELY)."""
        return abs(self.change) <= rules.BARELY


@dataclass(frozen=True)
class MemoryShare:
    """Accumulation's peak as a share of the baseline's, against the tutorial's; on a CPU judged on the part of
    the peak that grows with the batch (host RSS carries a fixed part, Python and libraries, that a GPU's does not)."""

    treatment_mib: float
    baseline_mib: float
    growing: tuple[float, float] | None  # the two peaks less the sweep's fixed part, on a CPU

    claimed = CLAIMED_SHARE

    @property
    def whole(self) -> float:
        return self.treatment_mib / self.baseline_mib

    @property
    def judged(self) -> float:
        return self.growing[0] / self.growing[1] if self.growing else self.whole

    @property
    def over_claimed(self) -> float:
        return self.judged / self.claimed

    @property
    def holds(self) -> bool:
        return holds(self.over_claimed)


def holds(measured_over_claimed: float) -> bool:
    """A claim of the tutorial holds when what was measured or predicted is within rules.CLAIM of it."""
    return abs(measured_over_claimed - 1) <= rules.CLAIM


@dataclass(frozen=True)
class PlannerCheck:
    """The planner's prediction for a variant's micro-batch against the peak its training run measured."""

    variant: str
    micro_batch: int
    predicted_mib: float
    measured_mib: float
    source: str  # what the prediction came from: the sweep, with the trace's precision shift where it applies
    margin: float  # the safety margin the plan used

    @property
    def under(self) -> float:
        """How far the prediction falls short of the measurement, as a share of it (negative: over)."""
        return (self.measured_mib - self.predicted_mib) / self.measured_mib

    @property
    def verdict(self) -> str:
        """ "under the margin" (the direction that ends in out of memory), "close", "under" or "over"."""
        if self.under > self.margin:
            return "under the margin"
        if abs(self.under) <= rules.CLOSE:
            return "close"
        return "under" if self.under > 0 else "over"


@dataclass(frozen=True)
class Findings:
    """The report's numbers, worked out once from the records: the variant in each role (params.yaml `roles`),
    where it trained to the end, and the ratios between them. The wording reads this; tests assert on it."""

    roles: Roles
    groups: int  # GroupNorm's groups (params.yaml model.group_norm_groups): the sentences name the norm by it
    results: Results
    done: dict[str, VariantRecord]  # the variants that trained to the end
    speed: dict[str, SpeedRatio]  # each variant's interleaved speed over the norm control's
    loss: dict[str, float]  # each finished variant's final train loss, the seeds' mean
    fixed_mib: float | None  # on the CPU, the sweep's fitted fixed part of every peak (Python, libraries, weights)
    planner: dict[str, PlannerCheck | str]  # each variant's planner check, or why it has none (no plan: empty)

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
    def memory_share(self) -> MemoryShare | None:
        """The tutorial's memory claim, judged: None where the baseline or the treatment did not train."""
        acc, base = self.role("treatment"), self.role("baseline")
        return MemoryShare(peak_mib(acc), peak_mib(base), self.growing) if acc and base else None

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


def findings(
    results: Results,
    roles: Roles,
    groups: int,
    speed: dict[str, Any] | None = None,
    plan: Plan | None = None,
    trace: dict[str, Any] | None = None,
) -> Findings:
    done = {name: r.record for name, r in results.items() if r.record.completed}  # the variants that trained to the end
    return Findings(
        roles=roles,
        groups=groups,
        results=results,
        done=done,
        speed=speed_ratios(speed, roles.norm_control) if speed else {},
        loss={n: mean for n, m in done.items() if (mean := seed_mean(m, "final_train_loss")) is not None},
        fixed_mib=plan.line.fixed_mib if plan and plan.device == "cpu" else None,
        planner=planner_checks(results, plan, trace) if plan else {},
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


def planner_checks(results: Results, plan: Plan, trace: dict[str, Any] | None = None) -> dict[str, PlannerCheck | str]:
    """Every variant: the planner's prediction for its micro-batch against its measured training peak, or why
    there is none. The sweep runs GroupNorm at the default precision; a variant at the other precision is
    predicted as the sweep's figure plus what the trace says the precision changes."""
    out: dict[str, PlannerCheck | str] = {}
    margin = plan.this_machine.safety_margin
    for name, r in results.items():
        m = r.record
        if not m.completed:
            out[name] = m.why_not()
            continue
        predicted, source = predict_mib(plan.lines[m.checkpointing], m.micro_batch), "sweep"
        if m.precision != "default":
            shift = precision_shift_mib(results, name, trace)
            if shift is None:
                out[name] = f"no fit for {m.amp}: the sweep runs the default precision"
                continue
            predicted, source = predicted + shift[0], f"sweep {shift[0]:+.0f} MiB traced for {m.amp} (vs {shift[1]})"
        out[name] = PlannerCheck(name, m.micro_batch, predicted, peak_mib(m), source, margin)
    return out


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
