"""Would bfloat16 products speed up a CPU round? Matmul rates alone, then the FedAvg FMNIST round
(LeNet-5-Caffe, 10 clients x 5 local epochs, batch 64) with every convolution and dense product
in float32 (the project's) and in two bfloat16 variants, side by side in one process.

    python experiments/bench/bench_bf16_products.py --data-dir ../shared/data \\
        --out experiments/results/perf/bf16_products_cpu.json

Variants (patched into ``fedjax_sparse.models.layers`` for this process only; no model changes):
``bf16_activations``: inputs and kernels cast to bfloat16, outputs left in bfloat16 (so the
elementwise layers and the backward products run in bfloat16 too); ``bf16_products``: the same
casts, the product's output cast back to float32 (the elementwise layers stay float32; the
backward products get bfloat16 operands through the casts' transposes). Loss after the timed round
shows the numerical difference. Not a project feature: it records a measured dead end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import fedjax_sparse as fjs
from fedjax_sparse import papers
from fedjax_sparse.tools import timing
from fedjax_sparse.models import layers

FLOAT32_CONV, FLOAT32_DENSE = layers.conv2d, layers.dense


def use(variant: str) -> None:
    """Points the layer functions at ``variant``'s products (takes effect at the next trace)."""
    if variant == "float32":
        layers.conv2d, layers.dense = FLOAT32_CONV, FLOAT32_DENSE
        return
    back = (lambda y: y) if variant == "bf16_activations" else (lambda y: y.astype(jnp.float32))
    bf16 = jnp.bfloat16
    layers.conv2d = lambda x, kernel, **kw: back(FLOAT32_CONV(x.astype(bf16), kernel.astype(bf16), **kw))
    layers.dense = lambda x, kernel: back(FLOAT32_DENSE(x.astype(bf16), kernel.astype(bf16)))


def round_seconds(config: fjs.RunConfig, variant: str, repeats: int) -> dict:
    use(variant)
    exp = fjs.build(config)
    state = exp.engine.init(jax.random.PRNGKey(config.seed))
    state, first, times, metrics = timing.time_rounds(exp.engine, state, exp.data, repeats)
    use("float32")
    return {"variant": variant, "seconds_per_round": min(times), "seconds_all": times,
            "first_round_seconds_incl_compile": first, "last_loss": float(metrics["loss"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per variant (after one compiling)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    # conv2's forward product at batch 64 (4096 positions x 500 patch values x 50 filters) and a square one.
    shapes = {"square_2048": (2048, 2048, 2048), "lenet_conv2_forward": (4096, 500, 50)}
    products = {name: {"float32_gflops": timing.product_gflops(*s, jnp.float32, repeats=20),
                       "bfloat16_gflops": timing.product_gflops(*s, jnp.bfloat16, repeats=20)}
                for name, s in shapes.items()}
    print(json.dumps(products), flush=True)
    config = fjs.RunConfig(**papers.ROUND_BENCHMARKS["fedavg_fmnist"], data_dir=args.data_dir, rounds=1)
    rounds = []
    for variant in ("float32", "bf16_activations", "bf16_products", "float32"):  # float32 twice: drift check
        rounds.append(round_seconds(config, variant, args.rounds))
        print(json.dumps(rounds[-1]), flush=True)
    reference = min(r["seconds_per_round"] for r in rounds if r["variant"] == "float32")
    for r in rounds:
        r["speedup_vs_float32"] = reference / r["seconds_per_round"]
    report = {"products": products, "fedavg_fmnist_round": rounds, "machine_facts": timing.machine_facts(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": "python experiments/bench/bench_bf16_products.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
