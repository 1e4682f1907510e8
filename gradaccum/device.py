"""The first GPU run in one call: what `scripts/device_check.sh` runs on a lent GPU machine, and the bundle it carries.

A lent machine (one H100, 15 minutes of GPU time, 10 minutes a command, 8 files back, no network) has torch, timm,
pandas, seaborn, pyyaml, psutil and tqdm but not pydantic, ruamel.yaml, markdown-it or DVC. `bundle` builds, here,
the folder the call carries: those packages unpacked from the lock's own wheels for the device's Python, the data
(Fashion-MNIST: memory depends on the shapes alone), and the study-scale trace made on this machine, so every GPU
figure comes back beside the prediction made before the GPU ran. On the device the script calls the other commands:
`preflight`, `pack` (a stage's outputs into one JSON file of $OUT, as soon as they exist), `trace` (the trace under
the device's own CUDA autocast beside the CPU emulation), `epochs` (how many fit in the time left) and `status`.
Here again, `unpack` lays the returned files out as the pipeline's reports, for the report stage to render.

    python -m gradaccum.device bundle                       # device-bundle/, for python 3.12 (the device's)
    python -m gradaccum.device unpack OUT reports/reference/gpu-2026-12-06-h100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradaccum import outputs
from gradaccum.outputs import write_json  # whole or not at all: a call cut off brings back the last whole file

BUNDLE = Path("device-bundle")
# What our device path imports that the device lacks (pydantic: params and records; ruamel.yaml: params -S;
# markdown-it: the report package that gradaccum.report.traced sits in), with what they import; typing_extensions
# is there (torch needs it) but maybe older than pydantic's floor, so the lock's comes too.
BUNDLED = (
    "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions", "ruamel.yaml",
    "markdown-it-py", "mdurl",
)  # fmt: skip
# The import names of what the device lacks, the bundle's and the rest: the twin refuses each unless the bundle
# brings it (tests/device_twin/sitecustomize.py).
LACKS = (
    "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "ruamel", "markdown_it", "mdurl",
    "dvc", "dvclive", "mlxtend",
)  # fmt: skip
DATA_FILES = (
    "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"
)  # fmt: skip
FASHION = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
LIMIT_MIB = 60  # the call carries 64 MiB in all, the working tree included
# $OUT's files (at most 8 come back): each part writes its own as soon as it has something.
OUT_FILES = {
    "status": "status.json",  # each part: ok, seconds, and on failure its one line
    "preflight": "preflight.json",
    "snapshot": "first_step.pickle",  # PyTorch's allocator history of one step (pytorch.org/memory_viz)
    "memory": "memory.json",  # part 2: every variant's record, curves and nvidia-smi snapshot
    "compare": "predicted_vs_measured.txt",
    "trace": "device_trace.json",
    "training": "training.json",  # part 4: baseline and accumulation over as many epochs as fit
    "log": "log.txt",
}


def pins(lock: Path = Path("requirements.lock")) -> dict[str, str]:
    """The lock's version of each bundled distribution (names compared as pip does: case, - _ . alike)."""

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    locked = {}
    for line in lock.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            locked[norm(name)] = version.strip()
    missing = [n for n in BUNDLED if norm(n) not in locked]
    if missing:
        raise SystemExit(f"error: {lock} pins none of {missing}: the bundle takes the lock's versions")
    return {n: locked[norm(n)] for n in BUNDLED}


def read_json(path: Path) -> dict[str, Any]:
    """A file of OUT or the bundle, or {} where a part has not written it (yet)."""
    return outputs.read_json(path) if path.exists() else {}


