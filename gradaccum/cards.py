"""Will it fit on my card? Every variant's traced peak at the study scale, against GPU card sizes, no GPU needed.

    python -m gradaccum.cards                                  # params.yaml as it is
    python -m gradaccum.cards -S accum=8 -S model.name=resnet18 --cards 8 24 80 --variants accumulation

Each variant's training step is traced on fake tensors (gradaccum/trace.py), under CUDA's autocast rules
for the study scale (GroupNorm in float32, as a GPU runs it), a few seconds a variant: as
configured it fits a card when its traced peak is at most the card less memory.safety_margin (which has
to hold the CUDA context and the allocator's cache); when it does not, the fewest micro-batches that would.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import pandas as pd

from gradaccum import models, params, planner, trace


def answer(p: params.Params, variants: list[str], cards_gb: list[float], scale: str = "study") -> list[dict[str, Any]]:
    """A row per variant: its traced peak and, per card, "fits" or the smallest accum that would fit
    (with `accum: auto`, which has no accum to trace, the smallest accum on every card)."""
    batch, margin = p.scale_settings(scale).batch, p.memory.safety_margin
    rows = []
    for variant in variants:
        traced = trace.trace_variant(p, variant, scale)
        peak = traced.get("peak_mib")
        row: dict[str, Any] = {
            "variant": variant,
            "accum x micro-batch": f"{traced['accum']} x {traced['micro_batch']}" if peak else "auto",
            "traced GiB": peak / 1024 if peak else math.nan,  # shown as -
        }
        line = None  # two more traces, only for a card the variant does not fit as configured
        for card in cards_gb:
            usable = card * planner.GIB_MIB * (1 - margin)
            if peak and peak <= usable:
                row[f"{card:g} GB"] = "fits"
                continue
            line = line or trace.variant_line(p, variant, scale)
            accum = planner.smallest_accum(line, usable, batch)
            row[f"{card:g} GB"] = f"accum {accum}" if accum else "no"
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
        models.check_input(**p.model.model_dump())
    except (params.ParamsError, models.ModelInputError) as err:
        sys.exit(f"error: {err}")
    cards = args.cards or p.memory.cards_gb
    rows = answer(p, args.variants or list(p.variants), cards, args.scale)
    s = p.scale_settings(args.scale)
    amp = (
        f"autocast {p.train.amp_cuda} under CUDA's autocast rules (emulated: gradaccum/autocast_policy.py)"
        if args.scale == "study"
        else f"autocast {p.train.amp_cpu} under the CPU's rules"
    )
    print(
        f"{p.model.name}, effective batch {s.batch} ({args.scale} scale), {amp}: traced "
        f"peak per variant; a card fits it when the peak is at most the card less {p.memory.safety_margin:.0%}; "
        "otherwise the smallest accum that would, or no\n"
    )
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.2f}", na_rep="-"))


if __name__ == "__main__":
    main()
