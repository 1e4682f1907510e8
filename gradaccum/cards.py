"""Will it fit on my card? Every variant's traced peak at the study scale, against GPU card sizes, no GPU needed.

    python -m gradaccum.cards                                  # params.yaml as it is
    python -m gradaccum.cards -S accum=8 -S model.name=resnet18 --cards 8 24 80 --variants accumulation

Each variant's training step is traced on fake tensors (gradaccum/trace.py), under CUDA's autocast rules
for the study scale (GroupNorm in float32, as a GPU runs it), a few seconds a variant; its allocations,
replayed through a model of CUDA's caching allocator with the CUDA context added (gradaccum/allocator.py),
predict nvidia-smi's figure. As configured a variant fits a card when its allocations, replayed on the card less
memory.safety_margin, never run out of memory (the allocator freeing its cache where a segment would not fit,
as PyTorch's does); when they do, the fewest micro-batches that would not.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import pandas as pd

from gradaccum import allocator, fit, models, params, planner, trace
from gradaccum.accumulation import micro_batch_size
from gradaccum.models import IMAGE_SIZE
from gradaccum.records import Hardware
from gradaccum.refusal import BadInput
from gradaccum.spec import sweep_spec


def study_cards(p: params.Params, checkpointing: bool) -> list[dict[str, Any]]:
    """The report's GPU card table: the sweep's model at the study scale, plain or with checkpointing, on each of
    memory.cards_gb less memory.safety_margin: the fewest micro-batches whose step, replayed on the card, fits,
    its nvidia-smi figure there and how often the allocator freed its cache to fit."""
    spec = sweep_spec(p, Hardware.nominal("study"), checkpointing)
    usable = tuple(planner.card_usable_mib(card, p.memory.safety_margin) for card in p.memory.cards_gb)
    engine = fit.spec_engine(spec, usable)
    rows = []
    for card, u in zip(p.memory.cards_gb, usable, strict=True):
        accum = engine.smallest_accum_by_replay(u)
        row: dict[str, Any] = {"card_gb": card, "usable_mib": round(u), "accum": accum}
        if accum:
            on_card = engine.on_card(accum, u)
            row |= {"micro_batch": micro_batch_size(spec.batch, accum), "nvidia_smi_mib": on_card["nvidia_smi_mib"]}
            row["cache_frees"] = on_card["cache_frees"]
        rows.append(row)
    return rows


def answer(p: params.Params, variants: list[str], cards_gb: list[float], scale: str = "study") -> list[dict[str, Any]]:
    """A row per variant: its traced tensors, the nvidia-smi figure they predict on a GPU with room (the
    allocator's cache and the CUDA context on top: gradaccum/allocator.py) and, per card, "fits" when the step,
    replayed on that card less memory.safety_margin, never runs out of memory (the allocator freeing its cache
    where it must: "fits, cache freed" says so), or the smallest accum that would fit (with `accum: auto`, which
    has no accum to trace, the smallest accum on every card), found by gradaccum.fit's engine: a line between
    two traced sizes proposes it, and it is replayed on the card itself, raised or lowered to the fewest that
    fit."""
    usable = tuple(planner.card_usable_mib(card, p.memory.safety_margin) for card in cards_gb)
    rows = []
    for variant in variants:
        spec = trace.traced_spec(p, variant, scale)  # None with accum: auto
        engine = fit.spec_engine(spec or trace.traced_spec(p, variant, scale, accum=1), usable)
        traced = engine.trace(spec.micro_batch, spec.accum) if spec else None
        row: dict[str, Any] = {
            "variant": variant,
            "accum x micro-batch": f"{spec.accum} x {spec.micro_batch}" if spec else "auto",
            "traced GiB": traced["peak_mib"] / 1024 if traced else math.nan,  # shown as -
        }
        if scale == "study":
            row["nvidia-smi GiB (predicted)"] = trace.figure(traced) / 1024 if traced else math.nan
        for card, u in zip(cards_gb, usable, strict=True):
            on_card = engine.on_card(spec.accum, u) if spec else {"fits": False}
            if on_card["fits"]:
                row[f"{card:g} GB"] = "fits, cache freed" if on_card.get("cache_frees") else "fits"
                continue
            accum = engine.smallest_accum_by_replay(u)
            freed = ", cache freed" if accum and engine.on_card(accum, u).get("cache_frees") else ""
            row[f"{card:g} GB"] = f"accum {accum}{freed}" if accum else "no"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="which variants fit on which GPU card sizes, traced without a GPU")
    parser.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="a params.yaml change")
    parser.add_argument("--cards", type=float, nargs="+", help="card sizes in GB (default: memory.cards_gb)")
    parser.add_argument("--variants", nargs="+", help="variants to trace (default: all of params.yaml's)")
    parser.add_argument("--scale", choices=("study", "cpu"), default="study")
    args = parser.parse_args(argv)
    try:
        p = params.set_values(params.read(), args.set)
        unknown = sorted(set(args.variants or []) - set(p.variants))
        if unknown:
            raise params.ParamsError(
                f"--variants: {', '.join(unknown)} not in params.yaml; known: {', '.join(p.variants)}"
            )
        models.check_input(p.model)
    except BadInput as err:
        sys.exit(f"error: {err}")
    cards = args.cards or p.memory.cards_gb
    rows = answer(p, args.variants or list(p.variants), cards, args.scale)
    s = p.scale_settings(args.scale)
    amp = (
        f"autocast {p.train.amp_cuda} under CUDA's autocast rules (emulated: gradaccum/autocast_policy.py)"
        if args.scale == "study"
        else f"autocast {p.train.amp_cpu} under the CPU's rules"
    )
    data, shape = f"{s.train_samples + s.test_samples:,} digits", f"{p.model.in_chans}x{IMAGE_SIZE}x{IMAGE_SIZE}"
    print(
        f"What is traced: {p.model.name} ({p.model.num_classes} classes) on {shape} "
        f"images (the study's digits, not yours: another input size changes every figure), AdamW (weight decay "
        f"{p.train.weight_decay}), the dataset resident on the device ({data}, uint8). Sizes in GiB; a card's "
        '"GB" is read as GiB (1024 MiB), as GPU memory is sized.'
    )
    print(
        f"{p.model.name}, effective batch {s.batch} ({args.scale} scale), {amp}: traced tensors per variant"
        + (
            " and the nvidia-smi figure they predict on a card with room (the caching allocator's cache and an "
            f"assumed {allocator.CUDA_CONTEXT // allocator.MIB} MiB CUDA context on top); a card fits a variant when "
            'its step, replayed on the card, never runs out of memory ("cache freed": only as the allocator frees '
            "its cache and retries, which is slower)"
            if args.scale == "study"
            else "; a card fits a variant when its traced peak is"
        )
        + f" within the card less {p.memory.safety_margin:.0%}; otherwise the smallest accum that would "
        "(itself traced), or no\n"
    )
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.2f}", na_rep="-"))


if __name__ == "__main__":
    main()
