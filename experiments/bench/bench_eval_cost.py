"""What one evaluation costs a run, against the machine's f32 matmul ceiling (issue 32, item 3).

    python experiments/bench/bench_eval_cost.py --data-dir ../shared/data \
        --out experiments/results/perf/eval_cost_spafl_fmnist_cpu.json

The SpaFL FMNIST setting: 100 clients, each evaluated on its own test set with its personal masked
LeNet-5-Caffe (10,000 test examples in all). Two real runs of ``--rounds`` rounds that evaluate
every round, in one process: "before", as the runner did until checkpoints got their own cadence
(a synchronous checkpoint at every evaluation), and "after" (the defaults: no checkpoint comes with
an evaluation, writes are asynchronous). Inside each, what the run does between two chunks of
rounds (``OpenRun.record``: evaluation, metrics row, logs, checkpoint), the evaluation alone and each
chunk of rounds (``Engine.advance``) are timed, the first of each (compiling) left out. An
evaluation's useful FLOPs are 2 x the model's dense forward MACs x the test examples (SpaFL's
masked kernels are computed dense); their share of the f32 matmul ceiling over what the run spends
at an evaluation (``timing.matmul_gflops``, measured in the same process) is the figure the target
reads (>= 25 %).
The training step's share is beside it: 6 x MACs x the examples the rounds trained (padded
batches counted whole, an upper bound) over the rounds' time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse.tools import timing

CONFIG = dict(algorithm="spafl", dataset="fashion_mnist", model="lenet5_caffe", num_clients=100,
              clients_per_round=10, local_epochs=5, batch_size=64, lr=0.001, partition="dirichlet:0.2",
              min_client_samples=64, preprocess="raw", seed=1, checkpoint_seconds=0.0,
              options=dict(alpha=0.002, ramp=True, momentum=0.9, keep_optimizer_state=True))


def measure(config: fjs.RunConfig, tmp: Path, synchronous_checkpoints: bool) -> dict:
    """One real run evaluating every round: the seconds of each ``OpenRun.record`` call (everything the
    run does between two chunks: evaluation, row, logs, checkpoint), of each evaluation alone, and of
    each chunk of rounds."""
    from fedjax_sparse.driver import runner
    from fedjax_sparse.driver.checkpoint import Checkpointer
    from fedjax_sparse.core.engine import Engine
    records, evaluations, chunks = [], [], []
    real = (runner.OpenRun.record, Engine.evaluate, Engine.advance, Checkpointer.__init__)

    def timed(store, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            store.append(time.perf_counter() - t)
            return out
        return wrapper

    def advance(self, state, data, n, mode="scan"):
        t = time.perf_counter()
        out = real[2](self, state, data, n, mode)
        jax.block_until_ready(out[0])
        chunks.append((n, time.perf_counter() - t))
        return out

    def checkpointer_init(self, out, asynchronous=True):
        real[3](self, out, asynchronous=asynchronous and not synchronous_checkpoints)
    runner.OpenRun.record = timed(records, real[0])
    Engine.evaluate = timed(evaluations, real[1])
    Engine.advance, Checkpointer.__init__ = advance, checkpointer_init
    try:
        out = tmp / ("before" if synchronous_checkpoints else "after")
        fjs.run(fjs.RunConfig.from_json({**config.to_json(), "out": str(out)}), progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    finally:
        runner.OpenRun.record, Engine.evaluate, Engine.advance, Checkpointer.__init__ = real
    return {"record_seconds": records, "evaluation_seconds": evaluations, "chunks": chunks, "rows": rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    ceiling = timing.matmul_gflops()
    config = fjs.RunConfig.from_json(dict(CONFIG, data_dir=args.data_dir, rounds=args.rounds, eval_every=1))
    exp = fjs.build(config)
    test_examples = int(np.asarray(exp.data.test_count).sum())
    eval_gflop = 2.0 * exp.model.forward_macs * test_examples / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        # Before (the runner until this change): a synchronous checkpoint at every evaluation.
        every = dataclasses.replace(config, execution=dataclasses.replace(config.execution, checkpoint_every=1))
        before = measure(every, Path(tmp), synchronous_checkpoints=True)
        after = measure(config, Path(tmp), synchronous_checkpoints=False)
    variants = {}
    for name, m in (("before: checkpoint at every evaluation", before),
                    ("after: checkpoints on their own cadence", after)):
        at_evaluation = statistics.median(m["record_seconds"][1:-1])   # the first compiles, the last checkpoints
        evaluation = statistics.median(m["evaluation_seconds"][1:])
        steady = m["chunks"][1:]
        round_seconds = sum(t for _, t in steady) / sum(n for n, _ in steady)
        trained = m["rows"][-1]["total_client_steps"] / args.rounds * config.batch_size
        train_gflop = 6.0 * exp.model.forward_macs * trained / 1e9
        variants[name] = {
            "seconds_at_an_evaluation": at_evaluation, "seconds_of_the_evaluation_alone": evaluation,
            "evaluation_share_of_ceiling": eval_gflop / at_evaluation / ceiling,
            "evaluation_alone_share_of_ceiling": eval_gflop / evaluation / ceiling,
            "training_seconds_per_round": round_seconds, "training_gflop_per_round_upper_bound": train_gflop,
            "training_share_of_ceiling": train_gflop / round_seconds / ceiling,
            "record_seconds": m["record_seconds"], "evaluation_seconds": m["evaluation_seconds"],
            "chunks": m["chunks"]}
    share = variants["after: checkpoints on their own cadence"]["evaluation_share_of_ceiling"]
    result = {
        "command": "python experiments/bench/bench_eval_cost.py --data-dir DATA"
                   + (f" --out {args.out}" if args.out else ""),
        "config": {**CONFIG, "rounds": args.rounds, "eval_every": 1},
        "matmul_ceiling_gflops": ceiling, "test_examples": test_examples, "evaluation_gflop": eval_gflop,
        "variants": variants, "target_share": 0.25, "met": share >= 0.25,
        "same_metrics": [{k: v for k, v in r.items() if k != "seconds"} for r in before["rows"]]
        == [{k: v for k, v in r.items() if k != "seconds"} for r in after["rows"]],
        "backend": jax.default_backend(), "machine": timing.machine_facts(),
    }
    print(json.dumps({"ceiling_gflops": ceiling, "same_metrics": result["same_metrics"], "met": result["met"],
                      **{name: {k: x for k, x in v.items() if not isinstance(x, list)}
                         for name, v in variants.items()}},
                     indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
