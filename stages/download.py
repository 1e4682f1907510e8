"""Stage `download`: the four IDX files, verified, packed into data/dataset.npz with their provenance."""

from __future__ import annotations

from gradaccum import mnist, params
from gradaccum.refusal import refusing
from stages.paths import DATASET, PROVENANCE, RAW_DIR, write_record


def main() -> None:
    p = params.load(model_names=False)  # builds no model: no timm import to check model.name
    data = p.data
    arrays, provenance = mnist.prepare(data.dataset, data.source, data.fallback, RAW_DIR / data.dataset)
    provenance["counts"] = {"train": int(len(arrays["train_y"])), "test": int(len(arrays["test_y"]))}
    provenance["image_shape"] = list(arrays["train_x"].shape[1:])
    mnist.save(arrays, DATASET)
    write_record(PROVENANCE, provenance)
    print(f"download: {provenance['kind']} {provenance['dataset']}: {provenance['counts']} -> {DATASET}")


if __name__ == "__main__":
    refusing(main)
