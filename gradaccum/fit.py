"""Will it fit my card? One training step of any model traced on fake tensors, under CUDA's rules, no GPU needed.

    python -m gradaccum.fit resnet50 --input 3x224x224 --num-classes 1000 --batch 256 --amp float16
    python -m gradaccum.fit torchvision:vit_b_16 --input 3x224x224 --num-classes 1000 --batch 64 --gpu a100-40gb
    python -m gradaccum.fit efficientnet_b0 --batch 32768 --json          # the study's model and input

The step is the study's engine (gradaccum/trace.py): the model built on fake tensors (shapes, no storage), the
optimizer in its steady state, a batch of the input's shape arriving as a DataLoader delivers it, forward and
backward under autocast with CUDA's lists (gradaccum/autocast_policy.py), the optimizer step; its allocations
replayed through a model of CUDA's caching allocator (gradaccum/allocator.py) predict torch.cuda's
max_memory_allocated and max_memory_reserved, and nvidia-smi's figure with the CUDA context on top. A card fits
when the same allocations, replayed on the card less the margin, never run out of memory (the allocator freeing
its cache and retrying where a new segment would not fit); where they do, the smallest accum that fits (itself
traced and replayed), and what activation checkpointing or the other precision would need instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from gradaccum import allocator, autocast_policy, planner, trace
from gradaccum.accumulation import accum_for, fewest_for_micro, micro_batch_size, next_accum, previous_accum
from gradaccum.choices import DEFAULT_CARDS
from gradaccum.refusal import BadInput
from gradaccum.sources import Source, Untraceable, function_source, image_source
from gradaccum.spec import AMP_DTYPES, RunSpec, other_precision

PRINTED_KINDS = {  # the trace's kinds -> what the printout calls them
    "weights": ("parameters_mib", "buffers_mib"),
    "gradients": ("gradients_mib",),
    "optimizer state": ("optimizer_mib",),
    "activations": ("activations_mib",),
    "temporaries": ("temporaries_mib",),
    "other (resident data)": ("data_mib",),  # the input batch is an activation: the first layer saves it
}


@dataclass(frozen=True, kw_only=True)
class Question:
    """What a person with a model, a batch and a card asks: every setting of the step, and the cards."""

    model: str  # a timm name, torchvision:NAME or hf:NAME; with model_fn, a label
    input: tuple[int, int, int] = (1, 28, 28)
    num_classes: int = 10
    batch: int = 256  # the effective batch: samples per optimizer step
    accum: int | None = None  # None: the smallest that fits each card
    amp: str = "float16"
    optimizer: str = "adamw"
    checkpointing: bool = False
    channels_last: bool = False
    input_dtype: str = "float32"  # as the batch reaches the device: a loop's .to(device, dtype) may cast it
    torch_version: str = autocast_policy.PINNED_TORCH  # an older torch's autocast lists and zero_grad (TracedStep)
    keep_grads: bool | None = None  # gradients stay allocated between steps; None: the torch's zero_grad default
    hold_output: bool = False  # the loop holds the model's output (logits) until backward is done
    gpu: allocator.Gpu = allocator.STUDY_GPU
    cards: tuple[float, ...] = DEFAULT_CARDS
    margin: float = 0.05  # left free on every card, as params.yaml's memory.safety_margin
    seq_len: int | None = None  # token ids per sample (hf:, or a model_fn fed tokens)
    vocab: int | None = None  # a model_fn's token ids are below it
    task: str | None = None  # hf: the task (gradaccum.hf.TASKS); None: the configuration's
    attn: str | None = None  # hf: eager or sdpa; None: what transformers picks
    lora: int | None = None  # hf: peft's LoRA of this rank, the base frozen
    model_fn: str | None = None  # FILE.py:FUNCTION or package.module:FUNCTION returning an nn.Module
    loss_fn: str | None = None  # the same syntax: loss(output, labels)


def question_source(q: Question) -> Source:
    """Where the question's model comes from (gradaccum/sources.py, gradaccum/hf.py); refused in one line if it
    cannot be had."""
    if q.model_fn:
        return function_source(q.model_fn, q.input, q.num_classes, q.seq_len, q.vocab, q.loss_fn)
    if q.model.startswith("hf:"):
        from gradaccum.hf import hf_source  # transformers is an extra: imported only when asked for

        return hf_source(q.model.removeprefix("hf:"), q.seq_len or 512, q.task, q.attn, q.lora)
    return image_source(q.model, q.input, q.num_classes)


def fake_safe(build: Callable[[bool], nn.Module], checkpointing: bool) -> Callable[[], nn.Module]:
    """`build` under fake tensors; a model whose construction reads a value (which a fake tensor has not) is built
    for real on the CPU instead and its weights and buffers made fake in the trace's own mode."""

    def make() -> nn.Module:
        try:
            return build(checkpointing)
        except Untraceable:
            raise
        except Exception:  # a value read at construction: build it for real, then fake
            with unset_fake_temporarily():
                model = build(checkpointing)
            mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            for module in model.modules():
                for key, p in module._parameters.items():
                    if p is not None:
                        module._parameters[key] = nn.Parameter(mode.from_tensor(p), p.requires_grad)
                for key, b in module._buffers.items():
                    if b is not None:
                        module._buffers[key] = mode.from_tensor(b)
            return model

    return make


