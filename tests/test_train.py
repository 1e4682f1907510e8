"""The loop (gradaccum/loop.py) and the train stage: steps at window ends only, skipped steps counted, learns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from pydantic import ValidationError
from torch import nn

from gradaccum import experiment, loop, mnist, params, spec
from gradaccum.accumulation import schedule
from gradaccum.outputs import write_json
from gradaccum.records import Hardware
from stages import train as train_stage

ROOT = Path(__file__).resolve().parent.parent
CPU_BATCH = yaml.safe_load((ROOT / "params.yaml").read_text())["scales"]["cpu"]["batch"]
HARDWARE = {"format": 1, "device": "cpu", "scale": "cpu", "cpu": {"name": "a CPU", "native_bfloat16": True}}


def planner_json(fixed_mib: float, per_sample_mib: float, auto: int | None = 1) -> dict:
    """reports/sweep/planner.json with the one line every lever shares."""
    fit = {"fixed_mib": fixed_mib, "per_sample_mib": per_sample_mib}
    machine = {"memory_mib": 1000, "what": "host memory", "safety_margin": 0.1}
    plan = {"format": 2, "device": "cpu", "scale": "cpu", "batch": 32, "measure": "peak RSS", "points": []}
    plan |= {"line": fit, "line_checkpointing": fit, "this_machine": machine}
    return plan | dict.fromkeys(("auto_accum", "auto_accum_checkpointing"), auto)


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2), nn.GroupNorm(1, 8), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 13 * 13, 10)
    )


class SpyScaler(torch.amp.GradScaler):
    """Records the order of scale() (one per micro-batch) and step() calls."""

    def __init__(self) -> None:
        super().__init__("cpu", enabled=False)
        self.events: list[str] = []

    def scale(self, outputs):  # type: ignore[override]
        self.events.append("backward")
        return super().scale(outputs)

    def step(self, optimizer, *args, **kwargs):  # type: ignore[override]
        self.events.append("step")
        return super().step(optimizer, *args, **kwargs)


def digits(n: int = 512) -> dict[str, torch.Tensor]:
    arrays, _ = mnist.fallback_sample()
    return {
        "train_x": torch.from_numpy(arrays["train_x"][:n]),
        "train_y": torch.from_numpy(arrays["train_y"][:n]).long(),
        "test_x": torch.from_numpy(arrays["test_x"][:256]),
        "test_y": torch.from_numpy(arrays["test_y"][:256]).long(),
    }


def test_scaler_steps_only_at_window_boundaries() -> None:
    model = tiny_model()
    scaler = SpyScaler()
    opt = torch.optim.AdamW(model.parameters())
    images, labels = torch.randint(0, 256, (70, 28, 28), dtype=torch.uint8), torch.randint(0, 10, (70,))
    plan = schedule(70, 10, 3)  # 7 micro-batches: windows of 3, 3, 1
    run = loop.train_epoch(loop.Learner(model, opt, scaler, None), images, labels, torch.arange(70), plan)
    assert run.steps == 3 and run.skipped == 0
    assert scaler.events == ["backward"] * 3 + ["step"] + ["backward"] * 3 + ["step"] + ["backward", "step"]


def test_skipped_steps_are_counted() -> None:
    model = tiny_model()
    with torch.no_grad():
        model[-1].weight.fill_(float("inf"))  # every gradient inf/NaN: the scaler must skip every step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.AdamW(model.parameters())
    images, labels = torch.randint(0, 256, (40, 28, 28), dtype=torch.uint8), torch.randint(0, 10, (40,))
    before = [p.clone() for p in model.parameters()]
    learner = loop.Learner(model, opt, scaler, None)
    run = loop.train_epoch(learner, images, labels, torch.arange(40), schedule(40, 10, 2))
    assert run.steps == 2 and run.skipped == 2
    assert all(torch.equal(a, b) for a, b in zip(before[:2], list(model.parameters())[:2], strict=True))


def tiny_spec(**changes: object) -> spec.RunSpec:
    """The accumulation variant's spec at the CPU scale, resized for the tiny model's runs."""
    p = params.load(ROOT / "params.yaml", model_names=False)
    base = spec.resolve(p, "accumulation", Hardware.nominal("cpu"))
    tiny = {"lr": 3e-3, "weight_decay": 0.0, "batch": 64, "accum": 2, "epochs": 3, "amp": "float32"}
    return base.at(**tiny | changes)


def run(seed: int = 0, accum: int = 2) -> list[dict]:
    return loop.train(tiny_model(seed), digits(), tiny_spec(accum=accum), seed).epochs


def test_short_run_lowers_the_loss() -> None:
    rows = run()
    assert rows[-1]["train_loss"] < 0.8 * rows[0]["train_loss"]
    assert rows[-1]["test_accuracy"] > 0.5
    assert [r["optimizer_steps"] for r in rows] == [8, 8, 8]  # 512 samples / 64 per step


def test_same_seed_same_losses() -> None:
    a, b = run(seed=5), run(seed=5)
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert [r["test_loss"] for r in a] == [r["test_loss"] for r in b]


def test_normalize_matches_tutorial_transform() -> None:
    x = torch.tensor([[[0, 255], [128, 64]]], dtype=torch.uint8)
    expected = x.float() / 255 - 0.5  # ToTensor then Normalize((0.5,), (1.0,))
    assert torch.allclose(loop.normalize(x), expected.unsqueeze(1))


def stage_inputs(root: Path) -> None:
    """The files a train stage reads, at a tiny size, in a temp working folder."""
    rng = np.random.default_rng(0)
    arrays = {
        "train_x": rng.integers(0, 256, (CPU_BATCH, 28, 28), dtype=np.uint8),  # one full batch
        "train_y": rng.integers(0, 10, CPU_BATCH).astype(np.uint8),
        "test_x": rng.integers(0, 256, (32, 28, 28), dtype=np.uint8),
        "test_y": rng.integers(0, 10, 32).astype(np.uint8),
    }
    mnist.save(arrays, root / "data/dataset.npz")
    write_json(root / "data/provenance.json", {"format": 1, "kind": "fallback"})
    write_json(root / "data/hardware.json", HARDWARE)


def test_out_of_memory_is_a_result(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage_inputs(workdir)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(experiment, "train", oom)
    train_stage.main("baseline")
    metrics = json.loads((workdir / "reports/variants/baseline/metrics.json").read_text())
    assert metrics["completed"] is False and "out of memory" in metrics["did_not_fit"]["reason"]
    assert metrics["micro_batch"] == CPU_BATCH and metrics["final_train_loss"] is None
    assert (workdir / "reports/variants/baseline/epochs.tsv").read_text().startswith("epoch\ttrain_loss")
    assert torch.load(workdir / "data/models/baseline.pt", weights_only=True) == {}


def test_over_host_budget_is_not_run(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage_inputs(workdir)
    write_json(workdir / "reports/sweep/planner.json", planner_json(800.0, 100.0))
    monkeypatch.setattr(experiment, "train", lambda *a, **k: pytest.fail("must not train"))
    train_stage.main("baseline")  # 800 + 100 MiB x the CPU batch is far over the 16 GB budget
    metrics = json.loads((workdir / "reports/variants/baseline/metrics.json").read_text())
    assert metrics["completed"] is False and "over memory.host_budget_gb" in metrics["did_not_fit"]["reason"]
    assert metrics["did_not_fit"]["memory_at_failure_mib"] == 800 + 100 * CPU_BATCH


@pytest.mark.parametrize("native", [False, True])
def test_bfloat16_is_not_run_on_a_cpu_that_emulates_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    stage_inputs(workdir)
    write_json(workdir / "data/hardware.json", HARDWARE | {"cpu": {"name": "a CPU", "native_bfloat16": native}})
    trained = []
    monkeypatch.setattr(
        experiment, "train", lambda model, data, spec, *a, **k: trained.append(spec.dtype) or loop.Curves()
    )
    train_stage.main("groupnorm_precision")  # float32 by default on the CPU, so its precision lever is bfloat16
    metrics = json.loads((workdir / "reports/variants/groupnorm_precision/metrics.json").read_text())
    if native:
        assert trained == [torch.bfloat16] and metrics["not_run"] is None
    else:
        assert trained == [] and metrics["completed"] is False and metrics["did_not_fit"] is None
        assert "no bfloat16 kernels" in metrics["not_run"] and "train.emulated_bfloat16: true" in metrics["not_run"]
        (workdir / "params.yaml").write_text(
            (workdir / "params.yaml").read_text().replace("emulated_bfloat16: false", "emulated_bfloat16: true")
        )
        train_stage.main("groupnorm_precision")
        assert trained == [torch.bfloat16]
    train_stage.main("groupnorm")  # float32 never skipped
    assert trained[-1] is None


def test_a_batch_larger_than_the_data_stops_before_training(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The study's batch on the 4,000 fallback digits: accumulation would never accumulate, silently."""
    stage_inputs(workdir)
    (workdir / "params.yaml").write_text(
        (workdir / "params.yaml").read_text().replace(f"    batch: {CPU_BATCH}\n", f"    batch: {CPU_BATCH * 2}\n")
    )
    monkeypatch.setattr(experiment, "train", lambda *a, **k: pytest.fail("must not train"))
    with pytest.raises(
        mnist.DataError, match=rf"scales.cpu.batch = {CPU_BATCH * 2} is not allowed; .*holds {CPU_BATCH}"
    ):
        train_stage.main("accumulation")
    assert not (workdir / "reports/variants/accumulation").exists()


