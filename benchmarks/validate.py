"""gradaccum.fit's predictions against published measurements of real GPU training steps (docs/validation.md).

    python -m benchmarks.validate            # every row, then the summary by what was measured
    python -m benchmarks.validate --write docs/validation.json   # and the rows and summary the report shows

Every row is a figure someone measured and published, with the setup they state; the prediction is made here at
that setup, on fake tensors, and printed beside it with the ratio. Nothing is fitted to these figures: where a row
misses, docs/validation.md says what is known of why.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import timm.layers

from gradaccum import allocator, fit, outputs, params, study_trace, trace
from gradaccum.report.rules import GOALS, measured_by
from gradaccum.tutorial import CLAIMS

MESA = (
    "ziplab/Mesa README.md, 'Results on ImageNet' (Pan et al., arXiv:2111.11124): train memory at batch 128, "
    "224x224, one GPU; DeiT's training script (AMP autocast float16, AdamW), PyTorch 1.7.1, CUDA 10.1"
)
MILABENCH = (
    "mila-iqia/milabench config/scaling/H100.yaml at dc0617d1 (March 2025, PyTorch 2.6): the largest memory used "
    "that voir's monitor polled (pynvml's nvmlDeviceGetMemoryInfo, NVML's v1 figure) during a run of "
    "benchmarks/torchvision/main.py (SGD, GradScaler, the batch cast to the autocast dtype on its way to the GPU) "
    "on one H100 80GB"
)
MILABENCH_HF = (
    "mila-iqia/milabench config/scaling/H100.yaml at dc0617d1 (March 2025, PyTorch 2.6.0+cu126, transformers "
    "4.49.0): the largest memory used that voir's monitor polled (NVML's v1 figure) during a run of "
    "benchmarks/huggingface (bench/models.py's Bert: BertConfig() for masked LM, 512 random ids, every position "
    "labelled; T5: t5-small, 1024 ids in and 1024 labels) with torch.optim.Adam, no zero_grad ever, the output "
    "held through backward, autocast float16 and a GradScaler for fp16, on one H100 80GB"
)
# NVML's v1 memory info (pynvml's default) counts in `used` the memory the driver reserves, which nvidia-smi (v2)
# shows apart as "Reserved". What idle H100/H800 80GB cards show there, in nvidia-smi -q outputs published on GitHub,
# by driver; the milabench runs do not name theirs, so the median is added and the spread said (docs/validation.md).
H100_DRIVER_RESERVED_MIB = {"525.105.17": 516, "550.90.07": 336, "565.57.01": 454}
TUTORIAL = "the tutorial this study reproduces: nvidia-smi, 'about' figures, read as GiB (docs/memory.md)"


@dataclass(frozen=True)
class Published:
    """One published measurement and the setup its source states."""

    source: str
    model: str  # as gradaccum.fit takes it; study:ROLE for the tutorial's own step (params.yaml's roles)
    batch: int
    measured: str  # allocated, reserved or nvidia-smi
    mib: float
    input: tuple[int, int, int] = (3, 224, 224)
    num_classes: int = 1000
    amp: str = "float16"
    optimizer: str = "adamw"
    channels_last: bool = False
    input_dtype: str = "float32"
    torch_version: str = "2.14.1"  # the torch that measured it: its autocast lists and zero_grad, as modelled
    keep_grads: bool | None = None  # its loop keeps the gradients between steps; None: its torch's zero_grad
    hold_output: bool = False  # its loop holds the model's output through backward
    fused_attention: bool = True  # torch before 2.0 had no scaled_dot_product_attention: the maps were kept
    gpu: str = "h100"
    accum: int = 1  # micro-batches of batch / accum samples
    checkpointing: bool = False
    seq_len: int | None = None  # hf: models
    task: str | None = None
    attn: str | None = None
    context_mib: float | None = None  # the CUDA context the source itself measured, where it did (else assumed)
    nvml_v1: bool = False  # read as NVML's v1 `used`, which adds the driver's reserved memory to nvidia-smi's
    origin: str | None = None  # who measured it, where one source states several setups: counted once


def mesa(model: str, mib: float) -> Published:
    return Published(MESA, model, 128, "allocated", mib, torch_version="1.7.1", fused_attention=False)


def milabench(model: str, batch: int, amp: str, mib: float, channels_last: bool = False) -> Published:
    dtype = "float32" if amp == "float32" else amp
    return Published(MILABENCH, model, batch, "nvidia-smi", mib, amp=amp, optimizer="sgd",
                     channels_last=channels_last, input_dtype=dtype, torch_version="2.6.0", nvml_v1=True)  # fmt: skip


def milabench_hf(model: str, batch: int, amp: str, mib: float) -> Published:
    t5 = model == "hf:t5-small"
    return Published(MILABENCH_HF, model, batch, "nvidia-smi", mib, amp=amp, optimizer="adam", torch_version="2.6.0",
                     keep_grads=True, hold_output=True, seq_len=1024 if t5 else 512,
                     task="seq2seq" if t5 else "masked-lm", attn="eager" if t5 else None, nvml_v1=True,
                     origin=MILABENCH)  # fmt: skip
# transformers 4.49's T5 computes its attention itself (no _supports_sdpa); its BERT takes sdpa, as 5.x's does


HF_PERF = (
    "huggingface/transformers docs/source/en/perf_train_gpu_one.md (January 2022; its zh translation keeps the "
    "figures): bert-large-uncased for sequence classification, 512 random token ids, no attention mask, the "
    "Trainer (transformers' own AdamW, model.zero_grad(), eager attention), one V100-SXM2 16 GB, driver 460.91, "
    "CUDA 11.2; pynvml's memory.used after one epoch; CUDA's context and kernels measured there at 1343 MB"
)


def hf_perf(batch: int, accum: int, amp: str, mib: float, checkpointing: bool = False) -> Published:
    return Published(HF_PERF, "hf:bert-large-uncased", batch, "nvidia-smi", mib, amp=amp, optimizer="adamw-loop",
                     torch_version="1.10.1", gpu="v100-16gb", accum=accum, checkpointing=checkpointing,
                     seq_len=512, task="seq-cls", attn="eager", context_mib=1343 - 2)  # fmt: skip
# 1343 MB after torch.ones((1, 1)).to("cuda"): the context and kernels (CUDA 11.2 loads every kernel at start; lazy
# loading came with 11.7), less the tensor's own 2 MiB segment.


ROWS = (
    mesa("deit_tiny_patch16_224", 4171),
    mesa("deit_small_patch16_224", 8459),
    mesa("deit_base_patch16_224", 17691),
    mesa("swin_tiny_patch4_window7_224", 11812),
    # milabench's two smallest and the largest batch under 60 GB of each: a full card may have freed its cache
    milabench("torchvision:convnext_large", 64, "float32", 24989),
    milabench("torchvision:convnext_large", 144, "float32", 53069),
    milabench("torchvision:convnext_large", 64, "float16", 15089),
    milabench("torchvision:convnext_large", 256, "float16", 51665),
    milabench("torchvision:resnet50", 128, "float16", 7669, channels_last=True),
    milabench("torchvision:resnet50", 512, "float16", 25839, channels_last=True),
    milabench("torchvision:regnet_y_128gf", 32, "float16", 17835),
    milabench("torchvision:regnet_y_128gf", 128, "float16", 53581),
    hf_perf(4, 1, "float32", 14949),
    hf_perf(4, 4, "float32", 8681),
    hf_perf(4, 4, "float32", 6775, checkpointing=True),
    hf_perf(4, 1, "float16", 13939),
    hf_perf(4, 4, "float16", 7275, checkpointing=True),
    # milabench's two smallest batches and the largest under 60000 MiB
    milabench_hf("hf:bert-base-uncased", 1, "float32", 3915),
    milabench_hf("hf:bert-base-uncased", 16, "float32", 12343),
    milabench_hf("hf:bert-base-uncased", 96, "float32", 59649),
    milabench_hf("hf:bert-base-uncased", 1, "float16", 3885),
    milabench_hf("hf:bert-base-uncased", 16, "float16", 9895),
    milabench_hf("hf:bert-base-uncased", 104, "float16", 47353),
    milabench_hf("hf:t5-small", 1, "float16", 4201),
    milabench_hf("hf:t5-small", 8, "float16", 18065),
    milabench_hf("hf:t5-small", 24, "float16", 50417),
    Published(TUTORIAL, "study:baseline", CLAIMS["batch"], "nvidia-smi", CLAIMS["baseline_gb"] * 1024),
    Published(TUTORIAL, "study:tutorial_code", CLAIMS["batch"], "nvidia-smi", CLAIMS["accumulation_gb"] * 1024),
)
FIGURE = {"allocated": "allocated_mib", "reserved": "reserved_mib", "nvidia-smi": "nvidia_smi_mib"}

TIMM_BENCH = (
    "huggingface/pytorch-image-models results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv (July 2022, timm "
    "0.6.6's benchmark.py, PyTorch 1.12, CUDA 11.3, one RTX 3090 24 GB): each model starts at batch 512 and, on out "
    "of memory, retries at the next smaller of 384, 256, 192 (timm.utils.decay_batch_step); AMP float16, timm's "
    "'sgd' (Nesterov momentum), optimizer.zero_grad() (kept), a float32 batch made once on the GPU, cudnn.benchmark"
)


@dataclass(frozen=True)
class Ran:
    """A published batch that ran, or ran out of memory, on a known card: what "fits" must say."""

    source: str
    model: str
    batch: int
    ran: bool


TIMM_RUNS = (  # the CSV's batch for the model, and for those below 512 the size before it, which ran out of memory
    Ran(TIMM_BENCH, "resnet50", 512, True),
    Ran(TIMM_BENCH, "resnet50d", 384, True),
    Ran(TIMM_BENCH, "resnet50d", 512, False),
    Ran(TIMM_BENCH, "efficientnet_b0", 384, True),
    Ran(TIMM_BENCH, "efficientnet_b0", 512, False),
    Ran(TIMM_BENCH, "deit_small_patch16_224", 384, True),
    Ran(TIMM_BENCH, "deit_small_patch16_224", 512, False),
    Ran(TIMM_BENCH, "convnext_tiny", 256, True),
    Ran(TIMM_BENCH, "convnext_tiny", 384, False),
    Ran(TIMM_BENCH, "swin_tiny_patch4_window7_224", 256, True),
    Ran(TIMM_BENCH, "swin_tiny_patch4_window7_224", 384, False),
)
MARGINS = (0.0, 0.05)  # the rule as it stands, and with a 5% safety margin


def on_the_card(run: Ran, margin: float) -> dict:
    """The run's step on an RTX 3090 less `margin`: allocator.on_card's answer, and the card-with-room figures."""
    before = timm.layers.use_fused_attn()
    timm.layers.set_fused_attn(False)  # torch 1.12 had no scaled_dot_product_attention
    try:
        q = fit.Question(
            model=run.model,
            input=(3, 224, 224),
            num_classes=1000,
            batch=run.batch,
            accum=1,
            amp="float16",
            optimizer="sgd-momentum",
            torch_version="1.12.1",
            gpu=allocator.GPUS["rtx3090"],
            cards=(24.0,),
            margin=margin,
        )
        row = fit.question_engine(q).trace(run.batch, 1)
        room = {
            "allocated_mib": round(row["gpu_allocated_mib"]),
            "room_nvidia_smi_mib": round(row["gpu_nvidia_smi_mib"]),
        }
        return row["gpu_cards"][0] | room
    finally:
        timm.layers.set_fused_attn(before)


def gpu_of(row: Published) -> allocator.Gpu:
    """The row's GPU, with the context its source measured where it did."""
    gpu = allocator.GPUS[row.gpu]
    return gpu if row.context_mib is None else replace(gpu, context=round(row.context_mib * 2**20))


