"""Memory of the simulated federation: bytes of persistent state per client and on the server,
and what one round gathers and scatters, for each algorithm in the papers' settings.

Counted from the shapes of ``engine.init`` (``jax.eval_shape``: nothing is allocated), so the
numbers are exact for this code. Projects the client state to populations of 10^3-10^6 clients.

    python experiments/bench/state_memory.py --data-dir ../shared/data --out experiments/results/perf/state_memory.json
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import jax

import fedjax_sparse as fjs

FMNIST = dict(dataset="fashion_mnist", model="lenet5_caffe", num_clients=100, clients_per_round=10, local_epochs=5,
              batch_size=64, partition="dirichlet:0.2", min_client_samples=64, preprocess="raw")
FSL_MNIST = dict(dataset="mnist", model="fsl_lenet", num_clients=1000, clients_per_round=25, local_epochs=2,
                 batch_size=8, partition="dirichlet_split:1.0:0.8")
FEDDROP = dict(dataset="fashion_mnist", model="feddrop_fmnist_cnn", num_clients=100, clients_per_round=100,
               local_epochs=1, batch_size=4, partition="dirichlet:0.5")

SETTINGS = {
    "spafl (FMNIST)": dict(FMNIST, algorithm="spafl", lr=0.001,
                           options={"momentum": "0.9", "keep_optimizer_state": "true"}),
    "fedavg (FMNIST)": dict(FMNIST, algorithm="fedavg", lr=0.001, options={"momentum": "0.9"}),
    "local (FMNIST)": dict(FMNIST, algorithm="local", lr=0.001),
    "scaffold (FMNIST)": dict(FMNIST, algorithm="scaffold", lr=0.01),
    "fedpm (FMNIST)": dict(FMNIST, algorithm="fedpm", lr=0.15, preprocess="unit"),
    "heterofl (FMNIST)": dict(FMNIST, algorithm="heterofl", lr=0.001),
    "fjord (FMNIST)": dict(FMNIST, algorithm="fjord", lr=0.01),
    "feddrop (FMNIST, 100 per round)": dict(FEDDROP, algorithm="feddrop", lr=0.01),
    "fsl (MNIST, 1000 clients)": dict(FSL_MNIST, algorithm="fsl", lr=0.4),
    "fedavg (MNIST LeNet, 1000 clients)": dict(FSL_MNIST, algorithm="fedavg", lr=0.01),
}
POPULATIONS = (10 ** 3, 10 ** 4, 10 ** 5, 10 ** 6)


def tree_bytes(tree) -> int:
    return sum(int(math.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def measure(name: str, spec: dict, data_dir: str) -> dict:
    config = fjs.RunConfig(**{**spec, "data_dir": data_dir, "rounds": 1})
    exp = fjs.build(config)
    state = jax.eval_shape(exp.engine.init, jax.random.PRNGKey(0))
    n, k = config.num_clients, config.clients_per_round
    client_total = tree_bytes(state.clients)
    per_client = client_total // n if n else 0
    return {
        "setting": name, "algorithm": config.algorithm, "model": exp.model.name, "num_params": exp.model.num_params,
        "num_clients": n, "clients_per_round": k,
        "client_state_bytes_per_client": per_client,
        "client_state_fields": sorted(getattr(state.clients, "_fields", ())) or None,
        "server_state_bytes": tree_bytes(state.server),
        # Each client's data is a padded row of pool indices (train and test) plus two counts.
        "client_index_bytes_per_client": (exp.data.train_idx.nbytes + exp.data.test_idx.nbytes) // n + 8,
        "data_pool_bytes": exp.data.train_x.nbytes + exp.data.test_x.nbytes,
        # What a round moves inside the device: the cohort's rows gathered, then written back.
        "cohort_state_bytes_per_round": 2 * k * per_client,
        "client_state_bytes_at": {str(p): p * per_client for p in POPULATIONS},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [measure(name, SETTINGS[name], args.data_dir) for name in args.settings]
    print("| setting | params | state per client | index rows per client | server state | cohort gather+scatter "
          "| state at 10^5 clients |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["setting"], f"{r['num_params']:,}", f"{r['client_state_bytes_per_client'] / 2**20:.3f} MiB",
                 f"{r['client_index_bytes_per_client'] / 2**10:.1f} KiB", f"{r['server_state_bytes'] / 2**20:.3f} MiB",
                 f"{r['cohort_state_bytes_per_round'] / 2**20:.1f} MiB",
                 f"{r['client_state_bytes_at'][str(10**5)] / 2**30:.1f} GiB"]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"what": __doc__.split("\n\n")[0], "rows": rows,
                                              "jax": jax.__version__}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
