"""Personalised evaluation: lax.map over clients ("loop", the reference), one jitted call per
client with native convolutions ("per_client", the evaluator's only mode) and vmap over chunks of
clients ("batched"), side by side in one run on the SpaFL Fashion-MNIST setting (100
clients, each on its own test set with its personal masked LeNet-5-Caffe). Checks that all
give the same per-client counts and writes the timings as JSON. ``loop`` and ``batched`` live
here, no longer in the package (no recorded win: docs/design.md, "Execution modes");
tests/core/test_evaluation.py checks them against the evaluator.

    python experiments/bench/bench_eval.py --data-dir ../shared/data \\
        --out experiments/results/perf/eval_spafl_fmnist_cpu.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse.tools import timing
from fedjax_sparse.data.federated import ClientData, FederatedData
from fedjax_sparse.core.evaluation import EvalStats, Evaluator, hits_and_losses
from fedjax_sparse.core.training import gather_batch, steps_per_epoch

StatsFn = Callable[..., EvalStats]   # (state, data) -> [N] per-client EvalStats on the host


def loop_stats(evaluator: Evaluator) -> StatsFn:
    """The straightforward reference: ``lax.map`` over clients, each looping over exactly
    ``ceil(count / eval_batch_size)`` batches of its test set."""
    size = evaluator.eval_batch_size

    def personal(state, data: FederatedData) -> EvalStats:
        def one(args):
            client_state, rows, count, cid = args
            predict = evaluator.predict_for(state.server, client_state, cid)
            client = ClientData(data.test_x, data.test_y, rows, count)
            order = jnp.arange(rows.shape[0], dtype=jnp.int32)

            def body(b, acc):
                batch = gather_batch(client, order, b * size, size, data.preprocess)
                hits, losses = hits_and_losses(predict(batch.x), batch.y)
                return acc[0] + (hits * batch.mask).sum(), acc[1] + (losses * batch.mask).sum()
            return jax.lax.fori_loop(0, steps_per_epoch(count, size), body, (jnp.zeros(()), jnp.zeros(())))
        cids = jnp.arange(evaluator.num_clients, dtype=jnp.int32)
        correct, loss_sum = jax.lax.map(one, (state.clients, data.test_idx, data.test_count, cids))
        return EvalStats(correct, loss_sum, data.test_count)
    program = jax.jit(personal)
    return lambda state, data: jax.device_get(program(state, data))


def _next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def plan_chunks(counts: np.ndarray, chunk_examples: int) -> list[tuple[np.ndarray, int]]:
    """Client chunks for batched evaluation: [(client ids, padded width)].

    Clients with test data, in increasing order of count, are grouped greedily
    while ``len(chunk) * width <= chunk_examples``, ``width`` being the next power of two
    >= the chunk's largest count (a single client may exceed the budget)."""
    counts = np.asarray(counts)
    order = [int(c) for c in np.argsort(counts, kind="stable") if counts[c] > 0]
    chunks: list[tuple[np.ndarray, int]] = []
    current: list[int] = []
    for cid in order:
        width = _next_power_of_two(int(counts[cid]))
        if current and (len(current) + 1) * width > chunk_examples:
            chunks.append((np.asarray(current, np.int32), _next_power_of_two(int(counts[current[-1]]))))
            current = []
        current.append(cid)
    if current:
        chunks.append((np.asarray(current, np.int32), _next_power_of_two(int(counts[current[-1]]))))
    return chunks


def batched_chunk(evaluator: Evaluator) -> Callable:
    """(state, data, ids [C], width) -> (hits [C], loss sums [C]): the chunk's personal predicts
    ``vmap``ped, each client's test set padded to ``width`` in one batch."""
    def chunk(state, data: FederatedData, ids, width: int):
        clients = jax.tree_util.tree_map(lambda x: x[ids], state.clients)
        padded = jnp.pad(data.test_idx, ((0, 0), (0, max(width - data.test_idx.shape[1], 0))))

        def one(client_state, rows, count, cid):
            logits = evaluator.predict_for(state.server, client_state, cid)(data.preprocess(data.test_x[rows]))
            valid = (jnp.arange(width) < count).astype(jnp.float32)
            hits, losses = hits_and_losses(logits, data.test_y[rows])
            return (hits * valid).sum(), (losses * valid).sum()
        return jax.vmap(one)(clients, padded[ids, :width], data.test_count[ids], ids)
    return chunk


