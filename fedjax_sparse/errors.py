"""Every exception fedjax_sparse raises on purpose, in one place.

Each message is one line naming the problem and the fix; the CLI prints it after ``error:`` and exits
with status 2 (``RunStopped``: 128 + the signal's number). All but ``RunStopped`` are ``ValueError``s,
so ``except ValueError`` catches any user error.
"""
from __future__ import annotations

import signal
from pathlib import Path

__all__ = ["DataError", "PinningError", "RunError", "RunStopped"]


class RunError(ValueError):
    """A user error in a run's configuration or output directory."""


class DataError(ValueError):
    """User-facing data problem; the message names the file/problem and the fix (one line)."""


class PinningError(ValueError):
    """A pinned-draw file that cannot be used; the message names the file and the fix."""


class RunStopped(Exception):
    """A run stopped by SIGTERM or SIGINT after checkpointing (``round``: the rounds it completed).
    The CLI prints the message and exits with ``exit_code`` (128 + the signal's number)."""

    def __init__(self, signum: int, round_: int, out: Path | None):
        self.signal, self.round = signum, round_
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if out is None:
            what = "nothing was saved (no --out)"
        elif round_ == 0:
            what = "no round had finished, nothing to resume: run the same command again"
        else:
            what = f"continue with: python -m fedjax_sparse run --out {out} --resume"
        super().__init__(f"{name}: stopped at round {round_}; {what}")
