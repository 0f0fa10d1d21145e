"""Round-engine benchmark: seconds per round, client-steps/s and achieved GFLOP/s.

    python experiments/bench/bench_rounds.py --config fedavg_fmnist --data-dir ../shared/data \
        --rounds 3 --out experiments/results/bench_fedavg_fmnist_cpu.json

For each requested variant (``--paths``: scan / per_round, ``--parallelism``:
map / vmap, ``--conv-impls``: im2col / xla) it builds the experiment once,
runs one warm-up chunk (compilation, reported separately) and then times
``--rounds`` rounds, all in one process so ratios are side by side.
GFLOP/s uses the project's FLOPs accounting (forward 2 x MACs, backward 2 x
forward) over the examples actually processed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import jax
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers
from fedjax_sparse.tools import timing

# The named configurations (--config): the papers' settings, in fedjax_sparse.papers.
CONFIGS = papers.ROUND_BENCHMARKS


def time_variant(config: fjs.RunConfig, path: str, rounds: int) -> dict:
    exp = fjs.build(config)
    engine, data = exp.engine, exp.data
    state = engine.init(jax.random.PRNGKey(config.seed))

    def run_chunk(state, n):
        state, metrics = engine.advance(state, data, n, path)
        jax.block_until_ready(metrics)
        return state, {k: np.asarray(v, np.float64) for k, v in jax.device_get(metrics).items()}

    t0 = time.perf_counter()
    state, _ = run_chunk(state, rounds)  # warm-up: compiles (scan of this length / one round)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, metrics = run_chunk(state, rounds)
    seconds = time.perf_counter() - t0
    examples = float(metrics["num_examples"].sum())
    flops = float(metrics["flops"].sum())
    return {
        "path": path, "client_parallelism": engine.mode,
        "rounds_timed": rounds, "seconds": seconds, "seconds_per_round": seconds / rounds,
        "rounds_per_second": rounds / seconds, "warmup_seconds_incl_compile": warmup,
        "examples_per_round": examples / rounds,
        "client_steps_per_second": (examples / config.batch_size) / seconds,
        "gflop_per_round": flops / rounds / 1e9, "gflops_achieved": flops / seconds / 1e9,
        "final_loss": float(metrics["loss"][-1]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="fedavg_fmnist", choices=sorted(CONFIGS))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--rounds", type=int, default=3, help="rounds timed per variant (after warm-up)")
    parser.add_argument("--paths", default="scan,per_round")
    parser.add_argument("--parallelism", default="auto", help="comma list of auto|map|vmap")
    parser.add_argument("--conv-impls", default="auto", help="comma list of auto|im2col|xla")
    parser.add_argument("--clients-per-round", type=int, default=None)
    parser.add_argument("--num-clients", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON output file")
    args = parser.parse_args(argv)

    results = []
    for conv_impl in args.conv_impls.split(","):
        for parallelism in args.parallelism.split(","):
            for path in args.paths.split(","):
                fields = dict(CONFIGS[args.config])
                if args.clients_per_round:
                    fields["clients_per_round"] = args.clients_per_round
                if args.num_clients:
                    fields["num_clients"] = args.num_clients
                config = fjs.RunConfig.from_json(dict(
                    fields, data_dir=args.data_dir, rounds=args.rounds, client_parallelism=parallelism,
                    model_options={"conv_impl": conv_impl} if conv_impl != "auto" else {}))
                r = time_variant(config, path, args.rounds)
                r["conv_impl"] = conv_impl
                results.append(r)
                print(json.dumps(r), flush=True)
    report = {
        "config_name": args.config, "config": CONFIGS[args.config], "results": results,
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__, "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine_facts": timing.machine_facts(),
        # The same process's 2048^2 float32 matmul: gflops_achieved / this = share of the ceiling.
        "matmul_2048_gflops": timing.matmul_gflops(),
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