def batched_stats(evaluator: Evaluator, chunk_examples: int = 2048) -> StatsFn:
    """``vmap`` over chunks of clients ordered by test-set size, each chunk at most ``chunk_examples``
    padded examples and padded to a power-of-two width (few shapes to compile)."""
    program = jax.jit(batched_chunk(evaluator), static_argnums=3)

    def personal(state, data: FederatedData) -> EvalStats:
        counts = np.asarray(jax.device_get(data.test_count))
        correct = np.zeros(evaluator.num_clients, np.float64)
        loss_sum = np.zeros(evaluator.num_clients, np.float64)
        for ids, width in plan_chunks(counts, chunk_examples):
            correct[ids], loss_sum[ids] = jax.device_get(program(state, data, jnp.asarray(ids), int(width)))
        return EvalStats(jnp.asarray(correct), jnp.asarray(loss_sum), jnp.asarray(counts))
    return personal


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--rounds", type=int, default=1, help="training rounds before evaluating")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-examples", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--granularity", type=int, nargs="+", default=[16, 32, 64],
                        help="per_client: test sets padded to a multiple of this")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    config = fjs.RunConfig.from_json(dict(
        algorithm="spafl", dataset="fashion_mnist", data_dir=args.data_dir, model="lenet5_caffe", num_clients=100,
        clients_per_round=10, local_epochs=5, batch_size=64, lr=0.001, partition="dirichlet:0.2",
        min_client_samples=64, preprocess="raw", eval_batch_size=128, seed=1,
        options=dict(alpha=0.002, ramp=True, momentum=0.9, keep_optimizer_state=True)))
    exp = fjs.build(config)
    engine, data = exp.engine, exp.data
    state = engine.init(jax.random.PRNGKey(config.seed))
    state, _ = engine.run_rounds(state, data, args.rounds)
    loop = loop_stats(engine.evaluator)
    result = {"setting": "SpaFL FMNIST, 100 clients, LeNet-5-Caffe, personal masked models",
              "rounds_trained": args.rounds,
              "test_examples": int(np.asarray(data.test_count).sum()),
              "max_client_test": int(np.asarray(data.test_count).max()),
              "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
              "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg(),
              "python": platform.python_version(), "jax": jax.__version__,
              "machine_facts": timing.machine_facts(), "variants": []}
    reference = loop(state, data)
    first, times = timing.time_calls(lambda: loop(state, data), args.repeats)
    result["variants"].append({"mode": "loop", "eval_batch_size": engine.evaluator.eval_batch_size,
                               "first_seconds": first, "seconds": times, "median_seconds": float(np.median(times))})

    def measure(personal: StatsFn, **labels) -> dict:
        """Times ``personal`` and compares its per-client numbers with the loop's."""
        stats = personal(state, data)
        first, times = timing.time_calls(lambda: personal(state, data), args.repeats)
        return {**labels, "first_seconds": first, "seconds": times, "median_seconds": float(np.median(times)),
                "same_counts_as_loop": bool(np.array_equal(np.asarray(stats.correct), np.asarray(reference.correct))),
                "max_loss_difference_vs_loop": float(np.max(np.abs(
                    np.asarray(stats.loss_sum) - np.asarray(reference.loss_sum))))}

    for chunk in args.chunk_examples:
        result["variants"].append(measure(batched_stats(engine.evaluator, chunk), mode="batched", chunk_examples=chunk))
    for granularity in args.granularity:
        one_by_one = dataclasses.replace(engine.evaluator, per_client_granularity=granularity)
        result["variants"].append(measure(one_by_one.personal_stats, mode="per_client", granularity=granularity))
    loop_median = result["variants"][0]["median_seconds"]
    for v in result["variants"][1:]:
        v["speedup_vs_loop"] = loop_median / v["median_seconds"]
    result["load_average_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