def driver_reserved_mib() -> float:
    """What NVML's v1 `used` adds to nvidia-smi's on an H100 whose driver is not named: the published median."""
    return statistics.median(H100_DRIVER_RESERVED_MIB.values())


def predict(row: Published) -> float:
    """The row's measured figure as gradaccum.fit predicts it at the row's setup."""
    if row.model.startswith("study:"):  # the study's own trace of the tutorial's step, at the tutorial's settings
        p = params.load()
        variant = getattr(p.roles, row.model.removeprefix("study:"))
        r = trace.trace_variant(study_trace.tutorial_settings(p), variant, "study")
        return r["gpu_" + FIGURE[row.measured]]
    before = timm.layers.use_fused_attn()
    timm.layers.set_fused_attn(row.fused_attention)  # read by timm's attention layers when they are built
    try:
        q = fit.Question(
            model=row.model,
            input=row.input,
            num_classes=row.num_classes,
            batch=row.batch,
            accum=row.accum,
            amp=row.amp,
            optimizer=row.optimizer,
            checkpointing=row.checkpointing,
            seq_len=row.seq_len,
            task=row.task,
            attn=row.attn,
            channels_last=row.channels_last,
            input_dtype=row.input_dtype,
            torch_version=row.torch_version,
            keep_grads=row.keep_grads,
            hold_output=row.hold_output,
            gpu=gpu_of(row),
            cards=(80.0,),
        )
        return fit.answer(q)[FIGURE[row.measured]] + (driver_reserved_mib() if row.nvml_v1 else 0)
    finally:
        timm.layers.set_fused_attn(before)


