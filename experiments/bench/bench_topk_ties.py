"""FSL's top-k masks for clients in lockstep (issue 48 item 2): the layer mask of 25 clients' fc1 scores
(1.6M edges each, ``vmap``) with ``supermask.topk_mask`` as it is (recorded in fsl_topk_ties_cpu.json when
it put the tie-breaking prefix count behind one conditional for the batch; since then ties are cut by
per-block counts, docs/design.md) against the per-client-conditional formulation (a per-client ``lax.cond``, which
``vmap`` turns into a select that computes the prefix count every time), and the threshold alone (the
floor), side by side in one process; median of 7 timed calls after a compiling one.

    python experiments/bench/bench_topk_ties.py --out experiments/results/perf/fsl_topk_ties_cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.tools import timing
from fedjax_sparse.mechanisms import supermask as sm


def before(values: jax.Array, fraction: float) -> jax.Array:
    """The top-k mask as it was before (a per-client cond on whether ties need breaking)."""
    flat = values.reshape(-1)
    kept = sm.kept_count(flat.shape[0], fraction)
    keys = sm.order_keys(flat)
    threshold = sm.kth_largest_key(keys, kept)
    above, at = keys > threshold, keys == threshold
    room = kept - above.sum()
    mask = jax.lax.cond(at.sum() == room, lambda: above | at, lambda: above | (at & (jnp.cumsum(at) <= room)))
    return mask.astype(jnp.float32)


def threshold_only(values: jax.Array, fraction: float) -> jax.Array:
    keys = sm.order_keys(values.reshape(-1))
    return sm.kth_largest_key(keys, sm.kept_count(keys.shape[0], fraction))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=25)
    parser.add_argument("--edges", type=int, default=800 * 500 * 4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    scores = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (args.clients, args.edges)))
    forms = {"now": sm.topk_mask, "before": before, "threshold_only": threshold_only}
    seconds = {}
    for name, form in forms.items():
        fn = jax.jit(jax.vmap(lambda v, form=form: form(v, 0.5)))
        seconds[name] = float(np.median(timing.time_calls(lambda fn=fn: fn(scores), 7)[1]))
        print(f"{name}: {seconds[name]:.4f} s", flush=True)
    same = bool(jnp.array_equal(jax.vmap(lambda v: sm.topk_mask(v, 0.5))(scores),
                                jax.vmap(lambda v: before(v, 0.5))(scores)))
    record = {"what": __doc__.split("\n\n")[0], "command": f"python experiments/bench/bench_topk_ties.py --out "
              f"{args.out}", "clients": args.clients, "edges": args.edges, "seconds_median": seconds,
              "before_over_now": seconds["before"] / seconds["now"], "same_masks": same,
              "machine": timing.machine_facts(), "software": timing.software_facts()}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
