"""Per-round curves of this project's runs and of the authors'-code drivers, for side-by-side tables.

A curve is ``{"source", "seed", "finished", "rows": [{"round", "accuracy" (percent), "density", ...}]}``:

* ``read_ours(folder)``: a project run folder (``metrics.jsonl``; accuracy is a fraction there and
  is converted to percent; density is ``density_all_clients`` when recorded, else ``density``, the
  mean over the round's sampled clients);
* ``read_authors(folder)``: a folder written by a driver of ``experiments/tools/sidebyside/``
  (``curve.json``; accuracy already in percent).

``at_round`` reads one round of a curve (None when it was not evaluated), ``summarise`` gives n, mean
and sample std over runs. ``experiments/tools/spafl_vs_authors.py`` and ``compare_run_groups.py``
build their tables and plots from these.
"""
from __future__ import annotations

import json
import math
from pathlib import Path


def read_authors(folder: Path) -> dict:
    doc = json.loads((folder / "curve.json").read_text())
    rows = [{"round": int(r["round"]), "accuracy": float(r["accuracy"]), "density": float(r["density"]),
             "seconds": float(r.get("round_seconds", float("nan")))} for r in doc["rounds"]]
    return {"source": str(folder), "seed": doc.get("seed"), "finished": bool(doc.get("finished", False)),
            "rows": rows}


def read_ours(folder: Path) -> dict:
    rows, prev = [], 0.0
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        if not line.strip():
            continue
        m = json.loads(line)
        dens = m.get("density_all_clients", m.get("density"))
        sec = float(m.get("seconds", float("nan")))
        rows.append({"round": int(m["round"]), "accuracy": 100.0 * float(m["accuracy"]),
                     "density": float(dens), "density_sampled": float(m.get("density", float("nan"))),
                     "seconds_cumulative": sec, "seconds": sec - prev})
        prev = sec
    config = folder / "config.json"
    cfg = json.loads(config.read_text()) if config.exists() else {}
    seed = cfg.get("config", cfg).get("seed")
    return {"source": str(folder), "seed": seed, "finished": (folder / "summary.json").exists(),
            "density_key": "density_all_clients" if rows and "density_all_clients" in lines[0]
            else "density (sampled clients)", "rows": rows}


def summarise(values: list[float]) -> dict:
    """n, mean and sample std (ddof 1; None below two values) of ``values``."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"n": n, "mean": mean, "std": std}


def at_round(run: dict, r: int, key: str = "accuracy"):
    """``key`` of round ``r`` of a curve, None when that round was not evaluated."""
    return next((row[key] for row in run["rows"] if row["round"] == r), None)
