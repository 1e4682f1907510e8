"""How long `python -m gradaccum.fit` takes for resnet50 at 3x224x224, batch 256: the goal is under 15 s on two cores.

    python -m benchmarks.fit_time [--repeats 3]

Each run is a fresh interpreter, as a user starts it (imports included). Two commands alternate: the prediction
alone (one card that fits, so no accum is searched) and the default six cards (8 to 80 GB, where the small ones
send it searching for the smallest accum, each suggestion traced). Prints every run, the median and the range.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

MODEL = ["resnet50", "--input", "3x224x224", "--num-classes", "1000", "--batch", "256", "--optimizer", "sgd-momentum"]
ARMS = {"prediction alone (--cards 80)": ["--cards", "80"], "six cards, 8 to 80 GB": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm, extra in ARMS.items():  # interleaved: the machine's drift hits both alike
            start = time.perf_counter()
            command = [sys.executable, "-m", "gradaccum.fit", *MODEL, *extra]
            out = subprocess.run(command, check=False, capture_output=True, text=True)
            seconds[arm].append(time.perf_counter() - start)
            if out.returncode != 0:
                sys.exit(f"error: gradaccum.fit failed: {out.stderr.strip().splitlines()[-1]}")
    print(f"python -m gradaccum.fit {' '.join(MODEL)}: {out.stdout.splitlines()[2]}")
    for arm, runs in seconds.items():
        runs_text = ", ".join(f"{s:.1f}" for s in runs)
        print(f"{arm}: median {statistics.median(runs):.1f} s ({min(runs):.1f} to {max(runs):.1f}; runs {runs_text})")


if __name__ == "__main__":
    main()
