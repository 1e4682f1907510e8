"""Stage `download`: the four IDX files, verified, packed into data/dataset.npz with their provenance."""

from __future__ import annotations

import sys
from pathlib import Path

from stages import mnist, params
from stages.outputs import write_json

RAW_DIR = Path("data/raw")  # verified downloads, kept (git-ignored) so a re-run needs no network
DATASET = Path("data/dataset.npz")
PROVENANCE = Path("data/provenance.json")


def main() -> None:
    p = params.load()
    data = p["data"]
    arrays, provenance = mnist.prepare(data["dataset"], data["source"], data["fallback"], RAW_DIR / data["dataset"])
    provenance["counts"] = {"train": int(len(arrays["train_y"])), "test": int(len(arrays["test_y"]))}
    provenance["image_shape"] = list(arrays["train_x"].shape[1:])
    mnist.save(arrays, DATASET)
    write_json(PROVENANCE, provenance)
    print(f"download: {provenance['kind']} {provenance['dataset']}: {provenance['counts']} -> {DATASET}")


if __name__ == "__main__":
    try:
        main()
    except (params.ParamsError, mnist.DataError) as err:
        sys.exit(f"error: {err}")