@dataclass
class Engine:
    """One model's step traced at the sizes a question needs, each trace made once: by micro-batch, whether a
    window's gradients are held (accum > 1), checkpointing and precision. The study's variants (gradaccum.cards)
    and any model (`answer`) go through it alike; `make` builds the step of each."""

    name: str
    batch: int  # the effective batch
    make: Callable[[int, int, bool, str], trace.TracedStep]  # (micro-batch, accum, checkpointing, amp) -> the step
    checkpointing: bool = False  # the step's own
    amp: str = "float16"
    policy: str = autocast_policy.CUDA  # whose autocast rules: a GPU's, or the CPU's for the CPU scale
    gpu: allocator.Gpu = allocator.STUDY_GPU
    cards_mib: tuple[float, ...] = ()  # the usable MiB of each card asked about: every trace is replayed on each
    traces: dict[tuple[int, bool, bool, str], dict[str, Any]] = field(default_factory=dict)

    def trace(
        self, micro: int, accum: int, checkpointing: bool | None = None, amp: str | None = None
    ) -> dict[str, Any]:
        ckpt, amp = self.checkpointing if checkpointing is None else checkpointing, amp or self.amp
        key = (micro, accum > 1, ckpt, amp)
        if key not in self.traces:
            try:
                step = self.make(micro, accum, ckpt, amp)
                self.traces[key] = trace.trace_step(step, self.policy, self.gpu, self.cards_mib)
            except BadInput:
                raise
            except Exception as err:  # one line naming the model and the reason, never a traceback
                why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
                raise Untraceable(f"{self.name}: cannot be traced ({type(err).__name__}: {why})") from None
        return self.traces[key]

    def need(self, accum: int, checkpointing: bool | None = None, amp: str | None = None) -> float:
        """The MiB a card must hold for the batch in `accum` micro-batches: nvidia-smi's predicted figure under
        CUDA's rules, the live tensors' peak under the CPU's (trace.figure)."""
        return trace.figure(self.trace(micro_batch_size(self.batch, accum), accum, checkpointing, amp))

    def on_card(
        self, accum: int, usable: float, checkpointing: bool | None = None, amp: str | None = None
    ) -> dict[str, Any]:
        """The step at `accum` on a card leaving `usable` MiB (one of `cards_mib`): allocator.on_card's replay, the
        allocator freeing its cache where a segment would not fit. Under the CPU's rules (no allocator to
        replay) it fits when the traced peak does."""
        row = self.trace(micro_batch_size(self.batch, accum), accum, checkpointing, amp)
        for card in row.get("gpu_cards", ()):
            if card["usable_mib"] == round(usable):
                return card
        if self.policy != autocast_policy.CPU:
            raise ValueError(f"{usable:.0f} MiB is not one of the engine's cards {self.cards_mib}")
        return {"usable_mib": round(usable), "fits": row["peak_mib"] <= usable, "nvidia_smi_mib": row["peak_mib"]}

    def fits(self, accum: int, usable: float, checkpointing: bool | None = None, amp: str | None = None) -> bool:
        return self.on_card(accum, usable, checkpointing, amp)["fits"]

    def smallest_accum_by_replay(
        self, usable: float, checkpointing: bool | None = None, amp: str | None = None
    ) -> int | None:
        """The fewest micro-batches whose step fits a card leaving `usable` MiB (`on_card`); None if micro-batches
        of two samples do not (one sample cannot train a BatchNorm model). Proposed by the planner's search on a
        line through two traced sizes' nvidia-smi figures on an endless card (backward's part grows with the
        micro-batch), then replayed on the card itself: raised until it fits, lowered while the one below fits
        too (freeing the cache can fit a step whose endless-card figure does not)."""
        batch = self.batch
        if self.fits(1, usable, checkpointing, amp):
            return 1
        low = min(2, batch)
        smallest = accum_for(batch, low)  # the accum of micro-batches of `low` samples
        if smallest == 1 or not self.fits(smallest, usable, checkpointing, amp):
            return None
        high = max(low + 1, batch // 2)
        rows = (
            self.trace(low, 2, checkpointing, amp),
            self.trace(high, 2, checkpointing, amp),
        )  # a window's gradients held
        line = trace.peak_line((low, high), rows)
        accum = fewest_for_micro(batch, max(2, planner.smallest_accum_by_line(line, usable, batch) or smallest))
        while accum < smallest and not self.fits(accum, usable, checkpointing, amp):
            accum = next_accum(batch, accum)
        while accum > 2 and self.fits(previous_accum(batch, accum), usable, checkpointing, amp):
            accum = previous_accum(batch, accum)
        return accum


def question_engine(q: Question, source: Source | None = None) -> Engine:
    """The engine of a question's step: its model (from `source`, else the question's), fed a DataLoader's
    batches, nothing resident."""
    source = source or question_source(q)

    def make(micro: int, accum: int, checkpointing: bool, amp: str) -> trace.TracedStep:
        return trace.TracedStep(
            build=fake_safe(source.build, checkpointing),
            micro=micro,
            accum=accum,
            num_classes=q.num_classes,
            dtype=AMP_DTYPES[amp],
            resident=0,
            input=q.input,
            arrives=q.input_dtype,
            optimizer=q.optimizer,
            channels_last=q.channels_last,
            torch_version=q.torch_version,
            keep_grads=q.keep_grads,
            hold_output=q.hold_output,
            feed=source.feed,
            loss=source.loss,
        )

    usable = tuple(planner.card_usable_mib(card, q.margin) for card in q.cards)
    return Engine(source.name, q.batch, make, q.checkpointing, q.amp, autocast_policy.CUDA, q.gpu, usable)


def spec_engine(spec: RunSpec, cards_mib: tuple[float, ...] = ()) -> Engine:
    """The engine of a study variant's step (a resolved RunSpec): its model, its resident data, its device's rules;
    each trace replayed on cards leaving `cards_mib`."""

    def make(micro: int, accum: int, checkpointing: bool, amp: str) -> trace.TracedStep:
        return trace.TracedStep.of(spec.at(accum=accum, checkpointing=checkpointing, amp=amp).at_micro(micro))

    return Engine(
        spec.variant,
        spec.batch,
        make,
        spec.checkpointing,
        spec.amp,
        autocast_policy.of_device(spec.device),
        cards_mib=cards_mib,
    )


def option(engine: Engine, accum: int | None, usable: float, checkpointing: bool, amp: str) -> dict[str, Any] | None:
    """An accum that fits the card, with the nvidia-smi figure it has there and how often the allocator had to
    free its cache to fit (0: it never needed to; more: it runs, slower than on a card with room)."""
    if accum is None:
        return None
    card = engine.on_card(accum, usable, checkpointing, amp)
    return {
        "accum": accum,
        "micro_batch": micro_batch_size(engine.batch, accum),
        "checkpointing": checkpointing,
        "amp": amp,
        "nvidia_smi_mib": round(card["nvidia_smi_mib"], 1),
        "cache_frees": card.get("cache_frees", 0),
    }


def answer(q: Question) -> dict[str, Any]:
    """The prediction at the question's accum (1 when it leaves accum to this), and per card whether it fits, the
    smallest accum that does, and what checkpointing or the other precision would need instead."""
    source = question_source(q)
    engine = question_engine(q, source)
    accum = q.accum or 1
    row = engine.trace(micro_batch_size(q.batch, accum), accum, q.checkpointing, q.amp)
    out: dict[str, Any] = {
        "model": source.name,
        "input": source.input,
        "notes": list(source.notes),
        "batch": q.batch,
        "accum": accum,
        "micro_batch": micro_batch_size(q.batch, accum),
        "amp": q.amp,
        "optimizer": q.optimizer,
        "keep_grads": not engine.make(1, accum, q.checkpointing, q.amp).set_to_none,  # asked, or the torch's
        "hold_output": q.hold_output,
        "checkpointing": q.checkpointing,
        "channels_last": q.channels_last,
        "input_dtype": q.input_dtype,
        "gpu": q.gpu.name,
        "autocast_policy": row["autocast_policy"],
        "attention": row.get("attention"),
        "tensors_mib": {kind: round(sum(row[k] for k in keys), 1) for kind, keys in PRINTED_KINDS.items()},
        "allocated_mib": round(row["gpu_allocated_mib"], 1),
        "reserved_mib": round(row["gpu_reserved_mib"], 1),
        "nvidia_smi_mib": round(row["gpu_nvidia_smi_mib"], 1),
        "context_mib": round(row["gpu_context_mib"], 1),
        "cards": [],
    }
    other = other_precision(q.amp, "cuda")
    for card, usable in zip(q.cards, engine.cards_mib, strict=True):
        on_card = engine.on_card(accum, usable)
        entry: dict[str, Any] = {"card_gb": card} | on_card
        smallest = engine.smallest_accum_by_replay(usable, q.checkpointing, q.amp)  # fewer than --accum may fit too
        entry["smallest_accum"] = option(engine, smallest, usable, q.checkpointing, q.amp)
        if not on_card["fits"]:  # what the other levers would need instead
            if not q.checkpointing and source.checkpointing:  # a model without a switch has no such lever
                with_ckpt = engine.smallest_accum_by_replay(usable, True, q.amp)
                entry["with_checkpointing"] = option(engine, with_ckpt, usable, True, q.amp)
            entry["other_precision"] = option(
                engine, engine.smallest_accum_by_replay(usable, q.checkpointing, other), usable, q.checkpointing, other
            )
        out["cards"].append(entry)
    return out


def option_text(o: dict[str, Any] | None, with_amp: bool = False) -> str:
    if o is None:
        return "does not fit even at micro-batch 2"
    amp = f", {o['amp']}" if with_amp else ""
    text = f"accum {o['accum']} (micro-batch {o['micro_batch']}{amp}): {o['nvidia_smi_mib'] / 1024:.1f} GiB"
    return text + (FREES if o["cache_frees"] else "")


# Said wherever a step fits only because the allocator frees its cache (allocator.on_card): it runs, slower.
FREES = ", fitting only as the allocator frees its cache and retries (slower)"


def attention_text(attention: dict[str, Any]) -> str:
    """Which kernel CUDA's scaled_dot_product_attention took (gradaccum/attention.py), and why not the earlier ones."""
    taken = ", ".join(f"{kernel} x {n}" for kernel, n in attention["kernels"].items())
    why = f" (passed over: {'; '.join(attention['passed_over'])})" if attention["passed_over"] else ""
    return f"attention as CUDA selects it on this GPU: {taken}{why}"


def printout(a: dict[str, Any]) -> str:
    """The answer for a reader: what was traced, its tensors by kind, the three predicted figures, each card."""
    gib = {k: f"{v / 1024:.2f}" for k, v in a["tensors_mib"].items()}
    lines = [
        f"{a['model']}: input {a['input']}, batch {a['batch']} as {a['accum']} x "
        f"{a['micro_batch']}, {a['amp']} autocast, {a['optimizer']}"
        + (", gradients kept between steps" if a["keep_grads"] else "")
        + (", the output held through backward" if a["hold_output"] else "")
        + (", activation checkpointing" if a["checkpointing"] else "")
        + (", channels-last" if a["channels_last"] else "")
        + (f", the batch arriving as {a['input_dtype']}" if a["input_dtype"] != "float32" else "")
        + f"; on {a['gpu']}, under {a['autocast_policy']}",
        *a["notes"],
        *([attention_text(a["attention"])] if a["attention"] else []),
        "traced tensors at the step's peak (GiB): " + ", ".join(f"{k} {v}" for k, v in gib.items()),
        f"predicted: torch.cuda.max_memory_allocated {a['allocated_mib'] / 1024:.2f} GiB, max_memory_reserved "
        f"{a['reserved_mib'] / 1024:.2f} GiB, nvidia-smi {a['nvidia_smi_mib'] / 1024:.2f} GiB (with an assumed "
        f"{a['context_mib']:.0f} MiB CUDA context)",
        "",
    ]
    for c in a["cards"]:
        head = f"{c['card_gb']:g} GB card ({c['usable_mib']} MiB usable): "
        if c["fits"]:
            frees = FREES if c["cache_frees"] else ""
            lines.append(head + f"fits{frees}; smallest accum: {option_text(c['smallest_accum'])}")
            continue
        lines.append(
            head
            + f"does not fit at accum {a['accum']}; smallest accum: {option_text(c['smallest_accum'])}; "
            + (f"with checkpointing: {option_text(c['with_checkpointing'])}; " if "with_checkpointing" in c else "")
            + f"in the other precision: {option_text(c['other_precision'], with_amp=True)}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m gradaccum.fit`, the older spelling of gradaccum-fit (gradaccum/cli.py)
    import runpy

    runpy.run_module("gradaccum.cli", run_name="__main__")
