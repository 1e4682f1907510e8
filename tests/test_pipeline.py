"""End to end, as a newcomer runs it: `dvc repro` on a fresh copy, then `dvc exp run -S accum=2`.

Tiny scale (96 images, batch 32, one epoch) and no network (the mirrors point at a closed port,
so the data stage takes the fallback sample). Minutes, so marked slow: `make test-e2e` runs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import copy_of_the_tree

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def tiny_params() -> str:
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["scale"] = "cpu"
    p["scales"]["cpu"].update(train_samples=96, test_samples=64, batch=32, epochs=1, sweep_micro_batches=[8, 16])
    p["memory"].update(sweep_steps=1, interval_ms=100)
    return yaml.safe_dump(p, sort_keys=False)


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-4000:]}"
    return out


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    repo = copy_of_the_tree(tmp_path_factory.mktemp("clone"))
    (repo / "params.yaml").write_text(tiny_params())
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "MNIST_MIRRORS": "http://127.0.0.1:9/",
        "DVC_NO_ANALYTICS": "1",
        "GIT_AUTHOR_NAME": "test",
        "GIT_AUTHOR_EMAIL": "test@localhost",
        "GIT_COMMITTER_NAME": "test",
        "GIT_COMMITTER_EMAIL": "test@localhost",
    }
    run(["git", "init", "-q", "-b", "main"], repo, env)
    run(["git", "add", "-A"], repo, env)
    run(["git", "commit", "-qm", "fresh clone"], repo, env)
    return repo, env


@pytest.fixture(scope="module")
def repro(repo: tuple[Path, dict[str, str]]) -> str:
    path, env = repo
    return run(["dvc", "repro"], path, env)


def test_repro_runs_every_stage_and_renders_the_report(repo, repro: str) -> None:
    path, _ = repo
    variants = yaml.safe_load((path / "params.yaml").read_text())["variants"]
    stages = {"hardware", "download", "sweep", "gradcheck", "speed", "trace", "report"}
    assert ran(repro) == stages | {f"train@{v}" for v in variants}
    assert "Falling back to the 5,000-digit MNIST SAMPLE" in repro
    emulated = not json.loads((path / "data/hardware.json").read_text())["cpu"]["native_bfloat16"]
    for v in variants:
        m = json.loads((path / f"reports/variants/{v}/metrics.json").read_text())
        assert m["scale"] == "cpu" and m["device"] == "cpu" and m["dataset"] == "fallback"
        if v == "groupnorm_precision" and emulated:  # bfloat16 on a CPU without its kernels: recorded, not run
            assert not m["completed"] and "no bfloat16 kernels" in m["not_run"] and m["optimizer_steps"] == 0
            continue
        assert m["completed"] and m["memory"]["rss_peak_mib"] > 100
        assert m["optimizer_steps"] == 3  # 96 images / 32 per step
    state = torch.load(path / "data/models/accumulation.pt", weights_only=True)
    assert "conv_stem.weight" in state and state["conv_stem.weight"].shape[1] == 1
    html = (path / "reports/report.html").read_text()
    assert html.count("data:image/png;base64,") == 8 and "http" not in html.split("<body>")[1].split("data:")[0]
    assert (path / "reports/figures/train_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_second_repro_reruns_only_the_hardware_check(repo, repro: str) -> None:
    path, env = repo
    assert ran(run(["dvc", "repro"], path, env)) == {"hardware"}


def test_card_sizes_rerun_only_the_trace_and_the_report(repo, repro: str) -> None:
    path, env = repo
    out = run(["dvc", "exp", "run", "-S", "memory.cards_gb=[8,24]"], path, env)
    assert ran(out) == {"hardware", "trace", "report"}  # hardware always runs; its output is unchanged
    assert "| 24 |" in (path / "reports/report.md").read_text()


def test_a_comment_in_the_ddp_module_makes_training_stale(repo, repro: str) -> None:
    """What DVC says after an edit of library code: the stages that run it changed, the others not."""
    path, env = repo
    module = path / "gradaccum/distributed.py"
    original = module.read_text()
    module.write_text(original + "# an edit\n")
    try:
        stale = set(json.loads(run(["dvc", "status", "--json"], path, env)))
    finally:
        module.write_text(original)
    variants = yaml.safe_load((path / "params.yaml").read_text())["variants"]
    assert {f"train@{v}" for v in variants} | {"sweep", "gradcheck", "speed", "trace"} <= stale
    assert not stale & {"download", "report"}


def test_exp_run_reruns_only_the_variants_that_follow_accum(repo, repro: str) -> None:
    path, env = repo
    out = run(["dvc", "exp", "run", "-S", "accum=2"], path, env)
    variants = yaml.safe_load((path / "params.yaml").read_text())["variants"]
    followers = {f"train@{name}" for name, v in variants.items() if v["accum"] == "accum"}
    assert {"train@accumulation", "train@tutorial_accumulation", "train@accum_checkpointing"} <= followers
    assert ran(out) == {"hardware", "speed", "trace", "report"} | followers  # the other variants stay cached
    m = json.loads((path / "reports/variants/accumulation/metrics.json").read_text())
    assert m["accum"] == 2 and m["micro_batch"] == 16
    table = json.dumps(json.loads(run(["dvc", "exp", "show", "--json"], path, env)))
    assert "memory_ratio" in table and "peak_mib" in table and "rss_peak_mib" not in table  # the summary alone
    exp = run(["dvc", "exp", "list", "--name-only"], path, env).split()[0]
    plots = json.loads(run(["dvc", "plots", "diff", exp, "--json"], path, env))["data"]
    for name in ("train_loss", "test_accuracy", "memory", "sweep"):  # dvc.yaml's top-level plots, across revisions
        assert set(plots[name][0]["revisions"]) == {"workspace", exp}
        assert plots[name][0]["content"]["data"]["values"], name


DDP_VARIANTS = ("baseline", "accumulation", "accum_checkpointing")  # BatchNorm; no_sync windows; and checkpointing


def test_exp_run_on_two_processes_with_torchrun(repo, repro: str) -> None:
    """`dvc exp run -S distributed.nproc_per_node=2` on the CPU, through torchrun and gloo: the variants DDP treats
    differently (per-process BatchNorm statistics; no_sync windows; checkpointing inside them), then the report over
    their records. The others differ from these only in what DDP does not see (weighting, norm layer, precision)."""
    path, env = repo
    targets = [f"train@{v}" for v in DDP_VARIANTS]
    out = run(["dvc", "exp", "run", "-S", "distributed.nproc_per_node=2", *targets], path, env)
    assert ran(out) == {"hardware", *targets}
    for v in DDP_VARIANTS:
        m = json.loads((path / f"reports/variants/{v}/metrics.json").read_text())
        assert m["world_size"] == 2 and len(m["memory"]["per_rank"]) == 2
        assert m["memory"]["rss_peak_mib"] == max(r["rss_peak_mib"] for r in m["memory"]["per_rank"])
        assert m["optimizer_steps"] == 3 and m["final_train_loss"] > 0  # 96 images / 32 per step, as on one process
    m = json.loads((path / "reports/variants/accumulation/metrics.json").read_text())
    assert m["micro_batch"] == 8  # 32 / (2 processes x accum 2, the previous test's)
    assert ran(run(["dvc", "repro", "--single-item", "report"], path, env)) == {"report"}
    assert "peak per process (MiB)" in (path / "reports/report.md").read_text()
    table = json.loads(run(["dvc", "exp", "show", "--json"], path, env))
    assert '"world_size": 2' in json.dumps(table)


def test_readme_exp_show_fits_a_160_column_terminal(repo, repro: str) -> None:
    """On a terminal wide enough to show it whole (rich would squeeze a wider table into 160 columns, cutting
    its headers short), the table is at most 160 columns wide, with seeds shown."""
    path, env = repo
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^(dvc exp show --no-pager .*?)\s+#", readme, re.M).group(1)
    out = run(["bash", "-c", command], path, {**env, "COLUMNS": "1000"})
    assert "memory_ratio" in out and "seeds" in out and "accumulation" in out.replace("\n", " ")
    assert max(len(line) for line in out.splitlines()) <= 160, out


def test_bad_param_stops_before_any_work(repo, repro: str) -> None:
    path, env = repo
    result = subprocess.run(
        ["dvc", "exp", "run", "-S", "accum=0"],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode != 0
    assert "accum = 0 is not allowed; expected an integer from 1 to the effective batch size" in (
        result.stdout + result.stderr
    )


def test_readme_sweep_queues_one_experiment_per_accum(repo, repro: str) -> None:
    path, env = repo
    run(["dvc", "exp", "run", "-S", "accum=range(1,9)", "--queue"], path, env)
    status = run(["dvc", "queue", "status"], path, env)
    assert status.count("Queued") == 8, status
    run(["dvc", "queue", "remove", "--queued"], path, env)


PLOTS_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {  // vegaEmbed draws asynchronously
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    images: [...document.querySelectorAll(".vega-embed canvas")].map((c) => [true, c.width]),
    requests: performance.getEntriesByType("resource").map((e) => e.name),
  });
  document.body.appendChild(out);
}, 3000));
</script>
"""