@pytest.mark.parametrize("damage", ["truncated", "not a zip", "missing"])
def test_a_damaged_dataset_says_how_to_rebuild_it(workdir: Path, damage: str) -> None:
    stage_inputs(workdir)
    path = workdir / "data/dataset.npz"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "not a zip":
        path.write_bytes(b"<html>proxy error</html>")
    else:
        path.unlink()
    with pytest.raises(mnist.DataError, match=r"data/dataset.npz: cannot be read .*dvc repro -f download"):
        train_stage.main("baseline")


def test_accum_auto_says_what_is_missing(workdir: Path) -> None:
    stage_inputs(workdir)
    (workdir / "params.yaml").write_text((workdir / "params.yaml").read_text().replace("\naccum: 4 ", "\naccum: auto "))
    with pytest.raises(
        params.ParamsError, match=r"reports/sweep/planner.json, which is missing: run `dvc repro sweep`"
    ):
        train_stage.main("accumulation")
    write_json(workdir / "reports/sweep/planner.json", planner_json(950.0, 1.0, auto=None))
    with pytest.raises(
        params.ParamsError,
        match=r"finds nothing that fits \(accumulation\): .* 951 MiB even at micro-batch 1, over the usable 900 MiB",
    ):
        train_stage.main("accumulation")
    with pytest.raises(params.ParamsError, match=r"nothing that fits \(checkpointing\)"):
        train_stage.main("accum_checkpointing")


