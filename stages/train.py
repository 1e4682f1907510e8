"""Stage `train@<variant>`: train one variant, measure its memory, write its metrics, plots and weights.

    python -m stages.train baseline

The loop is `gradaccum/loop.py`; `gradaccum/experiment.py` runs it inside the memory sampler.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gradaccum import distributed, mnist, models, params
from gradaccum.experiment import VariantRun, run_variant
from gradaccum.live import LiveCurves, ensure_outputs
from gradaccum.loop import EPOCH_COLUMNS, STEP_COLUMNS
from gradaccum.machine import process_seconds
from gradaccum.memory import TIMELINE_COLUMNS
from gradaccum.outputs import atomic_path, read_json, write_json, write_table, write_text
from gradaccum.refusal import refusing
from gradaccum.spec import check_distributed, resolve
from stages.paths import DATASET, PROVENANCE, hardware, live_dir, read, sweep_plan, variant_dir, weights_path


def main(variant: str, memory_snapshot: Path | None = None) -> None:
    p = params.load()
    hw, plan = hardware(), sweep_plan()
    nproc = p.distributed.nproc_per_node
    spec = resolve(p, variant, hw, plan, nproc)  # a bad accum stops here, before torchrun starts anything
    models.check_input(p.model)  # so does a model that cannot take the images
    check_distributed(p, hw)
    mnist.check_batch(spec.scale, spec.batch, spec.train_samples, DATASET)
    dataset = read(PROVENANCE)["kind"]  # read now: a missing one is said before training, not after it
    if nproc > 1 and not distributed.launched():  # one process per device, started by torchrun
        sys.exit(relaunched(variant, nproc))
    rank, _, device = distributed.setup(spec.device)
    data = mnist.load_tensors(DATASET, device, spec.train_samples, spec.test_samples)
    live = LiveCurves(live_dir(variant)) if rank == 0 else None  # the curves as it trains (dvc exp show)
    run = run_variant(spec, data, rank, memory_snapshot, on_epoch=live)
    if live is not None:
        live.close()
    if run.alone:  # out of memory here while the other ranks wait: record it, then fail so torchrun stops them
        write_outputs(variant, run, dataset)
        sys.exit(f"train@{variant}: rank {rank} {run.record.why_not()}")
    distributed.teardown()
    if rank == 0:  # rank 0 writes the outputs
        write_outputs(variant, run, dataset)


def relaunched(variant: str, nproc: int) -> int:
    """This stage in `nproc` processes under torchrun; its exit status, 0 when a rank recorded out of memory.

    One rank out of memory ends the run (the others would wait for it forever), so torchrun fails; the
    metrics that rank wrote, fresh since the old ones were removed here, tell that result from a crash.
    """
    metrics = variant_dir(variant) / "metrics.json"
    metrics.unlink(missing_ok=True)
    code = distributed.relaunch(nproc, "stages.train", sys.argv[1:])
    if code != 0 and metrics.exists() and read_json(metrics)["did_not_fit"]:
        print(f"train@{variant}: did not fit ({read_json(metrics)['did_not_fit']['reason']}); recorded as a result")
        return 0
    return code


def write_outputs(variant: str, run: VariantRun, dataset: str) -> None:
    """Metrics last: their presence says that the rest is there."""
    sampler = run.sampler
    record = run.record.model_copy(update={"dataset": dataset, "stage_seconds": process_seconds()})
    out = variant_dir(variant)
    ensure_outputs(live_dir(variant))  # what dvc.yaml declares, for a variant that did not run or fit too
    write_table(out / "epochs.tsv", run.epochs, EPOCH_COLUMNS)
    write_table(out / "steps.tsv", run.steps, STEP_COLUMNS)
    write_table(out / "memory.csv", sampler.rows, TIMELINE_COLUMNS, delimiter=",")
    write_text(
        out / "nvidia-smi.txt", sampler.peak_snapshot or "no nvidia-smi snapshot (CPU run or nvidia-smi missing)\n"
    )
    with atomic_path(weights_path(variant)) as tmp:
        torch.save(run.weights, tmp)
    write_json(out / "metrics.json", record.model_dump(mode="json"))
    peak = record.memory.nvidia_smi_peak_mib or record.memory.rss_peak_mib
    print(f"train@{variant}: {record.why_not() or 'done'}; peak {peak:.0f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument(
        "--memory-snapshot",
        type=Path,
        metavar="PICKLE",
        help="on a GPU, dump PyTorch's memory history up to the first optimizer step there (scripts/gpu_check.sh)",
    )
    args = parser.parse_args()
    refusing(main, args.variant, args.memory_snapshot)
