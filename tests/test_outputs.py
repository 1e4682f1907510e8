"""Outputs are written whole or not at all, and readable by others as a plain open() would make them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gradaccum.outputs import atomic_path, write_json, write_table


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_get_the_mode_of_a_plain_open(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        write_json(tmp_path / "metrics.json", {"a": 1})
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "metrics.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o666 & ~umask


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "table.tsv"
    write_table(target, [{"a": 1}], ["a"])
    with pytest.raises(ValueError):
        write_table(target, [{"a": 2, "b": 3}], ["a"])  # a column the header lacks: csv refuses mid-write
    assert target.read_text() == "a\n1\n" and [p.name for p in tmp_path.iterdir()] == ["table.tsv"]
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert target.read_text() == "a\n1\n" and [p.name for p in tmp_path.iterdir()] == ["table.tsv"]
