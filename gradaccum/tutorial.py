"""The tutorial this study starts from: what it claimed, and the three things its code did that we correct.

Defined once: params.yaml's switch defaults, the train stage's record and the report's labels all read these.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Correction(NamedTuple):
    key: str  # the variant switch in params.yaml
    corrected: Any  # this study's code (the default)
    tutorial: Any  # the tutorial's code as written
    label: str  # what the tutorial's value does, in the report


CORRECTIONS = (
    Correction("weighting", "exact", "divide", "loss / accum"),
    Correction("epoch_end_step", True, False, "no step at epoch end"),
    Correction("swap", "keep_act", "plain", "plain GroupNorm swap"),
)
CORRECTED = {c.key: c.corrected for c in CORRECTIONS}
# torch.backends.cudnn flags: PyTorch's defaults, and the tutorial's seed_torch (cuDNN off: PyTorch's own CUDA
# convolutions, one per-sample im2col buffer and direct depthwise kernels instead of cuDNN's workspaces).
CUDNN = {
    "default": {"enabled": True, "deterministic": False, "benchmark": False},
    "tutorial": {"enabled": False, "deterministic": True, "benchmark": False},
}


CLAIMS = {"baseline_gb": 30.0, "accumulation_gb": 13.7, "batch": 32768, "micro": 8192, "accum": 4}
# A claim holds within this share of it, measured or predicted: the tutorial gives "about" figures from one run.
CLAIM_TOLERANCE = 0.25


def kept_mistakes(settings: dict[str, Any]) -> list[Correction]:
    """The corrections a variant's settings leave out (the swap only matters where the norm is swapped)."""
    return [
        c
        for c in CORRECTIONS
        if settings.get(c.key, c.corrected) != c.corrected and (c.key != "swap" or settings.get("norm") == "group")
    ]
