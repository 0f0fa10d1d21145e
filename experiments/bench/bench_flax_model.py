"""A user's Flax model against the zoo's hand-built one: seconds per FedAvg round, side by side.

    python experiments/bench/bench_flax_model.py --data-dir ../shared/data \
        --out experiments/results/perf/flax_lenet_vs_zoo_cpu.json

LeNet-5-Caffe written in ``flax.linen`` (``fedjax_sparse.models.flax_examples.LeNet5Caffe``, through
``from_flax``) and the zoo's ``lenet5_caffe``, with the same initial weights, on the SpaFL FMNIST
FedAvg setting (100 clients, Dirichlet 0.2, 10 per round, 5 local epochs, batch 64). Each model's
experiment is built and compiled once (one warm-up chunk), then timed chunks of ``--chunk`` rounds
alternate between the two models ``--repeats`` times, so both see the same machine load. The
ratio is the flax model's median seconds per round over the zoo's (target: <= 1.2 on CPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax

import fedjax_sparse as fjs
from fedjax_sparse.tools import timing
from fedjax_sparse.models.flax_examples import LeNet5Caffe

CONFIG = dict(algorithm="fedavg", dataset="fashion_mnist", num_clients=100, clients_per_round=10, local_epochs=5,
              batch_size=64, lr=0.01, partition="dirichlet:0.2", min_client_samples=64, eval_every=1000)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--chunk", type=int, default=3, help="rounds per timed chunk")
    parser.add_argument("--repeats", type=int, default=3, help="timed chunks per model, alternated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    config = fjs.RunConfig(**CONFIG, data_dir=args.data_dir)
    zoo = fjs.build(config)
    data = fjs.data.PartitionedData(zoo.dataset, zoo.partition)
    flax_model = dataclasses.replace(fjs.models.from_flax(LeNet5Caffe(), zoo.data.input_shape),
                                     init_fn=zoo.model.init_fn)
    assert flax_model.layers == zoo.model.layers
    flax = fjs.build(config, model=flax_model, data=data)
    variants = {"zoo lenet5_caffe": zoo, "flax.linen LeNet5Caffe": flax}
    states, compile_seconds, seconds = {}, {}, {name: [] for name in variants}
    for name, exp in variants.items():
        state = exp.engine.init(jax.random.PRNGKey(0))
        t = time.perf_counter()
        states[name] = jax.block_until_ready(exp.engine.advance(state, exp.data, args.chunk, "scan")[0])
        compile_seconds[name] = time.perf_counter() - t
    for _ in range(args.repeats):
        for name, exp in variants.items():
            t = time.perf_counter()
            states[name] = jax.block_until_ready(exp.engine.advance(states[name], exp.data, args.chunk, "scan")[0])
            seconds[name].append((time.perf_counter() - t) / args.chunk)
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    ratio = medians["flax.linen LeNet5Caffe"] / medians["zoo lenet5_caffe"]
    result = {
        "command": "python experiments/bench/bench_flax_model.py --data-dir DATA"
                   + (f" --out {args.out}" if args.out else ""),
        "config": CONFIG, "chunk_rounds": args.chunk, "repeats": args.repeats,
        "seconds_per_round": seconds, "median_seconds_per_round": medians,
        "first_chunk_seconds_incl_compile": compile_seconds,
        "ratio_flax_over_zoo": ratio, "target_ratio": 1.2, "met": ratio <= 1.2,
        "backend": jax.default_backend(), "machine": timing.machine_facts(),
    }
    print(json.dumps({k: result[k] for k in ("median_seconds_per_round", "ratio_flax_over_zoo", "met")}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
