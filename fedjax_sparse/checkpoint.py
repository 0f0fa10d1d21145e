"""A run's files on disk: the output directory, ``metrics.jsonl`` and checkpoints."""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.config import RunError
from fedjax_sparse.engine import EngineState

CHECKPOINT = "checkpoint.npz"


def save_checkpoint(path: Path, state: EngineState, totals: dict) -> None:
    """Atomic: write a temp file, then rename over the old checkpoint."""
    leaves = jax.tree_util.tree_leaves(jax.device_get(state))
    tmp = path.with_suffix(".tmp.npz")
    with open(tmp, "wb") as f:
        np.savez(f, *[np.asarray(x) for x in leaves], totals=json.dumps(totals))
    os.replace(tmp, path)


def read_metrics(out: str | Path) -> list[dict]:
    """The rows of ``OUT/metrics.jsonl`` (one per evaluated round); [] when there is none yet."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_checkpoint(path: Path, template: EngineState) -> tuple[EngineState, dict]:
    leaves, treedef = jax.tree_util.tree_flatten(template)
    try:
        with np.load(path) as f:
            loaded = [f[f"arr_{i}"] for i in range(len(leaves))]
            totals = json.loads(str(f["totals"]))
    except (OSError, KeyError, ValueError) as e:
        raise RunError(f"checkpoint {path} is unreadable or from another configuration ({e}); "
                       "start a fresh run in a new --out directory") from None
    for new, old in zip(loaded, leaves):
        if new.shape != old.shape:
            raise RunError(f"checkpoint {path} does not match this configuration (a leaf of shape "
                           f"{new.shape} where {old.shape} is expected); use a new --out directory")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in loaded]), totals


def prepare_out_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} exists and is not a directory; choose another --out")
    if resume:
        if not (out / CHECKPOINT).exists():
            raise RunError(f"nothing to resume in {out}: no {CHECKPOINT} there; run without --resume")
        return
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise RunError(f"output directory {out} is not empty (it holds a previous run); pass --resume "
                           "to continue it, --overwrite to replace it, or choose another --out")
        for name in ("config.json", "metrics.jsonl", "summary.json", CHECKPOINT):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
