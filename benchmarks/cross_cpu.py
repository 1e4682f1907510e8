"""Two runs of the CPU scale on other kernels, variant by variant: does each finding hold, and how far do figures move?

    python -m benchmarks.cross_cpu RUN_A RUN_B

RUN_A and RUN_B are kept reports (`python -m benchmarks.repro --keep DIR`, or `reports/`), made with the same
seeds on two CPUs, or on one with its kernels held to a smaller set (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). Per
variant: the mean final loss and test accuracy of each, the largest difference seed by seed, and that difference
against the seed spread (the range over seeds, the wider of the two runs'): a move within the spread is what
another seed would do, so no finding may rest on it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gradaccum.records import Hardware, VariantRecord
from gradaccum.report import cpu_kernels
from gradaccum.report.results import seed_mean, seed_values


def records(run: Path) -> dict[str, VariantRecord]:
    return {p.parent.name: VariantRecord.read(p) for p in sorted(run.glob("variants/*/metrics.json"))}


def kernels(run: Path) -> str:
    cpu = Hardware.model_validate_json((run / "hardware.json").read_text()).cpu
    return f"{cpu.name}{cpu_kernels(cpu) or ', kernels not recorded'}, native bfloat16 {cpu.native_bfloat16}"


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def compare(a: VariantRecord, b: VariantRecord) -> str:
    """One table row: means, the largest per-seed move, and that move against the seed spread."""
    if not (a.completed and b.completed):
        ran = ("ran" if r.completed else "not run" for r in (a, b))
        return f"| `{a.variant}` | {' | '.join(ran)} | | | |"
    la, lb = (seed_values(r, "final_train_loss") for r in (a, b))
    aa, ab = (seed_values(r, "test_accuracy") for r in (a, b))
    move = max(abs(x - y) for x, y in zip(la, lb, strict=True))
    acc_move = max(abs(x - y) for x, y in zip(aa, ab, strict=True))
    seeds = max(spread(la), spread(lb))
    return (
        f"| `{a.variant}` | {seed_mean(a, 'final_train_loss'):.4f} / {seed_mean(a, 'test_accuracy'):.3f} "
        f"| {seed_mean(b, 'final_train_loss'):.4f} / {seed_mean(b, 'test_accuracy'):.3f} | {move:.4f} / {acc_move:.3f} "
        f"| {seeds:.4f} | {move / seeds:.2f} |"
    )


def findings(run: dict[str, VariantRecord]) -> str:
    """The two findings that must hold on any CPU: accumulation equals its control, and the norm-or-lr split."""
    same = max(
        abs(x.final_train_loss - y.final_train_loss) / y.final_train_loss
        for x, y in zip(run["accumulation"].seeds, run["groupnorm"].seeds, strict=True)
    )
    base, lr, gn = (seed_mean(run[n], "final_train_loss") for n in ("baseline", "batchnorm_lr", "groupnorm"))
    lr_spread = max(spread(seed_values(run[n], "final_train_loss")) for n in ("baseline", "batchnorm_lr"))
    return (
        f"accumulation against groupnorm, seed by seed: {same:.1e} relative at most; of the fix's {base - gn:.4f} "
        f"off the loss the lr takes {base - lr:.4f} (seed spread {lr_spread:.4f}), the norm {lr - gn:.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args()
    ra, rb = records(args.run_a), records(args.run_b)
    if ra.keys() != rb.keys():
        parser.error(f"the runs hold other variants: {sorted(ra.keys() ^ rb.keys())}")
    ran = [name for name in ra if ra[name].completed and rb[name].completed]  # one CPU may leave one out (bfloat16)
    seeds = {name: ([s.seed for s in ra[name].seeds], [s.seed for s in rb[name].seeds]) for name in ran}
    if any(x != y for x, y in seeds.values()):
        parser.error(f"the runs' seeds differ: {seeds}")
    print(f"A: {args.run_a}: {kernels(args.run_a)}\nB: {args.run_b}: {kernels(args.run_b)}\n")
    print("| variant | A: loss / acc | B: loss / acc | largest move, seed by seed | seed spread | move / spread |")
    print("|---|---|---|---|---|---|")
    for name in ra:
        print(compare(ra[name], rb[name]))
    print()
    for label, run in (("A", ra), ("B", rb)):
        print(f"{label}: {findings(run)}")


if __name__ == "__main__":
    main()
