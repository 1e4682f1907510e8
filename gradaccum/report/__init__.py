"""The study's report: what accumulation saved, what it cost, and whether it is still the same training.

`build` assembles one `Report` (document.py) from the pipeline's records: the numbers and verdicts
worked out once (findings.py, against the thresholds in rules.py), worded by subject (claims.py, throughput.py,
levers.py, planning.py, variants.py, traced.py) and drawn (figures.py). The `report`
stage reads the files and writes report.md, report.html and the figures.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import yaml

from gradaccum import planner
from gradaccum.params import Params
from gradaccum.records import Cpu, Hardware, Plan
from gradaccum.report import claims, figures, findings, levers, planning, rules, throughput, traced, variants
from gradaccum.report.document import Report
from gradaccum.report.results import Results, load_variants

__all__ = ["Inputs", "Report", "build", "load_variants"]
OUTPUTS = ("data/", "reports/")  # where pipeline stages write


@dataclass
class Inputs:
    """Everything the report reads, loaded: the params, the machine, the data's provenance, every record."""

    params: Params
    hardware: Hardware
    provenance: dict[str, Any]
    results: Results
    plan: Plan | None = None  # the sweep's result
    grad: dict[str, Any] | None = None  # the gradient check's
    speed: dict[str, Any] | None = None  # the speed stage's interleaved rounds
    trace: dict[str, Any] | None = None  # the trace stage's peaks, both scales
    validation: dict[str, Any] | None = None  # gradaccum.fit against published GPU measurements (docs/)
    snapshots: dict[str, str] | None = None  # variant -> nvidia-smi text at its peak (GPU)
    histories: dict[str, tuple[str, int]] | None = None  # variant -> (PyTorch memory snapshot file, bytes)


def carries_over(plan: Plan | None) -> str:
    """What a CPU run says about a GPU, and what it does not: the banner over a CPU-scale report."""
    fixed = f" (here {plan.line.fixed_mib:.0f} MiB, the sweep's line)" if plan else ""
    return (
        "What carries over to a GPU: whether accumulation gives the same gradient and loss (the same arithmetic), "
        "and which way each memory lever moves the peak. What does not: the sizes of the memory ratios, since "
        f"every CPU peak holds the interpreter and its libraries{fixed}, which a GPU's peak does not (the GPU "
        "column predicts those), nor speed, absolute memory or accuracy."
    )


def build(inputs: Inputs, found: findings.Findings) -> Report:
    """The report of `inputs`, worded from `found` (findings.findings of the same inputs)."""
    hw, p = inputs.hardware, inputs.params
    rep = Report(title=f"Gradient accumulation study: {hw.scale} scale on {hw.device}")
    if hw.scale != "study":
        scale = p.scale_settings(hw.scale)
        rep.stamp = f"{hw.scale.upper()} SCALE - not the tutorial's study"
        rep.banner(
            f"{rep.stamp}: {scale.train_samples:,} images, effective batch {scale.batch}, {scale.epochs} "
            f"epochs on {hw.device}; memory is host RSS, not GPU memory. {carries_over(inputs.plan)}"
        )
    rep.heading("What this run found")
    predicted = traced.gpu_answers(inputs.trace, p.roles) if inputs.trace else {}
    rep.table(claims.answers(found, inputs.grad, hw.device, predicted))
    rep.heading("The tutorial's claims against this run")
    within = f"A claim holds where what was measured or predicted is within {rules.CLAIM:.0%} of it"
    rep.text(within + ' (its figures are "about" figures from one run).')
    study_on_gpu = hw.scale == "study" and hw.device == "cuda"
    gpu_figures = traced.tutorial_claims(inputs.trace, inputs.results, study_on_gpu, p.roles) if inputs.trace else []
    rep.table(gpu_figures + claims.claims_table(found, inputs.grad))
    rep.text(claims.steps_note(p, hw.scale))
    seed_section(rep, inputs.results, p.seeds)
    lever_section(rep, found)
    if inputs.speed:
        speed_section(rep, found, inputs.speed)
    figures.epoch_figures(rep, inputs.results, p.roles)
    figures.memory_timeline(rep, inputs.results, hw.device, p.roles)
    figures.peak_memory(rep, inputs.results, hw.device)
    cards = planner.cards_for(inputs.plan, p.memory.cards_gb, p.memory.safety_margin) if inputs.plan else []
    if inputs.plan:
        figures.sweep(rep, inputs.plan, cards)
    if inputs.grad:
        gradcheck_section(rep, inputs.grad)
    if inputs.plan:
        planner_section(rep, inputs.plan, cards, found)
    if inputs.trace:
        trace_section(rep, inputs)
    if hw.device == "cuda":
        nvidia_smi_section(rep, inputs)
    time_section(rep, inputs)
    rep.heading("Variants")
    rep.text(
        "Every variant's record. Their images/s come from training runs made one after another, which carry the "
        "machine's drift: no ratio is taken from them (the speed comparisons above are interleaved)."
    )
    rep.table(variants.variants_table(inputs.results), explain_once=("cuDNN",))
    what_ran(rep, p, hw, inputs.provenance)
    return rep