def row_text(row: Published) -> str:
    return (
        f"{row.model}"
        + (f" {row.task}, {row.seq_len} ids" if row.seq_len else "")
        + f", batch {row.batch}"
        + (f", accum {row.accum}" if row.accum > 1 else "")
        + f", {row.amp}, {row.optimizer}"
        + (", checkpointing" if row.checkpointing else "")
    )


def spread_text(row: Published, predicted: float) -> str:
    """What the assumptions a row rests on move it by: the driver's reserved memory, or the CUDA context."""
    if row.nvml_v1:
        low, high = min(H100_DRIVER_RESERVED_MIB.values()), max(H100_DRIVER_RESERVED_MIB.values())
        base = predicted - driver_reserved_mib()
        return (f" (with the driver's reserved {driver_reserved_mib():.0f} MiB; {low}-{high} MiB published: "
                f"{(base + low) / row.mib:.3f} to {(base + high) / row.mib:.3f})")  # fmt: skip
    if row.context_mib is not None:
        assumed = predicted - row.context_mib + allocator.CUDA_CONTEXT / 2**20
        return (f" (with the {row.context_mib:.0f} MiB context the source measured; with the assumed "
                f"{allocator.CUDA_CONTEXT / 2**20:.0f} MiB: {assumed / row.mib:.3f})")  # fmt: skip
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write",
        type=Path,
        metavar="JSON",
        help="write the rows and summary there (docs/validation.json: the report's)",
    )
    parser.add_argument("--transformers", action="store_true", help="only the hf: rows, without the summary")
    args = parser.parse_args()
    rows = []
    for row in ROWS:
        if args.transformers and not row.model.startswith("hf:"):
            continue
        predicted = predict(row)
        rows.append(asdict(row) | {"predicted_mib": round(predicted, 1), "ratio": round(predicted / row.mib, 3)})
        print(f"{row_text(row)}: {row.measured} published {row.mib:.0f} MiB, predicted {predicted:.0f} MiB, "
              f"predicted / published {predicted / row.mib:.3f}{spread_text(row, predicted)}", flush=True)  # fmt: skip
    if args.transformers:
        return
    summary = []
    for measured, goal in GOALS.items():
        ratios = [r["ratio"] for r in rows if r["measured"] == measured]
        if not ratios:
            continue
        line = {
            "measured": measured,
            "rows": len(ratios),
            "sources": len({measured_by(r) for r in rows if r["measured"] == measured}),
            "goal": goal,
            "within_goal": sum(abs(x - 1) <= goal for x in ratios),
            "median_ratio": round(statistics.median(ratios), 3),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
        }
        summary.append(line)
        print(
            f"{measured}: {line['rows']} rows from {line['sources']} source(s); {line['within_goal']} within "
            f"{goal:.0%}; predicted / published median {line['median_ratio']:.3f} ({line['min_ratio']:.3f} to "
            f"{line['max_ratio']:.3f})"
        )
    runs = []
    for run in TIMM_RUNS:
        cards = {margin: on_the_card(run, margin) for margin in MARGINS}
        runs.append(asdict(run) | {"margins": {str(m): c for m, c in cards.items()}})
        said = "; ".join(
            f"margin {m:.0%}: " + ("fits" + (f" ({c['cache_frees']} cache frees)" if c["cache_frees"] else ""))
            if c["fits"]
            else f"margin {m:.0%}: does not fit"
            for m, c in cards.items()
        )
        endless = cards[0.0]
        print(
            f"{run.model}, batch {run.batch} on an RTX 3090: {'ran' if run.ran else 'out of memory'}; allocated "
            f"{endless['allocated_mib']} MiB, nvidia-smi with room {endless['room_nvidia_smi_mib']} MiB; {said}",
            flush=True,
        )
    for margin in MARGINS:
        cards = [(r["ran"], r["margins"][str(margin)]) for r in runs]
        agree = sum(c["fits"] == ran for ran, c in cards)
        before = sum((c["room_nvidia_smi_mib"] <= c["usable_mib"]) == ran for ran, c in cards)
        print(
            f"fits or not, margin {margin:.0%}: {agree} of {len(runs)} agree with what ran (the figure on a card "
            f"with room within the card, the rule before the allocator freed its cache: {before})"
        )
    if args.write:
        command = f"python -m benchmarks.validate --write {args.write}"
        outputs.write_json(args.write, {"command": command, "summary": summary, "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
