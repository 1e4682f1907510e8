"""Write outputs whole or not at all: a temp file beside the target, renamed over it only when complete."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gradaccum.refusal import BadInput


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temp path in the target's folder; on success rename it to path, on error remove it.

    The file gets the mode a plain open() would give (0666 less the umask), not mkstemp's 0600,
    so a report written in a container or on a shared machine can be read by others.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def current_umask() -> int:
    """The process's umask; reading it means setting it, so it is set straight back."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path | str, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json(path: Path | str) -> Any:
    return json.loads(Path(path).read_text())


class MissingInput(BadInput, FileNotFoundError):
    """A stage's input that is not there or cannot be read: another stage makes it (after a refused `dvc repro`,
    DVC has already removed that stage's outputs)."""


def read_input(path: Path | str, made_by: str) -> Any:
    """A stage's JSON input; missing or unreadable, one line naming the file and the command that makes it."""
    try:
        return read_json(path)
    except FileNotFoundError:
        raise MissingInput(f"{path} is missing: `dvc repro {made_by}` makes it") from None
    except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise MissingInput(
            f"{path} cannot be read ({type(err).__name__}: {err}): `dvc repro -f {made_by}` makes it again"
        ) from None


def write_table(
    path: Path | str, rows: Sequence[dict[str, Any]], columns: Sequence[str], delimiter: str = "\t"
) -> None:
    """A TSV (or CSV) with a header even when there are no rows, so DVC plots and pandas can read it."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(columns), delimiter=delimiter, extrasaction="raise")
            writer.writeheader()
            writer.writerows(rows)