def cpu_kernels(cpu: Cpu) -> str:
    """The kernels a CPU run summed with, where the record knows them: losses move with them (docs/results.md)."""
    if cpu.kernels is None:
        return ""
    held = f", oneDNN held to {cpu.onednn_max_isa}" if cpu.onednn_max_isa else ""
    return f", ATen's {cpu.kernels} kernels{held}"


def what_ran(rep: Report, p: Params, hw: Hardware, prov: dict[str, Any]) -> None:
    """Provenance: scale, machine, data and its checksums, training settings, versions, the commit."""
    rep.heading("What ran")
    scale = p.scale_settings(hw.scale)
    where = (
        f"{hw.gpu.name} ({hw.gpu.memory_total_mib:.0f} MiB), driver {hw.gpu.driver}, CUDA {hw.gpu.cuda}"
        if hw.gpu and hw.device == "cuda"
        else f"CPU only: {hw.cpu.name}, {hw.cpu.cores} cores{cpu_kernels(hw.cpu)}"
    )
    label = "the tutorial's study" if hw.scale == "study" else "the CPU scale (smaller than the tutorial's study)"
    fallback = " - the 5,000-digit fallback sample, NOT the full MNIST" if prov["kind"] == "fallback" else ""
    counts = f"{prov['counts']['train']} train / {prov['counts']['test']} test images"
    rows = [
        ("scale", f"{hw.scale}: {label}"),
        ("hardware", where),
        ("dataset", f"{prov['dataset']} from {prov['kind']}{fallback}: {counts}"),
        ("data source", str(prov["source"])),
        *((f"file {name}", f"md5 {f['md5']} ({f['from']})") for name, f in prov["files"].items()),
        (
            "training",
            f"{scale.train_samples} samples (at most), effective batch {scale.batch}, {scale.epochs} "
            f"epochs, AdamW (weight decay {p.train.weight_decay}), seed {p.seed}, model {p.model.name}",
        ),
        ("precision", f"CUDA: {p.train.amp_cuda}, CPU: {p.train.amp_cpu}"),
        ("accum", str(p.accum)),
        ("versions", f"torch {version('torch')}, timm {version('timm')}, dvc {version('dvc')}"),
        ("git commit", git_state()),
    ]
    rep.table([{"": key, "value": value} for key, value in rows])
    rep.details("The params that ran (params.yaml)", yaml.safe_dump(p.model_dump(), sort_keys=False))


def seed_section(rep: Report, results: Results, seeds: int) -> None:
    """What another seed gives: the yardstick every loss and accuracy difference above is held against."""
    rows = variants.seed_rows(results)
    rep.heading("Seeds: what another seed gives")
    if seeds < 2 or not any(len(r.record.seeds) > 1 for r in results.values()):
        rep.text(
            "One seed per variant (params.yaml `seeds: 1`): the loss and accuracy differences above are not held "
            "against a seed spread, so none of them is a finding yet. `dvc exp run -S seeds=3` runs each variant "
            "with three seeds."
        )
        return
    rep.text(
        f"Each variant ran with {seeds} seeds (seed, seed + 1, ...: the model's initial weights and the data's "
        "order); the curves, memory and speed are the first seed's. A difference is called larger than the seed "
        "spread when the two means differ by more than the wider of the two variants' ranges over seeds."
    )
    rep.table(rows)


def lever_section(rep: Report, found: findings.Findings) -> None:
    rows = levers.lever_table(found)
    if not rows:
        return
    reference, control = found.roles.norm_control, found.role("norm_control")
    what = ", ".join(claims.facets(control, found.groups).values())
    rep.heading("The memory levers side by side")
    rep.text(
        f"The same work as the {reference} control ({what}, the same batch), with one lever or "
        "two. Checkpointing recomputes the blocks' activations in backward instead of keeping them; it is "
        "kept away from BatchNorm, whose running statistics it would update twice per forward "
        "(pytorch#96136). Throughput comes from the speed stage, which interleaves the variants."
    )
    rep.table(rows)
    if found.speed:
        figures.levers(rep, rows, found.speed, reference)


