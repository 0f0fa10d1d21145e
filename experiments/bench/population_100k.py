"""100,000 SpaFL clients on this 24 GB machine (issue 12, item 3): the population's personal
state stays in host memory (fedjax_sparse.driver.population), only each chunk's cohort rows go to the
device.

SpaFL as in experiments/reproduce/spafl_fmnist.py (LeNet-5-Caffe, 10 clients per round, 5 local epochs,
batch 64, raw inputs, lr 1e-3, alpha 0.002, momentum 0.9, optimiser state kept), on EMNIST-letters
(26 classes). 124,800 training images cannot give 100,000 clients disjoint data of a useful size,
so each client draws 256 training (``--train-per-client``) and 16 test images *with replacement*
from the pools, with its own Dirichlet(0.2) class mix (the same mix for its train and test images):
clients overlap in images, not in models. Every ``--eval-every`` rounds the personal models of
(a) every client trained so far and (b) a fixed random sample of ``--eval-sample`` clients are
evaluated.

    python experiments/bench/population_100k.py --data-dir ../shared/data --storage float32 \
        --out experiments/results/perf/population_100k_float32.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse.driver import population
from fedjax_sparse.driver.config import validate
from fedjax_sparse.data.federated import build_federated_data
from fedjax_sparse.data.partitions import Partition
from fedjax_sparse.driver.experiment import auto_eval_batch_size


def draw_clients(labels: np.ndarray, proportions: np.ndarray, per_client: int, rng) -> list[np.ndarray]:
    """Per client, ``per_client`` pool indices drawn with replacement: labels from the client's
    class mix ``proportions`` [N, C], then an image of that label uniformly."""
    order = np.argsort(labels, kind="stable")
    classes, starts, sizes = np.unique(labels[order], return_index=True, return_counts=True)
    cumulative = proportions.cumsum(1)
    rows = []
    for block in range(0, len(proportions), 10_000):  # bounded temporaries
        cum = cumulative[block:block + 10_000]
        u = rng.random((len(cum), per_client))
        label_pos = np.minimum((u[..., None] > cum[:, None, :]).sum(-1), len(classes) - 1)
        pick = starts[label_pos] + (rng.random(label_pos.shape) * sizes[label_pos]).astype(np.int64)
        rows.extend(np.sort(order[pick], axis=1))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--num-clients", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--chunk-rounds", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-sample", type=int, default=1000)
    ap.add_argument("--storage", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--preprocess", default="raw", help="raw (spafl_fmnist.py's choice) | unit | standardize")
    ap.add_argument("--train-per-client", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    config = fjs.RunConfig(
        algorithm="spafl", dataset="emnist_letters", data_dir=args.data_dir, model="lenet5_caffe",
        num_clients=args.num_clients, clients_per_round=10, local_epochs=5, batch_size=64, lr=0.001,
        partition="iid", preprocess=args.preprocess, rounds=args.rounds, seed=args.seed,
        options={"alpha": "0.002", "momentum": "0.9", "keep_optimizer_state": "true"})
    from fedjax_sparse.data import datasets
    dataset = datasets.load_dataset("emnist_letters", args.data_dir)
    rng = np.random.default_rng(args.seed)
    mix = rng.dirichlet(np.full(dataset.num_classes, 0.2), size=args.num_clients)
    partition = Partition(train_indices=draw_clients(np.asarray(dataset.train_y), mix, args.train_per_client, rng),
                          test_indices=draw_clients(np.asarray(dataset.test_y), mix, 16, rng),
                          test_from_train=False, spec="dirichlet_with_replacement:0.2",
                          num_classes=dataset.num_classes)
    data = build_federated_data(dataset, partition, preprocess=args.preprocess)
    # The experiment's model, algorithm and engine; its own 100k-client partition is replaced.
    exp = fjs.build(dataclasses.replace(config, num_clients=dataset.num_classes, clients_per_round=10))
    from fedjax_sparse.algorithms import make_algorithm
    task = dataclasses.replace(exp.task, num_clients=args.num_clients)
    engine = dataclasses.replace(exp.engine, algorithm=make_algorithm("spafl", task, validate(config)),
                                 num_clients=args.num_clients, eval_batch_size=auto_eval_batch_size(data))
    setup_seconds = time.perf_counter() - t_start
    resident_bytes = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree_util.tree_leaves(
        jax.eval_shape(engine.init, jax.random.PRNGKey(0)).clients))

    state, pop = population.init(engine, jax.random.PRNGKey(args.seed),
                                 storage_dtype=jnp.bfloat16 if args.storage == "bfloat16" else None)
    sample = np.sort(np.random.default_rng(args.seed + 1).choice(args.num_clients, args.eval_sample, replace=False))
    rows, trained = [], np.zeros(args.num_clients, bool)
    train_seconds = eval_seconds = 0.0
    first_chunk_seconds = None
    done = 0
    while done < args.rounds:
        n = min(args.eval_every, args.rounds - done)
        trained[np.unique(engine.cohorts(state.key, done, n))] = True
        t = time.perf_counter()
        state, metrics = population.run_rounds(engine, state, pop, data, n, args.chunk_rounds)
        seconds = time.perf_counter() - t
        if first_chunk_seconds is None:
            first_chunk_seconds = seconds
        else:
            train_seconds += seconds
        done += n
        t = time.perf_counter()
        touched_eval = population.evaluate_clients(engine, state, pop, data, np.flatnonzero(trained))
        sample_eval = population.evaluate_clients(engine, state, pop, data, sample)
        eval_seconds += time.perf_counter() - t
        row = {"round": done, "loss": float(metrics[-1]["loss"][-1]),
               "accuracy_trained_clients": touched_eval["accuracy"],
               "trained_clients": int(trained.sum()),
               "accuracy_random_sample": sample_eval["accuracy"],
               "density": float(metrics[-1]["density"][-1]) if "density" in metrics[-1] else None,
               "host_state_mib": pop.nbytes / 2 ** 20,
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        rows.append(row)
        print(json.dumps(row), flush=True)
    steady_rounds = args.rounds - min(args.eval_every, args.rounds)
    report = {
        "what": f"SpaFL LeNet-5-Caffe, EMNIST-letters images drawn with replacement ({args.train_per_client} "
                "train / 16 test per client, Dirichlet(0.2) class mix), 10 clients per round, population state "
                "in host memory (copy-on-write), cohort rows moved per chunk of rounds",
        "command": f"python experiments/bench/population_100k.py --data-dir ../shared/data --storage {args.storage} "
                   f"--num-clients {args.num_clients} --rounds {args.rounds} --chunk-rounds {args.chunk_rounds} "
                   f"--eval-every {args.eval_every} --eval-sample {args.eval_sample} --seed {args.seed} "
                   f"--preprocess {args.preprocess} --train-per-client {args.train_per_client} "
                   f"--out {args.out}",
        "num_clients": args.num_clients, "rounds": args.rounds, "storage": args.storage,
        "state_bytes_per_client": pop.row_bytes,
        "device_resident_state_would_need_gib": resident_bytes / 2 ** 30,
        "clients_touched": pop.touched, "host_state_mib": pop.nbytes / 2 ** 20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "setup_seconds": setup_seconds, "first_chunk_seconds_incl_compile": first_chunk_seconds,
        "rounds_per_second_after_first_chunk": steady_rounds / train_seconds if train_seconds else None,
        "evaluation_seconds_total": eval_seconds,
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(), "jax": jax.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