@pytest.mark.parametrize("template", ["offline", "dvc's own"])
def test_dvc_plots_show_draws_offline(repo, repro: str, tmp_path: Path, template: str) -> None:
    """`dvc plots show` with the committed template (.dvc/plots/offline.html, vega inlined) draws every plot in
    headless Chromium with the network blocked; DVC's own page, the control, asks a CDN and draws nothing."""
    from test_report_browser import chromium, open_offline

    browser = chromium()
    path, env = repo
    extra = [] if template == "offline" else ["--html-template", str(tmp_path / "cdn.html")]
    if extra:
        (tmp_path / "cdn.html").write_text("<html><head>{scripts}</head><body>{plot_divs}</body></html>")
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots"), *extra], path, env)
    page = tmp_path / "plots/index.html"
    calls = page.read_text().count("vegaEmbed(")
    head, _, tail = page.read_text().rpartition("</body>")  # the page's own: vega-embed's code holds the string too
    page.write_text(head + PLOTS_PROBE + "</body>" + tail)
    seen, asked = open_offline(browser, page, tmp_path)
    drawn = [width for _, width in seen["images"] if width > 0]
    if template == "offline":
        assert calls >= 4 and len(drawn) == calls, (calls, seen)  # dvc.yaml's four plots and the stages' own
        assert asked == set() and seen["requests"] == []
    else:
        assert drawn == [] and any("cdn.jsdelivr.net" in url for url in asked)
