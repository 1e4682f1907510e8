"""Every setting one variant runs with, worked out once: the run spec.

`resolve` makes a `RunSpec` from params.yaml, the machine (data/hardware.json, read as `Hardware`) and the
sweep's plan (reports/sweep/planner.json, read as `Plan`), and raises every refusal that depends on them. The
train stage, the speed stage, the sweep's points, the trace and the card table take the spec; none of them works
out accum, the micro-batch, the dtype or whether the variant runs again. To change one of those rules, change it
here.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import ConfigDict, model_validator

from gradaccum import planner
from gradaccum.accumulation import micro_batch_size
from gradaccum.params import Model, Params, ParamsError, Train, Variant, check_accum, fail
from gradaccum.records import DidNotFit, Hardware, Plan, Settings

AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": None}  # float32: no autocast


class AutoUndecided(ParamsError):
    """accum: auto with no sweep to decide it (the trace says so rather than guess)."""


class RunSpec(Settings):
    """One variant at one scale on one machine, resolved: what its run, its speed rounds and its trace use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Model
    cudnn: Literal["default", "tutorial"]
    amp: Literal["float16", "bfloat16", "float32"]
    weight_decay: float
    world: int  # processes; a window is accum x world micro-batches
    eval_batch_limit: int  # train.eval_batch: evaluation's batch at most (`eval_batch`)
    epochs: int
    train_samples: int
    test_samples: int
    seed: int
    seeds: int
    memory_interval_ms: int
    same_step_as: str | None  # an earlier variant whose step differs only in the lr: its speed and trace are this one's
    not_run: str | None = None  # left out on purpose, before anything is built
    over_budget: DidNotFit | None = None  # on a CPU, the planner's verdict: the kernel would kill it, not raise

    @model_validator(mode="before")
    @classmethod
    def derive_micro_batch(cls, data: Any) -> Any:
        """The micro-batch follows from the batch and the window (accum x world); one given must agree."""
        if isinstance(data, dict) and {"batch", "accum", "world"} <= data.keys():
            micro = micro_batch_size(data["batch"], data["accum"] * data["world"])
            if data.setdefault("micro_batch", micro) != micro:
                raise ValueError(
                    f"micro_batch {data['micro_batch']} is not ceil(batch {data['batch']} / (accum {data['accum']} "
                    f"x world {data['world']})) = {micro}"
                )
        return data

    @property
    def dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.amp]

    @property
    def eval_batch(self) -> int:
        """Never above the micro-batch, so evaluation fits wherever training does."""
        return min(self.eval_batch_limit, self.micro_batch)

    def at(self, **changes: Any) -> RunSpec:
        """This spec with `changes` (accum, checkpointing, amp, ...), validated again and its micro-batch derived
        again: the one way, besides `resolve`, to make a spec."""
        return RunSpec.model_validate(self.model_dump(exclude={"micro_batch"}) | changes)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> RunSpec:
        if update:  # pydantic's copy skips validation: a spec so made could carry a micro-batch it does not run
            raise TypeError("a RunSpec is changed with .at(...) or .at_micro(...), which validate; not model_copy")
        return super().model_copy(deep=deep)

    def at_micro(self, micro: int) -> RunSpec:
        """The same window of `accum` x `world` micro-batches, each of `micro` samples (a sweep point)."""
        return self.at(batch=micro * self.accum * self.world)

    def runs(self) -> bool:
        return self.not_run is None and self.over_budget is None

    def why_not(self) -> dict[str, str]:
        """Why a spec that does not run is left out, keyed as the speed record keys it."""
        if self.not_run:
            return {"not_run": self.not_run}
        return {"did_not_fit": self.over_budget.reason} if self.over_budget else {}


def check_distributed(p: Params, hw: Hardware) -> None:
    """The rules that need the machine: one process per visible GPU at most; SyncBatchNorm needs GPUs."""
    nproc, sync_bn = p.distributed.nproc_per_node, p.distributed.sync_batchnorm
    gpus = hw.gpu.count if hw.device == "cuda" and hw.gpu else 0
    if hw.device == "cuda" and nproc > gpus:
        fail("distributed.nproc_per_node", nproc, f"expected at most the {gpus} visible GPU(s), one process each")
    if sync_bn and nproc > 1 and hw.device != "cuda":
        fail("distributed.sync_batchnorm", sync_bn, "SyncBatchNorm runs on GPUs only; use false on the CPU")


def amp(device: str, train: Train, precision: str = "default") -> str:
    """float16 needs a GradScaler (small gradients underflow); bfloat16 has float32's range and does not.

    precision="other" is the precision lever (`other_precision`)."""
    default = train.amp_cuda if device == "cuda" else train.amp_cpu
    return default if precision == "default" else other_precision(default, device)


def other_precision(amp: str, device: str) -> str:
    """The precision lever: float32 where `amp` autocasts, else the device's autocast dtype (float16 on a GPU,
    bfloat16 on a CPU, which has no float16 kernels worth timing)."""
    return "float32" if amp != "float32" else ("float16" if device == "cuda" else "bfloat16")


