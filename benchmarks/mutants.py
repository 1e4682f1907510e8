"""Deliberately broken copies of the core, each run against the tests that guard it: every one must be caught.

    python -m benchmarks.mutants [--only NAME ...]

A mutant replaces one exact piece of one file (it must occur exactly once, so a mutant the code has
outgrown is an error, not a pass) in a fresh copy of the tracked tree, then runs its tests with
`pytest -x`. It is caught when pytest reports failed tests (exit code 1); a mutant whose tests pass
survived, and anything else (a collection error, a crash) is reported as such. The same tests first run
on the unchanged copy and must pass there, or no catch means anything. Exits 1 unless every mutant is
caught. Takes about four minutes on two cores; not part of `make test` (tests/test_mutants.py runs one).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository's root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest targets, relative to the root
    also: tuple[tuple[str, str], ...] = ()  # further (old, new) pieces of the same file, for a two-place change


MUTANTS = (
    Mutant(
        "loop ignores the weights",
        "gradaccum/loop.py",
        "scaler.scale(loss * mb.weight).backward()",
        "scaler.scale(loss).backward()",
        ("tests/test_accumulation.py",),
    ),
    Mutant(
        "loop ignores the shuffle",
        "gradaccum/loop.py",
        "idx = perm[mb.start : mb.stop]",
        "idx = torch.arange(mb.start, mb.stop, device=perm.device)",
        ("tests/test_accumulation.py",),
    ),
    Mutant(
        "no epoch-end step",
        "gradaccum/accumulation.py",
        "step = i == len(mine) - 1 and (full or epoch_end_step)",
        "step = i == len(mine) - 1 and full",
        ("tests/test_accumulation.py",),
    ),
    Mutant(
        "DDP all-reduces every micro-batch (no no_sync)",
        "gradaccum/loop.py",
        "quiet = isinstance(model, DDP) and no_sync and not mb.step",
        "quiet = False",
        ("tests/test_distributed.py::test_one_allreduce_per_window_with_no_sync",),
    ),
    Mutant(
        "sampler takes the first process, whatever its PID",
        "gradaccum/memory.py",
        'mine = [a for a in apps if a["pid"] == os.getpid()]',
        "mine = apps",
        ("tests/test_memory.py",),
    ),
    Mutant(
        "CUDA's float32 ops traced in float16",
        "gradaccum/autocast_policy.py",
        "return op(*_cast(args, torch.float32), **{k: _cast(v, torch.float32) for k, v in kwargs.items()})",
        "return op(*_cast(args, lower), **{k: _cast(v, lower) for k, v in kwargs.items()})",
        ("tests/test_autocast_policy.py",),
    ),
    Mutant(
        "the CPU-scale trace under CUDA's rules",
        "gradaccum/trace.py",
        "s: TracedStep, policy: str = autocast_policy.CPU, gpu: allocator.Gpu = allocator.STUDY_GPU, cards_mib",
        "s: TracedStep, policy: str = autocast_policy.CUDA, gpu: allocator.Gpu = allocator.STUDY_GPU, cards_mib",
        ("tests/test_trace.py::test_float16_autocast_halves_what_the_convolutions_keep",),
    ),
    Mutant(
        "a sweep point's peak is a constant",
        "gradaccum/memory.py",
        "return int(line.split()[1]) / 1024  # kB",
        "return 800.0",
        ("tests/test_sweep.py::test_a_point_measures_its_own_peak",),
    ),
    Mutant(
        "the accum error leaves out the batch",
        "gradaccum/params.py",
        'f"expected an integer from 1 to the effective batch size ({batch_key} = {batch}), or auto"',
        '"expected an integer from 1 to the effective batch size, or auto"',
        ("tests/test_params.py::test_accum_out_of_range_names_the_batch",),
    ),
    Mutant(
        "a stage checks timm's model names (only a comment says it does not)",
        "stages/download.py",
        "params.load(model_names=False)",
        "params.load()  # params.load(model_names=False)",
        ("tests/test_params.py::test_stages_that_build_no_model_skip_the_timm_check",),
    ),
    Mutant(
        "the depthwise matrices 1% off",
        "gradaccum/depthwise.py",
        "return y.transpose(0, 1).reshape(n, c, *out)",
        "return y.transpose(0, 1).reshape(n, c, *out) * 1.01",
        ("tests/test_models.py::test_under_autocast_the_matrices_do_what_autocast_does_to_conv2d",),
    ),
    Mutant(
        "the depthwise input gradient drops a corner tap",
        "gradaccum/depthwise.py",
        "grad_x = torch.bmm(g, tap_matrices(weight, index))",
        "grad_x = torch.bmm(g, tap_matrices(weight, index.masked_fill(index == 0, index.max())))",
        ("tests/test_models.py::test_under_autocast_the_matrices_do_what_autocast_does_to_conv2d",),
    ),
    Mutant(
        "the depthwise input gradient with the kernel transposed",
        "gradaccum/depthwise.py",
        "grad_x = torch.bmm(g, tap_matrices(weight, index))",
        "grad_x = torch.bmm(g, tap_matrices(weight.transpose(-1, -2), index))",
        ("tests/test_models.py::test_under_autocast_the_matrices_do_what_autocast_does_to_conv2d",),
    ),
    Mutant(
        "the depthwise input saved in float32, cast back for backward (same values, more memory)",
        "gradaccum/depthwise.py",
        "ctx.save_for_backward(x, weight, index)",
        "ctx.save_for_backward(x.float(), weight, index)",
        ("tests/test_models.py::test_under_autocast_the_matrices_do_what_autocast_does_to_conv2d",),
        also=(
            (
                "x, weight, index = ctx.saved_tensors",
                "x, weight, index = ctx.saved_tensors\n        x = x.to(weight.dtype)",
            ),
        ),
    ),
    Mutant(
        "speed ratios of the medians, not per round",
        "gradaccum/report/findings.py",
        "per_round = [m / r for m, r in zip(mine, ref, strict=True)]",
        "per_round = [statistics.median(mine) / statistics.median(ref)] * len(mine)",
        ("tests/test_speed.py::test_a_speed_ratio_pairs_each_round_with_the_references_same_round",),
    ),
    Mutant(
        "the micro-batch is floored (the card table's too)",
        "gradaccum/accumulation.py",
        "return math.ceil(batch / accum)",
        "return batch // accum",
        ("tests/test_planner.py::test_card_table",),
    ),
    Mutant(
        "the planner benchmark's ratio upside down",
        "benchmarks/run.py",
        '"predicted_over_measured": predicted / measured,',
        '"predicted_over_measured": measured / predicted,',
        ("tests/test_benchmarks.py::test_the_planner_benchmark_holds_the_fit_against_points_it_did_not_see",),
    ),
    Mutant(
        "a bad download does not fall through to the next mirror",
        "gradaccum/mnist.py",
        "except (OSError, ValueError, DataError) as err:",
        "except (OSError, ValueError) as err:",
        ("tests/test_mnist.py::test_a_truncated_download_falls_through_to_the_next_mirror",),
    ),
)


def copy_tree(dest: Path) -> None:
    """The tracked files as they are in the working tree (what the suite would test), without .venv or data."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    for old, new in ((mutant.old, mutant.new), *mutant.also):
        if text.count(old) != 1:
            raise ValueError(f"mutant {mutant.name!r}: {mutant.path} holds {old!r} {text.count(old)} times, not once")
        text = text.replace(old, new)
    path.write_text(text)


