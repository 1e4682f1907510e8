"""gradaccum-fit, installed: `pip install .` gives the command, which parses before it imports torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from gradaccum import choices, hf, spec, trace

ROOT = Path(__file__).resolve().parent.parent


def test_the_light_choices_are_the_ones_the_engine_acts_on() -> None:
    assert tuple(spec.AMP_DTYPES) == choices.AMP
    assert tuple(trace.OPTIMIZERS) == choices.OPTIMIZERS
    assert all(hf.auto_class(task) for task in choices.TASKS)


def run(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False)


def test_help_and_bad_options_are_answered_before_torch_is_imported() -> None:
    code = (
        "import sys\nfrom gradaccum import cli\n"
        "for argv in (['--help'], ['resnet50', '--lora', '4'], ['resnet50', '--seq-len', '0']):\n"
        "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    )
    out = run(sys.executable, "-c", code)
    assert "torch not imported" in out.stdout and "usage: gradaccum-fit" in out.stdout
    assert "--lora 4: only for hf:NAME models" in out.stderr and "--seq-len 0 is not allowed" in out.stderr


def test_the_wheel_installs_a_gradaccum_fit_command_that_runs(tmp_path: Path) -> None:
    """Built from a copy of the package (nothing of the checkout on the path), installed without its dependencies
    (this venv has them), run from elsewhere: the command answers for a timm model."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "gradaccum", src / "gradaccum", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", ".",
                cwd=src)  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (src / "dist").glob("gradaccum-*.whl")
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA"))
    requires = [line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if line.startswith("Requires")]
    assert not any("dvc" in r or "pandas" in r or "seaborn" in r for r in requires)
    assert any("transformers" in r and 'extra == "hf"' in r for r in requires)
    site = tmp_path / "site"
    installed = run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel))
    assert installed.returncode == 0, installed.stderr
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    out = run(str(site / "bin" / "gradaccum-fit"), "test_resnet", "--input", "3x32x32", "--batch", "8", "--cards", "8",
              cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("test_resnet: input images 3x32x32, 10 classes, batch 8")
    where = run(sys.executable, "-c", "import gradaccum; print(gradaccum.__file__)", cwd=tmp_path, env=env)
    assert where.stdout.startswith(str(site))
