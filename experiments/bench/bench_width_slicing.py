"""HeteroFL / FjORD rounds with the sub-model cut out (``sliced=true``) vs the
masked full model (``sliced=false``), side by side in one process, on the
SpaFL-FMNIST setting of ``experiments/reproduce/spafl_fmnist.py`` (seed 0, map over clients).

    python experiments/bench/bench_width_slicing.py --data-dir ../shared/data \
        --out experiments/results/perf/width_slicing_cpu.json

Per variant: one warm-up round (compilation), then ``--rounds`` timed rounds;
the losses and exact FLOPs of the timed rounds are recorded so the two forms can
be compared (same FLOPs by the accounting, losses equal up to rounding).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["heterofl", "fjord"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import jax

    import fedjax_sparse as fjs
    from fedjax_sparse import papers
    from fedjax_sparse.papers import studies
    from fedjax_sparse.tools import timing

    settings = types.SimpleNamespace(overrides={}, data_dir=args.data_dir, rounds=args.rounds + 1,
                                     client_parallelism="map")
    report = {"machine": timing.machine_facts(), "rounds_timed": args.rounds, "rows": []}
    for method in args.methods:
        for sliced in (True, False):
            config = studies.method_config(papers.SPAFL_FMNIST_STUDY, method, 0, settings, "unused")
            config = config.replace(options={**config.options, "sliced": sliced})
            exp = fjs.build(config)
            state = exp.engine.init(jax.random.PRNGKey(0))
            start = time.perf_counter()
            state, _ = exp.engine.run_rounds(state, exp.data, 1)
            jax.block_until_ready(state)
            warmup = time.perf_counter() - start
            start = time.perf_counter()
            state, metrics = exp.engine.run_rounds(state, exp.data, args.rounds)
            jax.block_until_ready(state)
            row = dict(method=method, sliced=sliced,
                       seconds_per_round=(time.perf_counter() - start) / args.rounds,
                       first_round_incl_compile=warmup, loss=[float(x) for x in metrics["loss"]],
                       flops=[int(x) for x in metrics["flops"]])
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
    report["load_average_after"] = timing.machine_facts()["load_average"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
