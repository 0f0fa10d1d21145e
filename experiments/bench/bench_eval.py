"""Personalised evaluation: lax.map over clients ("loop", the reference), one jitted call per
client with native convolutions ("per_client", the CPU default) and vmap over chunks of
clients ("batched"), side by side in one run on the SpaFL Fashion-MNIST setting (100
clients, each on its own test set with its personal masked LeNet-5-Caffe). Checks that both
give the same per-client counts and writes the timings as JSON.

    python experiments/bench/bench_eval.py --data-dir ../shared/data \\
        --out experiments/results/perf/eval_spafl_fmnist_cpu.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
from pathlib import Path

import jax
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import timing


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
    loop = dataclasses.replace(engine.evaluator, personal_eval="loop")
    result = {"setting": "SpaFL FMNIST, 100 clients, LeNet-5-Caffe, personal masked models",
              "rounds_trained": args.rounds,
              "test_examples": int(np.asarray(data.test_count).sum()),
              "max_client_test": int(np.asarray(data.test_count).max()),
              "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
              "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg(),
              "python": platform.python_version(), "jax": jax.__version__,
              "machine_facts": timing.machine_facts(), "variants": []}
    reference = loop.personal_stats(state, data)
    first, times = timing.time_calls(lambda: loop.personal_stats(state, data), args.repeats)
    result["variants"].append({"mode": "loop", "eval_batch_size": loop.eval_batch_size, "first_seconds": first,
                               "seconds": times, "median_seconds": float(np.median(times))})
    def measure(evaluator, **labels) -> dict:
        """Times ``evaluator`` and compares its per-client numbers with the loop's."""
        stats = evaluator.personal_stats(state, data)
        first, times = timing.time_calls(lambda: evaluator.personal_stats(state, data), args.repeats)
        return {**labels, "first_seconds": first, "seconds": times, "median_seconds": float(np.median(times)),
                "same_counts_as_loop": bool(np.array_equal(np.asarray(stats.correct), np.asarray(reference.correct))),
                "max_loss_difference_vs_loop": float(np.max(np.abs(
                    np.asarray(stats.loss_sum) - np.asarray(reference.loss_sum))))}

    for chunk in args.chunk_examples:
        result["variants"].append(measure(dataclasses.replace(loop, personal_eval="batched", chunk_examples=chunk),
                                          mode="batched", chunk_examples=chunk))
    for granularity in args.granularity:
        one_by_one = dataclasses.replace(loop, personal_eval="per_client", per_client_granularity=granularity)
        result["variants"].append(measure(one_by_one, mode="per_client", granularity=granularity))
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
