"""How much work each client schedule wastes on the papers' settings: the local steps the
sampled clients need ("useful") versus the steps a schedule runs ("executed", padding included),
over many sampled cohorts. ``map`` runs exactly the useful steps; ``vmap`` runs every client for
the cohort's longest count; ``bucketed`` sorts the cohort by step count and pads each lockstep
bucket only to its own longest client. Pure counting on the real partitions (no training), so it
runs in seconds on any machine; the speed each schedule reaches is hardware-dependent and lives in
the round benchmarks.

    python experiments/bench/padding_waste.py --data-dir ../shared/data \\
        --out experiments/results/perf/padding_waste.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers
from fedjax_sparse.core.engine import executed_client_steps


def settings(data_dir: str) -> dict[str, fjs.RunConfig]:
    return {
        "spafl_fmnist (100 clients, 10/round, 5 epochs, batch 64, Dirichlet 0.2)": fjs.RunConfig.from_json(
            dict(algorithm="fedavg", data_dir=data_dir, **papers.SPAFL_FMNIST_BASE)),
        "fsl_mnist (1000 clients, 25/round, 2 epochs, batch 8, Dirichlet 1.0 split)": fjs.RunConfig.from_json(
            dict(algorithm="fedavg", data_dir=data_dir, **papers.FSL_MNIST_BASE)),
        "feddrop_fmnist full (100 clients, 100/round, 1 epoch, batch 4, Dirichlet 0.5)": fjs.RunConfig.from_json(
            dict(algorithm="fedavg", data_dir=data_dir, local_epochs=1,
                 **dict(papers.FEDDROP_FMNIST_BASE, **papers.FEDDROP_PARTICIPATION["full"]))),
    }


def bucketed_steps(steps: np.ndarray, bucket: int) -> int:
    """Local steps the bucketed schedule (removed in 0.2.0: no wall-clock win recorded) executed for
    clients needing ``steps`` [K]: the cohort sorted by step count, lockstep buckets of ``bucket``, the
    remainder one smaller bucket, each padded to its longest client."""
    ordered = np.sort(steps)
    return int(sum(ordered[i:i + bucket].max() * len(ordered[i:i + bucket]) for i in range(0, len(ordered), bucket)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--rounds", type=int, default=200, help="sampled cohorts per setting")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = {"rounds": args.rounds, "settings": []}
    for name, config in settings(args.data_dir).items():
        exp = fjs.build(config)
        engine, data = exp.engine, exp.data
        key = jax.random.PRNGKey(config.seed)
        counts = np.asarray(data.train_count)
        k = config.clients_per_round
        buckets = sorted({max(1, k // 8), max(1, k // 4), max(1, k // 2)})
        useful = 0
        executed = {"map": 0, "vmap": 0, **{f"bucketed_{b}": 0 for b in buckets}}
        for r in range(args.rounds):
            ids = np.asarray(engine.cohort(key, jnp.int32(r)))
            steps = jnp.asarray(config.local_epochs * -(-counts[ids] // config.batch_size), jnp.int32)
            useful += int(steps.sum())
            executed["map"] += int(executed_client_steps(steps, "map"))
            executed["vmap"] += int(executed_client_steps(steps, "vmap"))
            for b in buckets:
                executed[f"bucketed_{b}"] += bucketed_steps(np.asarray(steps), b)
        entry = {"setting": name, "clients_per_round": k,
                 "client_steps_min_median_max": [int(v) for v in np.percentile(
                     config.local_epochs * -(-counts // config.batch_size), [0, 50, 100])],
                 "useful_client_steps": useful,
                 "executed_client_steps": executed,
                 "executed_per_useful": {m: e / useful for m, e in executed.items()}}
        print(json.dumps(entry, indent=2), flush=True)
        result["settings"].append(entry)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
