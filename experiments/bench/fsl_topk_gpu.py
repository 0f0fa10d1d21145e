"""FSL's large-layer top-k on an accelerator: the radix select's low histogram as written (keys outside
the chosen high bin counted in one extra bin), with those keys dropped instead, a sort, and a 32-pass
bisection; a vmapped top-k alone and whole FSL MNIST rounds (25 clients, ``packed``) side by side.

    PYTHONPATH=. python3 experiments/bench/fsl_topk_gpu.py --data-dir .device/data --out $OUT/fsl_topk_gpu.json

Why: on one H200 (2026-11-28) an FSL round of 25 clients took 0.567 s, against 0.167 s on one H100
before the radix select sent every out-of-bin key to one histogram bin (commit 0ca065d): a GPU's
scatter-add serialises atomics on one address. Every variant finds the same threshold and count (the
script checks it), so masks and rounds are identical; only the time differs. Each variant replaces
``supermask._large_layer_select`` while the engine is traced (a measurement, not a setting);
``as_written`` is ``supermask._radix_select``, what every platform ran before the measurement (now the
CPU's choice), ``bisect`` what the package runs off the CPU since (``supermask.BISECT_MAX_KEYS``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers
from fedjax_sparse.mechanisms import supermask
from fedjax_sparse.tools import bench

_DROP_DNUMS = supermask._COUNT_DNUMS
_PACKAGE_CHOICE = supermask._large_layer_select


def _drop_count(bins: jax.Array, size: int) -> jax.Array:
    return jax.lax.scatter_add(jnp.zeros((size,), jnp.int32), bins.reshape(-1, 1), jnp.ones((bins.size,), jnp.int32),
                               _DROP_DNUMS, indices_are_sorted=False, unique_indices=False,
                               mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _dropping_histogram(size: int):
    @jax.custom_batching.custom_vmap
    def histogram(bins):
        return _drop_count(bins, size)

    @histogram.def_vmap
    def histogram_vmap(axis_size, in_batched, bins):
        if not in_batched[0]:
            return histogram(bins), False
        lead = bins.shape[:-1]
        rows = int(np.prod(lead))
        offset = (jnp.arange(rows, dtype=jnp.uint32) * size).reshape(lead + (1,))
        # out of range stays out of range after the row's offset (rows * size < 2**31)
        return _drop_count(jnp.where(bins < size, bins + offset, jnp.uint32(1 << 31)), rows * size).reshape(
            lead + (size,)), True

    return histogram


def radix_drop(keys, kept):
    hist_high = _dropping_histogram(1 << 16)(keys >> 16)
    suffix_high = supermask._suffix_counts(hist_high)
    bin_high = (suffix_high >= kept).sum() - 1
    above = suffix_high[bin_high] - hist_high[bin_high]
    hist_low = _dropping_histogram(1 << 16)(keys - (bin_high.astype(jnp.uint32) << 16))
    suffix_low = supermask._suffix_counts(hist_low)
    bin_low = (above + suffix_low >= kept).sum() - 1
    threshold = (bin_high.astype(jnp.uint32) << 16) | bin_low.astype(jnp.uint32)
    return threshold, above + suffix_low[bin_low] - hist_low[bin_low]


def by_sort(keys, kept):
    threshold = jnp.sort(keys)[keys.shape[-1] - kept]
    return threshold, (keys > threshold).sum()


def by_bisect(keys, kept):
    threshold = supermask.kth_largest_key(keys, kept, "bisect")
    return threshold, (keys > threshold).sum()


VARIANTS = {"as_written": supermask._radix_select, "radix_drop": radix_drop, "sort": by_sort, "bisect": by_bisect}


def timed(fn, *args, repeats=20):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds)), seconds


def micro(clients: int, n: int, repeats: int) -> dict:
    scores = jax.random.normal(jax.random.PRNGKey(0), (clients, n), jnp.float32) * 0.05
    keys = jax.vmap(lambda s: jax.lax.bitcast_convert_type(jnp.abs(s), jnp.uint32))(scores)
    kept = supermask.kept_count(n, 0.5)
    out, reference = {}, None
    for name, select in VARIANTS.items():
        fn = jax.jit(jax.vmap(lambda k, select=select: select(k, kept)))
        result = [np.asarray(x) for x in fn(keys)]
        if reference is None:
            reference = result
        same = all(np.array_equal(a, b) for a, b in zip(result, reference))
        median, seconds = timed(fn, keys, repeats=repeats)
        out[name] = {"seconds_median": median, "seconds_min": min(seconds), "same_as_written": same}
        print(f"micro {name}: {median * 1e3:.3f} ms (same: {same})", flush=True)
    return {"clients": clients, "keys_per_client": n, "kept": kept, "variants": out}


def rounds(args, clients: int) -> dict:
    method = papers.FSL_MNIST_METHODS["fsl"]
    config = fjs.RunConfig.from_json(dict(papers.FSL_MNIST_BASE, clients_per_round=clients,
                                          algorithm=method["algorithm"], lr=method["lr"],
                                          options=dict(method["options"]), data_dir=args.data_dir, seed=0,
                                          client_parallelism=args.schedule,
                                          **({"local_epochs": 1} if args.smoke else {})))
    out = {}
    for name in args.variants:
        supermask._large_layer_select = VARIANTS[name]
        try:
            record = bench.bench(config, None, rounds_timed=args.rounds_timed)["variants"][0]
        finally:
            supermask._large_layer_select = _PACKAGE_CHOICE
        out[name] = {key: record[key] for key in ("seconds_per_round", "seconds_per_round_min", "seconds_per_round_max",
                                                  "round_seconds", "compile_seconds")}
        out[name]["loss"] = record["metrics"]["loss"]
        print(f"rounds {name}: {record['seconds_per_round']:.4f} s/round, loss {out[name]['loss'][-1]}", flush=True)
    return {"clients_per_round": clients, "client_parallelism": args.schedule, "variants": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--schedule", default="packed")
    parser.add_argument("--clients", type=int, default=25)
    parser.add_argument("--rounds-timed", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="small sizes: checks the plumbing on a CPU")
    args = parser.parse_args(argv)
    result = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "smoke": args.smoke}
    # fc1 of FSL's MNIST LeNet: 9216 x 128 scores per client
    result["micro"] = micro(4 if args.smoke else args.clients, 9216 * 128, 3 if args.smoke else 20)
    Path(args.out).write_text(json.dumps(result, indent=1))
    result["rounds"] = rounds(args, 2 if args.smoke else args.clients)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