def pytest(root: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    proc = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, lines[-1] if lines else ""


def run_mutant(mutant: Mutant, work: Path) -> dict[str, object]:
    """The mutant in its own copy of the tree: caught, survived or error, with pytest's last line."""
    root = work / "tree"
    shutil.rmtree(root, ignore_errors=True)
    copy_tree(root)
    apply(mutant, root)
    start = time.perf_counter()
    code, last = pytest(root, mutant.tests)
    verdict = {1: "caught", 0: "SURVIVED"}.get(code, f"ERROR (pytest exit {code})")
    return {"mutant": mutant.name, "verdict": verdict, "seconds": time.perf_counter() - start, "pytest": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only mutants whose name contains NAME")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or any(o in m.name for o in args.only)]
    if not chosen:
        parser.error(f"--only {' '.join(args.only)}: no mutant's name contains it")
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        work = Path(tmp)
        copy_tree(work / "clean")
        targets = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, last = pytest(work / "clean", targets)
        print(f"unchanged code, the mutants' tests: {'pass' if code == 0 else 'FAIL'} ({last})", flush=True)
        if code != 0:
            sys.exit("the tests fail on the unchanged code: a mutant's failure would mean nothing")
        results = []
        for mutant in chosen:
            r = run_mutant(mutant, work)
            results.append(r)
            print(f"{r['verdict']:>9}  {r['mutant']} ({r['seconds']:.0f} s: {r['pytest']})", flush=True)
    caught = sum(r["verdict"] == "caught" for r in results)
    print(f"{caught} of {len(results)} mutants caught")
    sys.exit(0 if caught == len(results) else 1)


if __name__ == "__main__":
    main()