def build_bundle(dest: Path, python: str, data: Path, params_file: Path, sets: list[str]) -> dict[str, Any]:
    """device-bundle/: site/ (the unpacked wheels), data/ (the four IDX files), predicted.json (the study-scale
    trace, made here), manifest.json. Checks first, so bad input stops before the downloads."""
    missing = [f for f in DATA_FILES if not (data / f).is_file()]
    if missing:
        raise SystemExit(f"error: --data {data} lacks {', '.join(missing)}: apt-get install dataset-fashion-mnist")
    if not re.fullmatch(r"3\.\d+", python):
        raise SystemExit(f"error: --python {python!r} is not a Python version like 3.12")
    from gradaccum import params as params_module

    p = params_module.set_values(params_module.read(params_file), sets)
    versions = pins()
    tmp = Path(tempfile.mkdtemp(prefix="bundle.", dir=dest.parent if dest.parent.exists() else None))
    try:
        wheels = tmp / "wheels"
        tag = python.replace(".", "")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", wheels,
             "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}",
             "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
             "--platform", "manylinux_2_28_x86_64", *(f"{n}=={v}" for n, v in versions.items())],
            check=True,
        )  # fmt: skip
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp / "site")  # a wheel unpacked is what pip installs, scripts aside
        shutil.rmtree(wheels)
        (tmp / "data").mkdir()
        for f in DATA_FILES:
            shutil.copy2(data / f, tmp / "data" / f)
        predicted = predictions(p)
        write_json(tmp / "predicted.json", predicted)
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) / 2**20
        manifest = {
            "python": python,
            "wheels": versions,
            "data": {"from": str(data), "files": list(DATA_FILES), "stands_in_for": "MNIST (same shapes)"},
            "predicted": f"study-scale trace of {len(predicted['rows'])} variants, torch {predicted['torch']}",
            "size_mib": round(size, 1),
        }
        if size > LIMIT_MIB:
            raise SystemExit(f"error: the bundle is {size:.1f} MiB, over the {LIMIT_MIB} MiB a call can carry")
        write_json(tmp / "manifest.json", manifest)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def predictions(p: Any) -> dict[str, Any]:
    """Every variant's study-scale trace (CUDA's rules emulated, the allocator's model): what the GPU is held to."""
    import torch

    from gradaccum import allocator, trace
    from gradaccum.records import FORMAT

    start = time.perf_counter()
    rows = [trace.trace_variant(p, v, "study") for v in p.variants]
    return {
        "format": FORMAT,  # the report reads it as reports/trace.json
        "rows": rows,
        "torch": torch.__version__,
        "gpu_assumptions": allocator.GPU_ASSUMPTIONS,
        "made": f"on {platform.node()} ({platform.machine()}), before the GPU run",
        "compute_seconds": round(time.perf_counter() - start, 1),
    }


def preflight(out: Path) -> dict[str, Any]:
    """Versions, the GPU, the imports, and one float16 step with GradScaler on the study's model, with PyTorch's
    memory counters and its allocator history (CUDA only): the machine can run the study, in seconds."""
    from importlib.metadata import version

    import torch

    facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    facts["bundle"] = read_json(Path(os.environ.get("DEVICE_BUNDLE", BUNDLE)) / "manifest.json")  # data: Fashion-MNIST
    facts["packages"] = {n: _version(version, n) for n in ("timm", "pandas", "seaborn", "pyyaml", "psutil", *BUNDLED)}
    facts["cuda"] = {"available": torch.cuda.is_available(), "built_for": torch.version.cuda}
    facts["nvidia_smi_L"] = _command(["nvidia-smi", "-L"])
    start = time.perf_counter()
    import pydantic

    import gradaccum.report.traced  # noqa: F401 - the heaviest import of the parts to come
    from gradaccum import autocast_policy, params, trace  # noqa: F401

    facts["pydantic_from"] = str(Path(pydantic.__file__).parent.parent)  # the bundle's site, on the device

    facts["imports_seconds"] = round(time.perf_counter() - start, 2)
    facts["autocast_lists"] = str(autocast_policy.difference() or "the pinned ones")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        facts["cuda"] |= {"device": torch.cuda.get_device_name(0), "cudnn": torch.backends.cudnn.version()}
    facts["step"] = one_step(params.load(), device, out / OUT_FILES["snapshot"])
    write_json(out / OUT_FILES["preflight"], facts)
    return facts


