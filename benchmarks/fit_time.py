"""How long gradaccum-fit takes to answer, on two cores: resnet50 (goal: under 15 s), BERT-large at sequence 512
and GPT-2 medium at 1024 (under 20 s each), a 1B Llama-style decoder at 2048 (under 60 s).

    python -m benchmarks.fit_time [--repeats 3] [--only NAME ...]

Each run is a fresh interpreter, as a user starts it (imports included), `python -m gradaccum.cli`, the module
behind the installed command. The commands alternate, round by round (the machine's drift hits all alike): for
resnet50 the prediction alone (one card that fits, so no accum is searched) and the default six cards (8 to 80 GB,
where the small ones send it searching for the smallest accum, each suggestion traced); for the transformers the
prediction on one 80 GB card. Prints every run, the median and the range.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

RESNET = ["resnet50", "--input", "3x224x224", "--num-classes", "1000", "--batch", "256", "--optimizer", "sgd-momentum"]
ARMS = {
    "resnet50, prediction alone (--cards 80)": [*RESNET, "--cards", "80"],
    "resnet50, six cards, 8 to 80 GB": RESNET,
    "hf:bert-large-uncased, seq 512, batch 4": ["hf:bert-large-uncased", "--seq-len", "512", "--batch", "4",
                                                "--cards", "80"],
    "hf:gpt2-medium, seq 1024, batch 8": ["hf:gpt2-medium", "--seq-len", "1024", "--batch", "8", "--cards", "80"],
    "hf:llama-3.2-1b, seq 2048, batch 4": ["hf:llama-3.2-1b", "--seq-len", "2048", "--batch", "4", "--amp",
                                           "bfloat16", "--cards", "80"],
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="arms whose name starts with NAME")
    args = parser.parse_args()
    arms = {a: v for a, v in ARMS.items() if not args.only or any(a.startswith(o) for o in args.only)}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    said: dict[str, str] = {}
    for _ in range(args.repeats):
        for arm, argv in arms.items():
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "gradaccum.cli", *argv], check=False, capture_output=True,
                                 text=True)  # fmt: skip
            seconds[arm].append(time.perf_counter() - start)
            if out.returncode != 0:
                sys.exit(f"error: gradaccum-fit {' '.join(argv)} failed: {out.stderr.strip().splitlines()[-1]}")
            said[arm] = next(line for line in out.stdout.splitlines() if line.startswith("predicted:"))
    for arm, runs in seconds.items():
        runs_text = ", ".join(f"{s:.1f}" for s in runs)
        print(f"{arm}: median {statistics.median(runs):.1f} s ({min(runs):.1f} to {max(runs):.1f}; runs {runs_text})")
        print(f"    {said[arm]}")


if __name__ == "__main__":
    main()
