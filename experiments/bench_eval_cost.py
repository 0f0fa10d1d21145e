"""What one evaluation costs a run, against the machine's f32 matmul ceiling (issue 32, item 3).

    python experiments/bench_eval_cost.py --data-dir ../shared/data \
        --out experiments/results/perf/eval_cost_spafl_fmnist_cpu.json

The SpaFL FMNIST setting: 100 clients, each evaluated on its own test set with its personal masked
LeNet-5-Caffe (10,000 test examples in all). One real run of ``--rounds`` rounds that evaluates
every round; what the run does at each evaluation (``OpenRun._evaluate_and_log``: the evaluation,
the metrics row, the logs; checkpoints keep their own cadence and no longer come with evaluations)
and each chunk of rounds (``Engine.advance``) are timed inside it, the first of each (compiling)
left out. An evaluation's useful FLOPs are 2 x the model's dense forward MACs x the test examples
(SpaFL's masked kernels are computed dense), and its share of the f32 matmul ceiling
(``timing.matmul_gflops``, measured in the same process) is the figure the target reads (>= 25 %).
The training step's share is beside it: 6 x MACs x the examples the rounds trained (padded
batches counted whole, an upper bound) over the rounds' time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import timing

CONFIG = dict(algorithm="spafl", dataset="fashion_mnist", model="lenet5_caffe", num_clients=100,
              clients_per_round=10, local_epochs=5, batch_size=64, lr=0.001, partition="dirichlet:0.2",
              min_client_samples=64, preprocess="raw", seed=1, checkpoint_seconds=0.0,
              options=dict(alpha=0.002, ramp=True, momentum=0.9, keep_optimizer_state=True))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from fedjax_sparse import runner
    from fedjax_sparse.engine import Engine
    ceiling = timing.matmul_gflops()
    config = fjs.RunConfig(**CONFIG, data_dir=args.data_dir, rounds=args.rounds, eval_every=1)
    exp = fjs.build(config)
    test_examples = int(np.asarray(exp.data.test_count).sum())
    eval_flops = 2.0 * exp.model.forward_macs * test_examples
    evaluations, chunks = [], []
    real_log, real_advance = runner.OpenRun._evaluate_and_log, Engine.advance

    def log(self, *a, **k):
        t = time.perf_counter()
        row = real_log(self, *a, **k)
        evaluations.append(time.perf_counter() - t)
        return row

    def advance(self, state, data, n, mode="scan"):
        t = time.perf_counter()
        out = real_advance(self, state, data, n, mode)
        jax.block_until_ready(out[0])
        chunks.append((n, time.perf_counter() - t))
        return out
    runner.OpenRun._evaluate_and_log, Engine.advance = log, advance
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fjs.run(fjs.RunConfig(**{**config.to_json(), "out": str(Path(tmp) / "run")}), progress=False)
            rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        runner.OpenRun._evaluate_and_log, Engine.advance = real_log, real_advance
    steady_evals = evaluations[1:]                       # the first compiles the evaluation
    eval_seconds = statistics.median(steady_evals)
    steady_chunks = chunks[1:]                           # the first compiles the round
    round_seconds = sum(t for _, t in steady_chunks) / sum(n for n, _ in steady_chunks)
    trained = rows[-1]["total_client_steps"] / args.rounds * config.batch_size
    train_flops = 6.0 * exp.model.forward_macs * trained
    eval_share = eval_flops / 1e9 / eval_seconds / ceiling
    result = {
        "command": "python experiments/bench_eval_cost.py --data-dir DATA" + (f" --out {args.out}" if args.out else ""),
        "config": {**CONFIG, "rounds": args.rounds, "eval_every": 1},
        "matmul_ceiling_gflops": ceiling,
        "evaluation": {"test_examples": test_examples, "gflop": eval_flops / 1e9,
                       "seconds_per_evaluation": evaluations, "median_seconds_after_the_first": eval_seconds,
                       "gflops": eval_flops / 1e9 / eval_seconds, "share_of_ceiling": eval_share},
        "training": {"examples_per_round_upper_bound": trained, "gflop_per_round": train_flops / 1e9,
                     "chunks": chunks, "seconds_per_round_after_the_first_chunk": round_seconds,
                     "gflops": train_flops / 1e9 / round_seconds,
                     "share_of_ceiling": train_flops / 1e9 / round_seconds / ceiling},
        "target_share": 0.25, "met": eval_share >= 0.25,
        "backend": jax.default_backend(), "machine": timing.machine_facts(),
    }
    print(json.dumps({"evaluation": {k: v for k, v in result["evaluation"].items() if k != "seconds_per_evaluation"},
                      "training_share": result["training"]["share_of_ceiling"], "ceiling": ceiling,
                      "met": result["met"]}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