def speed_section(rep: Report, found: findings.Findings, speed: dict[str, Any]) -> None:
    rep.heading("Speed, measured fairly")
    rep.text(
        f"Every variant's training step timed in {speed['rounds']} rounds of {speed['steps']} optimizer step(s) at "
        f"effective batch {speed['batch']}, the variants interleaved in an order that rotates each round (after "
        "one warm-up round), so the machine's drift hits them alike; each ratio is taken within a round, then "
        "the median and the range over rounds are shown. One process. A variant is called faster or slower "
        f"only when every round agrees (a sign test: its p-value is shown, {findings.sign_test_p(5):.2g} for five "
        "rounds); otherwise the "
        "difference is within the rounds' spread, and more rounds (speed.rounds) or steps (speed.steps) would "
        "resolve a smaller one."
    )
    rep.table(throughput.speed_rows(found, speed))
    figures.throughput(rep, speed)


def gradcheck_section(rep: Report, grad: dict[str, Any]) -> None:
    rep.heading("Is the accumulated gradient the large-batch gradient?")
    rep.text(
        "Relative difference ‖g_accum − g_full‖ / ‖g_full‖ "
        f"measured through the training loop itself ({grad['through']}): an epoch of {grad['samples']} "
        f"images, batch {grad['batch']}, each window's gradient against the full-batch gradient of its "
        f"samples, the larger of its {grad['windows']} windows; {grad['precision']}, on {grad['device']}."
    )
    rep.table(variants.gradcheck_rows(grad))
    figures.gradcheck(rep, grad)


def nvidia_smi_section(rep: Report, inputs: Inputs) -> None:
    rep.heading("nvidia-smi at each variant's peak")
    snapshots, histories = inputs.snapshots or {}, inputs.histories or {}
    for name, r in inputs.results.items():
        fallback = r.record.memory.nvidia_smi_fallback
        rep.text(f"{name}:" + (f" {fallback}" if fallback else ""))
        rep.pre(snapshots.get(name, "no snapshot"))
        if name in histories:
            file, size = histories[name]
            rep.text(
                f"PyTorch memory snapshot of {name}'s first optimizer step: {file} ({size / 2**20:.1f} MiB); drop "
                "it on pytorch.org/memory_viz to see what held memory at the peak."
            )


def trace_section(rep: Report, inputs: Inputs) -> None:
    """The traced peaks: the study scale by kind (against the GPU's figures where one ran), the GPU card table
    from the trace, and the CPU scale held against real allocations."""
    hw, p, trace = inputs.hardware, inputs.params, inputs.trace
    on_gpu = hw.scale == "study" and hw.device == "cuda"
    study = p.scale_settings("study")
    rep.heading("Predicted without a GPU: the traced peak")
    rep.text(
        "Each variant's training step run on fake tensors (shapes, no storage) under PyTorch's MemTracker, which "
        "sorts the bytes live at the step's peak by kind: `dvc repro trace` on any machine, `python -m "
        "gradaccum.cards` for other params. The study scale follows CUDA's autocast rules, not the CPU's: "
        "PyTorch's CUDA lists, emulated op by op on the CPU (gradaccum/autocast_policy.py), so GroupNorm and "
        "what follows it are float32 as on a GPU (CPU autocast would keep them float16); the policy column "
        "says which rules each row followed. The step's allocations and frees, replayed through a model of "
        "PyTorch's CUDA caching allocator (gradaccum/allocator.py: 512-byte rounding, 2 MiB small and 20 MiB "
        "large segments, best fit with splitting, nothing returned), predict torch.cuda's allocated and reserved "
        "peaks; nvidia-smi's adds the CUDA context, an assumption listed below."
        + (
            " Beside each prediction, what this GPU measured."
            if on_gpu
            else f" No GPU ran here: the goals (allocated within {rules.GOALS['allocated']:.0%} of "
            f"torch.cuda.max_memory_allocated, reserved within {rules.GOALS['reserved']:.0%}, nvidia-smi within "
            f"{rules.GOALS['nvidia-smi']:.0%}) wait for `scripts/gpu_check.sh` on one."
        )
    )
    measured = traced.measured_ratios(trace, inputs.results) if on_gpu else {}
    rep.table(traced.study_rows(trace, measured), explain_once=("policy",))
    if on_gpu:
        rep.text("Predicted against measured: " + traced.gpu_verdicts(measured))
    if inputs.validation:
        rep.text(traced.validation_summary(inputs.validation))
    if finding := traced.groupnorm_cost(trace, inputs.params.roles):
        rep.text(finding)
    rep.text("What the nvidia-smi predictions assume on top of the traced tensors and the allocator's rules:")
    rep.table(traced.assumptions(trace))
    rep.text(
        f"GPU cards at the study scale (effective batch {study.batch}), from the trace: the fewest micro-batches "
        f"whose step, its allocations replayed on the card less {p.memory.safety_margin:.0%} and the context, "
        "never runs out of memory (a line through two traced sizes proposes it; it is traced and replayed itself), "
        'and its nvidia-smi figure there. "cache freed": it fits only as the allocator releases its unused '
        "segments and retries, as PyTorch's does, which is slower (docs/validation.md: fits or not on a full card)"
        + (" (measured on this GPU in the sweep's points)." if on_gpu else ".")
    )
    rep.table(traced.traced_card_rows(trace))
    cpu_results = inputs.results if hw.scale == "cpu" else {}
    rep.text(
        "The CPU scale, where the trace can be held against real tensors: the same step run for real with the "
        "profiler recording every allocation and free of PyTorch's CPU allocator (its peak, kernels' own "
        "workspaces included)"
        + (
            "; and the training run's peak RSS less the sweep's fixed part (a fit), which is not the live "
            "tensors: the C library keeps freed blocks in its heap, so the two differ either way."
            if cpu_results
            else "."
        )
    )
    rep.table(traced.cpu_rows(trace, cpu_results, inputs.plan))
    rep.text(traced.cpu_note(trace))