def resolve(
    p: Params, variant: str, hw: Hardware, plan: Plan | None = None, world: int = 1, accum: int | None = None
) -> RunSpec:
    """The variant's spec on `hw`; `accum` overrides the variant's own (the card table tries others)."""
    if variant not in p.variants:
        raise ParamsError(f"variant {variant!r} is not in params.yaml variants: {', '.join(p.variants)}")
    v, settings = p.variants[variant], p.scale_settings(hw.scale)
    accum = accum or variant_accum(p, variant, plan, hw.scale, world)
    precision = amp(hw.device, p.train, v.precision)
    spec = RunSpec(
        variant=variant,
        scale=hw.scale,
        device=hw.device,
        model=p.model,
        **v.model_dump(exclude={"accum", "extra"}),  # accum is resolved below; extra names a DVC dependency
        **settings.model_dump(include={"batch", "epochs", "train_samples", "test_samples"}),
        amp=precision,
        weight_decay=p.train.weight_decay,
        accum=accum,
        accum_setting=accum_setting(p, v),
        world=world,
        eval_batch_limit=p.train.eval_batch,
        sync_batchnorm=p.distributed.sync_batchnorm and v.norm == "batch" and world > 1,
        seed=p.seed,
        seeds=p.seeds,
        memory_interval_ms=p.memory.interval_ms,
        same_step_as=step_twin(p, variant),
    )
    return spec.at(not_run=emulated(p, hw, precision), over_budget=over_budget(p, hw, spec.micro_batch, plan, world))


# Models the code declares rather than params.yaml, so that editing a variant re-runs neither stage: what the sweep
# measures and the planner's lines describe (GroupNorm at accum 1 and the default precision, activation
# checkpointing off and on), and the gradient check's two norms (run in float32 whatever the precision).
SWEPT = Variant(norm="group", accum=1, lr=1e-4, extra="seed")
CHECKED = {norm: Variant(norm=norm, accum=1, lr=1e-4, extra="seed") for norm in ("group", "batch")}


def declared_spec(p: Params, hw: Hardware, name: str, v: Variant) -> RunSpec:
    """The spec of a model the code declares (SWEPT, CHECKED), resolved as a variant of params.yaml would be."""
    return resolve(p.model_copy(update={"variants": {name: v}}), name, hw)


def sweep_spec(p: Params, hw: Hardware, checkpointing: bool) -> RunSpec:
    """The sweep's spec on `hw`; each point runs it at a micro-batch of its own."""
    return declared_spec(p, hw, "sweep", SWEPT.model_copy(update={"checkpointing": checkpointing}))


STEP_IRRELEVANT = {"lr", "extra"}  # the learning rate scales the update, not the step's time or memory


def step_twin(p: Params, variant: str) -> str | None:
    """The earlier variant whose optimizer step is this one's in every setting but the learning rate, if any:
    its speed and traced memory are this one's, so they are measured once (batchnorm_lr shares the baseline's)."""
    mine, names = p.variants[variant].model_dump(exclude=STEP_IRRELEVANT), list(p.variants)
    earlier = names[: names.index(variant)]
    return next((n for n in earlier if p.variants[n].model_dump(exclude=STEP_IRRELEVANT) == mine), None)


def variant_accum(p: Params, variant: str, plan: Plan | None, scale: str, world: int) -> int:
    """The accumulation steps a variant runs with, checked against the batch of the scale that runs."""
    v = p.variants[variant]
    setting = accum_setting(p, v)
    accum = auto_accum(plan, v.checkpointing) if setting == "auto" else setting
    check_accum(accum, p.scale_settings(scale).batch, f"scales.{scale}.batch", world=world)
    return accum


def accum_setting(p: Params, v: Variant) -> int | str:
    """What params.yaml says a variant's accum is: its own integer, or the top-level key's (an integer or auto)."""
    return v.accum if v.accum != "accum" else p.accum


def auto_accum(plan: Plan | None, checkpointing: bool) -> int:
    """accum: auto, from the planner: the fewest micro-batches that fit. Says what is missing when it cannot."""
    if plan is None:
        raise AutoUndecided(
            "params.yaml: accum = 'auto' needs the memory planner's result, reports/sweep/planner.json, "
            "which is missing: run `dvc repro sweep` first"
        )
    accum = plan.auto(checkpointing)
    if accum is None:
        budget = plan.this_machine
        usable = planner.usable_mib(budget.memory_mib, budget.safety_margin)
        raise ParamsError(
            f"params.yaml: accum = 'auto' finds nothing that fits "
            f"({'checkpointing' if checkpointing else 'accumulation'}): the planner predicts "
            f"{planner.predict_mib(plan.lines[checkpointing], 1):.0f} MiB even at micro-batch 1, over the usable "
            f"{usable:.0f} MiB of {budget.what} (memory.safety_margin {budget.safety_margin}); set accum to an "
            "integer to try"
        )
    return accum


def emulated(p: Params, hw: Hardware, precision: str) -> str | None:
    """bfloat16 on a CPU without its kernels is emulated, many times slower than float32, and says nothing of a
    GPU: not run. The text names the benchmark that measures the slowdown on the CPU it runs on."""
    if hw.device != "cpu" or precision != "bfloat16" or hw.cpu.native_bfloat16 or p.train.emulated_bfloat16:
        return None
    return (
        "this CPU has no bfloat16 kernels, so bfloat16 would be emulated in software, many times slower than "
        "float32 (`python -m benchmarks.convolutions` times both on this CPU); train.emulated_bfloat16: true "
        "trains it anyway"
    )


def over_budget(p: Params, hw: Hardware, micro: int, plan: Plan | None, world: int) -> DidNotFit | None:
    """On the CPU the kernel kills rather than raises, so a variant the planner puts over budget is not run.

    With several processes on one host, each holds its own copy: the host needs `world` times one.
    """
    if hw.device != "cpu" or plan is None:
        return None
    predicted = planner.predict_mib(plan.line, micro) * world
    budget = p.memory.host_budget_gb * planner.GIB_MIB
    if predicted <= budget:
        return None
    return DidNotFit(
        reason=f"planner predicts {predicted:.0f} MiB at micro-batch {micro}"
        + (f" in each of {world} processes" if world > 1 else "")
        + f", over memory.host_budget_gb ({budget:.0f} MiB)",
        memory_at_failure_mib=round(predicted),
        device_total_mib=round(budget),
    )