def test_accum_auto_resolves_from_the_planner(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage_inputs(workdir)
    params_text = (workdir / "params.yaml").read_text().replace("\naccum: 4 ", "\naccum: auto ")
    (workdir / "params.yaml").write_text(params_text)
    write_json(workdir / "reports/sweep/planner.json", planner_json(800.0, 1.0, auto=3))
    seen = {}

    def fake_train(model, data, spec, *args, **kwargs):
        seen["accum"] = spec.accum
        return loop.Curves()

    monkeypatch.setattr(experiment, "train", fake_train)
    train_stage.main("accumulation")
    metrics = json.loads((workdir / "reports/variants/accumulation/metrics.json").read_text())
    assert seen["accum"] == 3 and metrics["accum"] == 3 and metrics["accum_setting"] == "auto"
    assert metrics["micro_batch"] == -(-CPU_BATCH // 3)  # ceil(batch / 3)
    train_stage.main("baseline")  # a variant with its own accum ignores auto
    assert seen["accum"] == 1


def test_tutorial_loop_carries_gradient_into_the_next_epoch() -> None:
    """accum 3 over 7 micro-batches: the 7th is never stepped in its epoch, so epoch 2's first step sums 4."""
    model = tiny_model()
    scaler = SpyScaler()
    opt = torch.optim.AdamW(model.parameters())
    images, labels = torch.randint(0, 256, (70, 28, 28), dtype=torch.uint8), torch.randint(0, 10, (70,))
    plan = schedule(70, 10, 3, weighting="divide", epoch_end_step=False)
    for _ in range(2):
        run = loop.train_epoch(loop.Learner(model, opt, scaler, None), images, labels, torch.arange(70), plan)
        assert run.steps == 2
        assert all(p.grad is not None for p in model.parameters())  # the leftover gradient waits for epoch 2
    per_step = [len(run) for run in "".join("b" if e == "backward" else "|" for e in scaler.events).split("|")]
    assert per_step == [3, 3, 4, 3, 1]  # epoch 2's first step: 1 carried micro-batch + 3; the last is never applied

    model, scaler = tiny_model(), SpyScaler()
    opt = torch.optim.AdamW(model.parameters())
    loop.train_epoch(loop.Learner(model, opt, scaler, None), images, labels, torch.arange(70), schedule(70, 10, 3))
    assert all(p.grad is None for p in model.parameters())  # exact: the epoch ends with a step, nothing carried


def test_precision_lever_flips_autocast() -> None:
    train = params.Train(
        weight_decay=0.0, amp_cuda="float16", amp_cpu="float32", eval_batch=64, emulated_bfloat16=False
    )
    assert spec.amp("cpu", train) == "float32" and spec.amp("cpu", train, "other") == "bfloat16"
    assert spec.amp("cuda", train) == "float16" and spec.amp("cuda", train, "other") == "float32"
    assert spec.amp("cpu", train.model_copy(update={"amp_cpu": "bfloat16"}), "other") == "float32"
    assert spec.AMP_DTYPES["float32"] is None  # float32: no autocast
    assert spec.other_precision("float16", "cuda") == "float32" and spec.other_precision("float32", "cuda") == "float16"


def test_a_spec_derives_its_micro_batch_and_refuses_one_that_lies() -> None:
    """The micro-batch and the evaluation batch follow from the batch and the window; no spec can say otherwise."""
    p = params.load(ROOT / "params.yaml", model_names=False)
    base = spec.resolve(p, "accumulation", Hardware.nominal("cpu"))  # 256 as 4 x 64, train.eval_batch 1024
    assert (base.batch, base.accum, base.micro_batch, base.eval_batch) == (CPU_BATCH, 4, CPU_BATCH // 4, CPU_BATCH // 4)
    bigger = base.at(accum=1)
    assert bigger.micro_batch == CPU_BATCH and bigger.eval_batch == min(p.train.eval_batch, CPU_BATCH)
    point = base.at(accum=1).at_micro(8)
    assert (point.batch, point.accum, point.micro_batch, point.eval_batch) == (8, 1, 8, 8)
    assert base.at(world=2).micro_batch == CPU_BATCH // 8  # a window is accum x world micro-batches
    with pytest.raises(ValidationError, match="micro_batch 100 is not ceil"):
        spec.RunSpec.model_validate(base.model_dump() | {"micro_batch": 100})
    with pytest.raises(ValidationError, match="accum must be from 1"):
        base.at(accum=CPU_BATCH + 1)
    with pytest.raises(TypeError, match="at()"):
        base.model_copy(update={"micro_batch": 100})  # would skip the validation


def test_each_further_seed_trains_a_fresh_model_and_is_recorded(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage_inputs(workdir)
    (workdir / "params.yaml").write_text((workdir / "params.yaml").read_text().replace("\nseeds: 1 ", "\nseeds: 3 "))
    calls = []

    def fake_train(model, data, spec, seed, *args, **kwargs):
        calls.append((seed, float(next(model.parameters()).detach().sum())))
        row = dict.fromkeys(loop.EPOCH_COLUMNS, 1.0)
        return loop.Curves([row | {"epoch": 1, "train_loss": seed / 100, "test_accuracy": seed / 1000}])

    monkeypatch.setattr(experiment, "train", fake_train)
    train_stage.main("groupnorm")
    metrics = json.loads((workdir / "reports/variants/groupnorm/metrics.json").read_text())
    assert [c[0] for c in calls] == [99, 100, 101]  # the data's order follows the seed
    assert len({c[1] for c in calls}) == 3  # and so do the initial weights: each seed a fresh model
    assert metrics["seeds"] == [
        {"seed": s, "final_train_loss": s / 100, "test_accuracy": s / 1000} for s in (99, 100, 101)
    ]
    assert metrics["final_train_loss"] == 0.99  # the record's own end point is the first seed's, as its curves
    assert metrics["train_seconds"] == 3.0  # every seed's loop time: 1 s each in the fake


def test_a_loss_per_optimizer_step_whose_weighted_mean_is_the_epoch_loss() -> None:
    """steps.tsv: the window means, which, weighted by window size, give back the epoch's mean loss."""
    model, data = tiny_model(), digits(70)
    images, labels = data["train_x"], data["train_y"]
    plan = schedule(70, 10, 3)  # windows of 30, 30 and 10 samples
    with torch.no_grad():  # the first window, on the untouched model
        first = float(F.cross_entropy(model(loop.normalize(images[:30])), labels[:30]))
    learner = loop.Learner(
        model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False), None
    )
    run = loop.train_epoch(learner, images, labels, torch.arange(70), plan)
    losses, epoch_loss = run.step_losses, run.loss
    assert run.steps == len(losses) == 3
    assert losses[0] == pytest.approx(first, rel=1e-5)
    assert (30 * losses[0] + 30 * losses[1] + 10 * losses[2]) / 70 == pytest.approx(epoch_loss, rel=1e-6)
    rows = loop.train(tiny_model(), digits(128), tiny_spec(lr=1e-3, epochs=2), 0).steps
    assert [(r["step"], r["epoch"]) for r in rows] == [(1, 1), (2, 1), (3, 2), (4, 2)]


def test_the_tutorials_cudnn_flags_are_set_on_a_gpu_only_and_put_back() -> None:
    """seed_torch's cudnn.enabled = False, deterministic = True while the variant trains, PyTorch's flags after;
    setting torch.backends.cudnn's flags needs no GPU, so the CUDA path is checked here too."""
    cudnn = torch.backends.cudnn
    before = (cudnn.enabled, cudnn.deterministic, cudnn.benchmark)
    with experiment.cudnn_settings("tutorial", torch.device("cuda")) as ran:
        assert (cudnn.enabled, cudnn.deterministic, cudnn.benchmark) == (False, True, False)
    assert (cudnn.enabled, cudnn.deterministic, cudnn.benchmark) == before
    assert ran.applied and (ran.setting, ran.enabled, ran.deterministic) == ("tutorial", False, True)
    with experiment.cudnn_settings("tutorial", torch.device("cpu")) as ran:
        assert (cudnn.enabled, cudnn.deterministic, cudnn.benchmark) == before  # a CPU: nothing changes
    assert not ran.applied and ran.enabled is None and "nothing was set" in ran.note


def test_the_tutorial_variants_record_says_its_cudnn_switch_changed_nothing_on_a_cpu(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage_inputs(workdir)
    flags = []
    monkeypatch.setattr(
        experiment, "train", lambda *a, **k: flags.append(torch.backends.cudnn.enabled) or loop.Curves()
    )
    train_stage.main("tutorial_accumulation")
    record = json.loads((workdir / "reports/variants/tutorial_accumulation/metrics.json").read_text())["cudnn"]
    assert record["setting"] == "tutorial" and record["applied"] is False and "CPU" in record["note"]
    assert flags == [torch.backends.cudnn.enabled]  # trained under the flags as they were


def test_dvclive_follows_the_run_epoch_by_epoch(tmp_path: Path) -> None:
    """DVCLive's files are rewritten after every epoch, while the run goes on (what dvc exp show and DVC's VS Code
    extension read), and hold the same numbers as the records written at the end."""
    from gradaccum.live import LiveCurves

    live, seen = LiveCurves(tmp_path / "live"), []

    def on_epoch(epoch: dict, epoch_steps: list[dict]) -> None:
        live(epoch, epoch_steps)
        seen.append(json.loads((tmp_path / "live/metrics.json").read_text()))

    curves = loop.train(tiny_model(0), digits(), tiny_spec(), 0, on_epoch=on_epoch)
    rows, steps = curves.epochs, curves.steps
    live.close()
    assert [s["epoch"] for s in seen] == [1, 2, 3]  # one summary per epoch, each before the next epoch ran
    assert [s["per_epoch"]["test_accuracy"] for s in seen] == [r["test_accuracy"] for r in rows]
    tsv = (tmp_path / "live/plots/metrics/train_loss.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[-2:] == ["step", "train_loss"]
    assert [int(line.split("\t")[-2]) for line in tsv[1:]] == [s["step"] for s in steps]
    assert [float(line.split("\t")[-1]) for line in tsv[1:]] == pytest.approx([s["train_loss"] for s in steps])
    assert (tmp_path / "live/plots/metrics/per_epoch/test_accuracy.tsv").is_file()


def test_without_dvclive_the_run_goes_on_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU host without DVC (scripts/device_check.sh): no live curves, one note, the stage's own records kept."""
    from gradaccum.live import EPOCH_METRICS, LiveCurves

    monkeypatch.setitem(sys.modules, "dvclive", None)  # import dvclive -> ImportError
    live = LiveCurves(tmp_path / "live")
    for epoch in (1, 2):
        live({"epoch": epoch, **dict.fromkeys(EPOCH_METRICS, 0.0)}, [{"step": epoch, "train_loss": 1.0}])
    live.close()
    assert capsys.readouterr().out.count("note: dvclive is not installed") == 1
    assert not (tmp_path / "live").exists()
