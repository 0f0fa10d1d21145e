"""Several seeds of one configuration: separate runs versus replicas (``--seeds``), side by side.

Times, in one process and one invocation, R seeds of the same run three ways:

* ``separate``: ``fjs.run`` once per seed (what a loop over seeds does; each run builds and
  compiles its own program; process start-up is not counted, which favours this way);
* ``sequential`` replicas: one compiled program, the seeds one after another;
* ``vmap`` replicas: one program over a leading replica axis.

Checks that every way writes the same metrics (exact for ``sequential``, to float rounding for
``vmap``) and writes the wall times and speed-ups as JSON.

    python experiments/bench/bench_replicas.py --data-dir ../shared/data \\
        --out experiments/results/perf/replicas_spafl_fmnist_cpu.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import jax

import fedjax_sparse as fjs
from fedjax_sparse.driver import replicas


def spafl_fmnist(data_dir: str, rounds: int, local_epochs: int) -> fjs.RunConfig:
    """The SpaFL Fashion-MNIST setting of experiments/reproduce/spafl_fmnist.py (shorter local training)."""
    return fjs.RunConfig(algorithm="spafl", dataset="fashion_mnist", data_dir=data_dir, model="lenet5_caffe",
                         num_clients=100, clients_per_round=10, rounds=rounds, local_epochs=local_epochs,
                         batch_size=64, lr=0.001, partition="dirichlet:0.2", min_client_samples=64,
                         preprocess="raw", eval_every=rounds,
                         options={"alpha": "0.002", "ramp": "true", "momentum": "0.9", "keep_optimizer_state": "true"})


def final_rows(out: Path, seeds) -> list[dict]:
    rows = []
    for seed in seeds:
        lines = (out / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()
        rows.append({k: v for k, v in json.loads(lines[-1]).items() if k != "seconds"})
    return rows


def same(a: list[dict], b: list[dict], rel: float) -> bool:
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            other = rb.get(key)
            if isinstance(value, float) and isinstance(other, float):
                if abs(value - other) > rel * max(abs(value), 1e-7):
                    return False
            elif value != other:
                return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--ways", nargs="+", default=["separate", "sequential", "vmap"],
                        choices=["separate", "sequential", "vmap"])
    parser.add_argument("--out", default=None, help="JSON file for the timings")
    args = parser.parse_args(argv)
    config = spafl_fmnist(args.data_dir, args.rounds, args.local_epochs)
    scratch = Path(tempfile.mkdtemp(prefix="bench_replicas_"))
    seconds, rows = {}, {}
    try:
        for way in args.ways:
            out = scratch / way
            t0 = time.perf_counter()
            if way == "separate":
                for seed in args.seeds:
                    fjs.run(dataclasses.replace(config, seed=seed, out=str(out / f"seed{seed}")), progress=False)
            else:
                replicas.run_replicas(dataclasses.replace(config, out=str(out)), args.seeds, parallelism=way,
                                      progress=False)
            seconds[way] = time.perf_counter() - t0
            rows[way] = final_rows(out, args.seeds)
            print(f"{way}: {seconds[way]:.1f} s for {len(args.seeds)} seeds x {args.rounds} rounds", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    reference = rows.get("separate")
    result = {
        "what": "R seeds of one SpaFL Fashion-MNIST configuration (100 clients, 10 per round, LeNet-5-Caffe, "
                f"{args.local_epochs} local epoch(s), {args.rounds} rounds, one evaluation at the end): wall seconds "
                "in one process, including building and compiling",
        "command": "python experiments/bench/bench_replicas.py "
                   + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "seeds": args.seeds, "rounds": args.rounds, "local_epochs": args.local_epochs,
        "seconds": seconds,
        "speedup_vs_separate": ({way: seconds["separate"] / s for way, s in seconds.items() if way != "separate"}
                                if "separate" in seconds else None),
        "same_metrics_as_separate": ({way: same(reference, r, 0 if way == "sequential" else 1e-4)
                                      for way, r in rows.items() if way != "separate"} if reference else None),
        "final_accuracy": {way: [r["accuracy"] for r in rs] for way, rs in rows.items()},
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
        "jax": jax.__version__, "python": platform.python_version(),
        "load_average_at_end": os.getloadavg(),
    }
    print(json.dumps({k: result[k] for k in ("seconds", "speedup_vs_separate", "same_metrics_as_separate")},
                     indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=float))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
