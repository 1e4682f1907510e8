"""gradaccum.fit's predictions against published measurements of real GPU training steps (docs/validation.md).

    python -m benchmarks.validate

Every row is a figure someone measured and published, with the setup they state; the prediction is made here at
that setup, on fake tensors, and printed beside it with the ratio. Nothing is fitted to these figures: where a row
misses, docs/validation.md says what is known of why.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import timm.layers

from gradaccum import fit

MESA = (
    "ziplab/Mesa README.md, 'Results on ImageNet' (Pan et al., arXiv:2111.11124): train memory at batch 128, "
    "224x224, one GPU; DeiT's training script (AMP autocast float16, AdamW), PyTorch 1.7.1, CUDA 10.1"
)


@dataclass(frozen=True)
class Published:
    """One published measurement and the setup its source states."""

    source: str
    model: str  # as gradaccum.fit takes it
    batch: int
    measured: str  # allocated, reserved or nvidia-smi
    mib: float
    input: tuple[int, int, int] = (3, 224, 224)
    num_classes: int = 1000
    amp: str = "float16"
    optimizer: str = "adamw"
    fused_attention: bool = False  # torch before 2.0 had no scaled_dot_product_attention: the maps are kept


ROWS = (
    Published(MESA, "deit_tiny_patch16_224", 128, "allocated", 4171),
    Published(MESA, "deit_small_patch16_224", 128, "allocated", 8459),
    Published(MESA, "deit_base_patch16_224", 128, "allocated", 17691),
    Published(MESA, "swin_tiny_patch4_window7_224", 128, "allocated", 11812),
)
FIGURE = {"allocated": "allocated_mib", "reserved": "reserved_mib", "nvidia-smi": "nvidia_smi_mib"}
GOALS = {"allocated": 0.03, "reserved": 0.10, "nvidia-smi": 0.10}


def predict(row: Published) -> float:
    """The row's measured figure as gradaccum.fit predicts it at the row's setup."""
    before = timm.layers.use_fused_attn()
    timm.layers.set_fused_attn(row.fused_attention)  # read by timm's attention layers when they are built
    try:
        q = fit.Question(row.model, row.input, row.num_classes, row.batch, 1, row.amp, row.optimizer, cards=(80.0,))
        return fit.answer(q)[FIGURE[row.measured]]
    finally:
        timm.layers.set_fused_attn(before)


def main() -> None:
    ratios: dict[str, list[float]] = {}
    for row in ROWS:
        predicted = predict(row)
        ratio = predicted / row.mib
        ratios.setdefault(row.measured, []).append(ratio)
        print(
            f"{row.model}, batch {row.batch}, {row.amp}, {row.optimizer}: {row.measured} published {row.mib:.0f} MiB, "
            f"predicted {predicted:.0f} MiB, predicted / published {ratio:.3f}",
            flush=True,
        )
    sources = len({row.source for row in ROWS})
    for measured, values in ratios.items():
        within = sum(abs(r - 1) <= GOALS[measured] for r in values)
        print(
            f"{measured}: {len(values)} rows from {sources} source(s); {within} within {GOALS[measured]:.0%}; "
            f"predicted / published median {statistics.median(values):.3f} ({min(values):.3f} to {max(values):.3f})"
        )


if __name__ == "__main__":
    main()