def _version(version: Callable[[str], str], name: str) -> str | None:
    """The installed (or bundled: its wheels' dist-info come along) version; None where the package is absent."""
    from importlib.metadata import PackageNotFoundError

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _command(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"failed: {err}"


def one_step(p: Any, device: Any, snapshot: Path) -> dict[str, Any]:
    """One optimizer step of the baseline's model at micro-batch 1024 through the study's loop, at the study's
    precision (float16 autocast and GradScaler on a GPU, float32 on a CPU); PyTorch's allocated and reserved peaks
    and the allocator history of the step (dumped whether or not GradScaler skipped the step, as its first often
    does)."""
    import torch

    from gradaccum.accumulation import schedule
    from gradaccum.experiment import variant_model
    from gradaccum.loop import Learner, train_epoch
    from gradaccum.memory import MIB
    from gradaccum.records import Hardware
    from gradaccum.spec import resolve

    cuda = device.type == "cuda"
    spec = resolve(p, p.roles.baseline, Hardware.nominal("study" if cuda else "cpu"), accum=1)
    model, dtype = variant_model(spec, spec.seed, device), spec.dtype
    learner = Learner.of(model, spec, device)
    images = torch.randint(0, 256, (1024, 28, 28), dtype=torch.uint8, device=device)
    labels = torch.randint(0, p.model.num_classes, (1024,), device=device)
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    start = time.perf_counter()
    order = torch.arange(1024, device=device)
    run = train_epoch(learner, images, labels, order, schedule(1024, 1024, 1))
    loss, skipped = run.loss, run.skipped
    step = {"device": device.type, "amp": str(dtype), "micro_batch": 1024, "loss": loss}
    step["seconds"] = round(time.perf_counter() - start, 2)
    step["scaler_skipped"] = skipped > 0  # its first step often is
    if cuda:
        tmp = snapshot.with_name(snapshot.name + ".tmp")
        torch.cuda.memory._dump_snapshot(str(tmp))
        os.replace(tmp, snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
        step |= {
            "torch_max_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
            "torch_max_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
            "snapshot": f"{snapshot.name} (open at pytorch.org/memory_viz)",
        }
    else:
        step["snapshot"] = "none: PyTorch's allocator history is CUDA's"
    return step


def pack(out: Path, name: str, reports: Path, data: Path, variants: list[str]) -> None:
    """The variants' outputs (record, curves, timeline, nvidia-smi snapshot; not the weights) into OUT/<name>.json,
    merged with what is there: one file for all of them, as OUT brings back 8 files."""
    target = out / OUT_FILES[name]
    packed = read_json(target) or {"variants": {}}
    for meta in ("hardware.json", "provenance.json"):
        if (data / meta).exists():
            packed[meta] = json.loads((data / meta).read_text())
    if (reports / "trace.json").exists():  # the prediction the bundle carried, made before the GPU ran
        packed["trace.json"] = json.loads((reports / "trace.json").read_text())
    packed["params.yaml"] = Path("params.yaml").read_text()
    for v in variants:
        folder = reports / "variants" / v
        files = {f.name: f.read_text() for f in sorted(folder.iterdir()) if f.is_file() and f.suffix != ".pickle"}
        packed["variants"][v] = files
    write_json(target, packed)


def unpack(out: Path, dest: Path) -> list[str]:
    """A device run's files as the pipeline's reports: variants/<v>/..., hardware.json, provenance.json, params.yaml,
    trace.json (the prediction carried there), and the device's own files beside them."""
    written = []
    for name in ("memory", "training"):
        packed = read_json(out / OUT_FILES[name])
        if not packed:
            continue
        base = dest if name == "memory" else dest / "training"
        for v, files in packed["variants"].items():
            for fname, text in files.items():
                (base / "variants" / v).mkdir(parents=True, exist_ok=True)
                (base / "variants" / v / fname).write_text(text)
            written.append(f"{base.relative_to(dest.parent)}/variants/{v}")
        for meta in ("hardware.json", "provenance.json", "trace.json"):
            if meta in packed:
                write_json(base / meta, packed[meta])
        (base / "params.yaml").write_text(packed["params.yaml"])
    for f in out.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    return written


def device_trace(out: Path, variants: list[str] | None = None) -> dict[str, Any]:
    """Each variant's study-scale step traced twice on the device: on fake CPU tensors under the emulated CUDA
    policy (the device's torch, its lists' difference named), and on fake CUDA tensors under CUDA's own autocast.
    Written after every trace; a failure is one line in its place, and the next trace runs."""
    import torch

    from gradaccum import params, trace

    p = params.load()
    result: dict[str, Any] = {"torch": torch.__version__, "rows": []}
    for v in variants or list(p.variants):
        for native in (False, True):
            row: dict[str, Any] = {"variant": v, "scale": "study", "native": native}
            try:
                row |= trace.trace_variant(p, v, "study", native=native)
            except Exception as err:  # the next trace still runs; this one says why in one line
                row["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}" if str(err) else repr(err)
            result["rows"].append(row)
            write_json(out / OUT_FILES["trace"], result)
            print(f"trace {v} ({'native' if native else 'emulated'}): " + _trace_line(row), flush=True)
    return result


def _trace_line(row: dict[str, Any]) -> str:
    if "failed" in row:
        return row["failed"]
    return f"{row['peak_mib'] / 1024:.2f} GiB of tensors, nvidia-smi {row.get('gpu_nvidia_smi_mib', 0) / 1024:.2f}"


def native_trace_json(out: Path, dest: Path) -> bool:
    """The native traces as a trace.json that gradaccum.report.traced reads; False, saying why, when none succeeded."""
    native = [r for r in read_json(out / OUT_FILES["trace"]).get("rows", []) if r.get("native")]
    rows = [r for r in native if "peak_mib" in r]
    if rows:
        write_json(dest, {"rows": rows})
    else:
        why = native[0].get("failed", "?") if native else "none ran"
        print(f"no trace under CUDA's own autocast succeeded ({why})", flush=True)
    return bool(rows)


def epochs_that_fit(out: Path, seconds_left: float, variants: int = 2) -> int:
    """Epochs of `variants` trainings that fit in `seconds_left`, from part 2's one-epoch runs (their stage time,
    start-up included, for the slowest of baseline and accumulation), with a third to spare; at most the study's 10."""
    packed = read_json(out / OUT_FILES["memory"]).get("variants", {})
    times = []
    for v in ("baseline", "accumulation"):
        if "metrics.json" in packed.get(v, {}):
            m = json.loads(packed[v]["metrics.json"])
            if m.get("completed"):
                times.append((m["stage_seconds"] - m["train_seconds"], m["train_seconds"]))
    if len(times) < 2:
        return 0
    startup, epoch = max(t[0] for t in times), max(t[1] for t in times)
    return max(0, min(10, int((seconds_left / 1.33 / variants - startup) // max(epoch, 1e-3))))


def record_status(out: Path, part: str, rc: int, seconds: float, log: Path) -> None:
    """A part's outcome into status.json: ok, its seconds, and on failure the last line it printed."""
    status = read_json(out / OUT_FILES["status"]) or {"parts": []}
    entry: dict[str, Any] = {"part": part, "ok": rc == 0, "exit": rc, "seconds": round(seconds, 1)}
    if rc != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
        entry["line"] = lines[-1][:500] if lines else "(no output)"
        if rc == 124:
            entry["line"] = f"ran past its time (timeout); last line: {entry['line']}"
    status["parts"].append(entry)
    write_json(out / OUT_FILES["status"], status)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bundle", help="build the folder the device call carries (here)")
    b.add_argument("--dest", type=Path, default=BUNDLE)
    b.add_argument("--python", default="3.12", help="the device's Python (its wheels' tag)")
    b.add_argument("--data", type=Path, default=FASHION, help="a folder with the four IDX .gz files")
    b.add_argument("--params", type=Path, default=Path("params.yaml"))
    b.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE")
    for name in ("preflight", "trace"):
        sub.add_parser(name).add_argument("out", type=Path)
    pk = sub.add_parser("pack")
    pk.add_argument("out", type=Path)
    pk.add_argument("name", choices=["memory", "training"])
    pk.add_argument("variants", nargs="+")
    nt = sub.add_parser("native-trace-json")
    nt.add_argument("out", type=Path)
    nt.add_argument("dest", type=Path)
    e = sub.add_parser("epochs")
    e.add_argument("out", type=Path)
    e.add_argument("seconds_left", type=float)
    s = sub.add_parser("status")
    s.add_argument("out", type=Path)
    s.add_argument("part")
    s.add_argument("rc", type=int)
    s.add_argument("seconds", type=float)
    s.add_argument("log", type=Path)
    u = sub.add_parser("unpack", help="a device run's files as the pipeline's reports (here)")
    u.add_argument("out", type=Path)
    u.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "bundle":
        manifest = build_bundle(args.dest, args.python, args.data, args.params, args.set)
        print(f"{args.dest}/: {manifest['size_mib']} MiB for python {args.python}; {manifest['predicted']}")
    elif args.command == "preflight":
        print(json.dumps(preflight(args.out), indent=1, default=str))
    elif args.command == "trace":
        device_trace(args.out)
    elif args.command == "pack":
        pack(args.out, args.name, Path("reports"), Path("data"), args.variants)
    elif args.command == "native-trace-json":
        sys.exit(0 if native_trace_json(args.out, args.dest) else 1)
    elif args.command == "epochs":
        print(epochs_that_fit(args.out, args.seconds_left))
    elif args.command == "status":
        record_status(args.out, args.part, args.rc, args.seconds, args.log)
    elif args.command == "unpack":
        args.dest.mkdir(parents=True, exist_ok=True)
        for line in unpack(args.out, args.dest):
            print(line)


if __name__ == "__main__":
    main()
