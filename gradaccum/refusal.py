"""Bad input, said in one line: by a stage, or by a process a stage started, which the stage passes on.

Every stage runs its main in `refusing`, which ends on bad input with `refuse(err)`: one line `error: ...` on
stderr and the exit status REFUSED, so a parent tells a refusal (pass its line on) from a crash (show its
traceback). torchrun would bury a rank's line under its own ChildFailedError traceback, so a rank started by
`distributed.relaunch` writes the line to the file that REFUSAL_FILE names instead, and the parent says it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

REFUSED = 65  # sysexits.h EX_DATAERR: the input was refused; the last line of stderr says why
REFUSAL_FILE = "GRADACCUM_REFUSAL_FILE"  # set by distributed.relaunch for its ranks


class BadInput(Exception):
    """Input the study cannot run with (params, data, model): what a stage ends on with `refuse`, not a traceback.
    Its text is the one line: the key or file, the bad value, what is allowed."""


class Refused(BadInput, ValueError):
    """A process this one started refused its input; the text is its one line, without `error: `."""


def refuse(err: Exception | str) -> NoReturn:
    """Exit with REFUSED after one line naming the key, the value and what is allowed (the error's text)."""
    line = f"error: {err}"
    if target := os.environ.get(REFUSAL_FILE):
        tmp = Path(f"{target}.{os.getpid()}")  # every rank may refuse at once: each renames a whole file
        tmp.write_text(line + "\n")
        os.replace(tmp, target)
    else:
        print(line, file=sys.stderr, flush=True)
    sys.exit(REFUSED)


def refusing(main: Callable[..., None], *args: Any) -> None:
    """A stage's `main(*args)`, ended by `refuse` on bad input (a child's refusal included)."""
    try:
        main(*args)
    except BadInput as err:
        refuse(err)


def check_child(returncode: int, stderr: str) -> None:
    """Raise Refused with the one line a child printed last when it refused its input; a crash passes."""
    lines = stderr.strip().splitlines()
    if returncode == REFUSED and lines:
        raise Refused(lines[-1].removeprefix("error: "))
