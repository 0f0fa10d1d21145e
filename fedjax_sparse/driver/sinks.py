"""Extra logs next to ``metrics.jsonl`` (which stays the contract): ``--log csv`` and
``--log tensorboard`` (comma-separated for both).

* ``csv``: ``OUT/metrics.csv``, rewritten from all rows at every evaluation (so a resumed run's
  file is exactly its rows; columns are the union of the keys, in first-seen order).
* ``tensorboard``: event files in ``OUT/tensorboard/`` through tensorboardX (optional extra
  ``tensorboard``), one scalar per numeric key, step = round. After a resume TensorBoard shows the
  re-run rounds once more; their values are identical.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from fedjax_sparse.errors import RunError, arg

LOG_KINDS = ("csv", "tensorboard")


def parse_log(spec: str) -> tuple[str, ...]:
    """``"csv,tensorboard"`` -> ("csv", "tensorboard"); "" -> (); one-line error for unknown kinds."""
    kinds = tuple(k.strip() for k in (spec or "").split(",") if k.strip() and k.strip() != "jsonl")
    unknown = [k for k in kinds if k not in LOG_KINDS]
    if unknown:
        raise RunError(f"unknown {arg('log', ', '.join(unknown))}; valid: {', '.join(LOG_KINDS)} (comma-separated; "
                       "metrics.jsonl is always written)")
    return kinds


class MetricSinks:
    def __init__(self, out: Path | None, spec: str):
        self.out, self.kinds = out, parse_log(spec)
        self._tb = None
        if out is None or not self.kinds:
            return
        if "tensorboard" in self.kinds:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise RunError(f"{arg('log', 'tensorboard')} needs tensorboardX: "
                               "pip install 'fedjax_sparse[tensorboard]'") from None
            self._tb = SummaryWriter(logdir=str(out / "tensorboard"))

    def write(self, rows: list[dict]) -> None:
        """Called after every evaluation with all rows so far (the last one is new)."""
        if self.out is None or not rows:
            return
        if "csv" in self.kinds:
            columns = list(dict.fromkeys(k for row in rows for k in row))   # their union, in first-seen order
            path = self.out / "metrics.csv"
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns, restval="")
                writer.writeheader()
                writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
            os.replace(tmp, path)
        if self._tb is not None:
            row = rows[-1]
            for key, value in row.items():
                if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, global_step=int(row["round"]))
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
