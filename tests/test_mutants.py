"""benchmarks/mutants.py: every mutant still applies to the code, and one is run end to end and caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_once_and_names_tests_that_exist(mutant: mutants.Mutant, tmp_path: Path) -> None:
    """A mutant whose text the code no longer holds would be an error in the check: caught here first."""
    (tmp_path / mutant.path).parent.mkdir(parents=True)
    (tmp_path / mutant.path).write_text((mutants.ROOT / mutant.path).read_text())
    mutants.apply(mutant, tmp_path)
    text = (tmp_path / mutant.path).read_text()
    assert all(new in text for _, new in ((mutant.old, mutant.new), *mutant.also))
    for target in mutant.tests:
        file, _, name = target.partition("::")
        assert (mutants.ROOT / file).is_file(), target
        assert not name or f"def {name}(" in (mutants.ROOT / file).read_text(), target


def test_a_mutant_that_does_not_apply_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    with pytest.raises(ValueError, match="holds 'x = 1' 2 times, not once"):
        mutants.apply(mutants.Mutant("twice", "a.py", "x = 1", "x = 2", ()), tmp_path)


@pytest.mark.slow
def test_the_pid_mutant_is_caught_by_the_sampler_tests(tmp_path: Path) -> None:
    """One mutant through the whole check: a fresh copy of the tree, the line replaced, its tests failing."""
    [pid] = [m for m in mutants.MUTANTS if "PID" in m.name]
    result = mutants.run_mutant(pid, tmp_path)
    assert result["verdict"] == "caught", result