def planner_section(rep: Report, plan: Plan, cards: list[dict[str, Any]], found: findings.Findings) -> None:
    machine, line = plan.this_machine, plan.line
    fastest = planning.options_text(planner.this_machine_options(plan)[:1])
    rep.heading("Which card fits: the memory planner")
    rep.text(
        f"The planner predicts from the sweep's peaks ({plan.measure}): between two measured micro-batches it "
        "joins their peaks, beyond them it follows the line fitted to all of them, peak = "
        f"{line.fixed_mib:.0f} MiB + {line.per_sample_mib:.4f} MiB per sample (r2 {line.r2:.4f}); a line "
        "alone lies under part of a bent curve, the direction that ends in out of memory. For effective batch "
        f"{plan.batch}, leaving "
        f"{machine.safety_margin:.0%} free. On this machine ({machine.memory_mib:.0f} MiB, {machine.what}), "
        f"accum: auto is {plan.auto_accum} (with checkpointing: {plan.auto_accum_checkpointing}); the "
        f"fastest option that fits here: {fastest}. The speeds are the sweep's own (a few steps, warm-up included, "
        "one run: a stall of the machine can reorder them), so at the same accum the plain option is put first: "
        "checkpointing does its work and recomputes the forward on top."
        + (
            " These are host-memory figures from the CPU scale; a GPU run gives the GPU table."
            if plan.device == "cpu"
            else ""
        )
    )
    rep.table(planning.planner_card_rows(cards))
    rep.text(
        "The planner against every variant's training run: its prediction for the variant's micro-batch (per "
        "process) and the peak the run measured. A prediction under the measurement by more than the safety "
        "margin is flagged: that is the direction that ends in an out-of-memory error."
    )
    rep.table(planning.planner_rows(found.planner))


def time_section(rep: Report, inputs: Inputs) -> None:
    rows = variants.time_rows(inputs.results, inputs.plan, inputs.grad, inputs.speed, inputs.trace)
    if not rows:
        return
    rep.heading("Where this run's time went")
    emulated = inputs.hardware.device == "cpu" and not inputs.hardware.cpu.native_bfloat16
    rep.text(
        "Wall time of each stage's process, start-up and imports included, from its own record (hardware, "
        "download and report take seconds and are not timed), split into the study's computation (the sweep's "
        "points, the gradient check, the speed stage's timed rounds, each variant's training loop) and the rest. "
        "`python -m benchmarks.repro` times a whole `dvc repro` on a fresh clone, DVC's own time included."
        + (
            f" This CPU ({inputs.hardware.cpu.name}) has no native bfloat16, so bfloat16 autocast is emulated and "
            "runs far slower than float32 here."
            if emulated
            else ""
        )
    )
    rep.table(rows)


def git_state() -> str:
    """The commit the report was made from, and whether the code or params differed from it.

    What the pipeline itself writes while it runs (dvc.lock, the .gitignore files DVC adds, data/ and
    reports/) is not a change to what ran; an experiment's params.yaml or an edited module is.
    """
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty.splitlines()]
    changed = [f for f in changed if f != "dvc.lock" and not f.endswith(".gitignore") and not f.startswith(OUTPUTS)]
    return commit.strip() + (f", with uncommitted changes to {', '.join(changed[:8])}" if changed else ", clean tree")
