"""Evaluation of a global-model algorithm (FedAvg on the SpaFL Fashion-MNIST setting: 100
clients, 10,000 test images, LeNet-5-Caffe): seconds of ``engine.evaluate`` (the shared pass that
gives the personalised and the global accuracy). ``--label`` names the code measured; results are
appended to ``--out`` so two checkouts can be measured alternately into one file:

    for i in 1 2; do
      PYTHONPATH=/tmp/before python experiments/bench/bench_global_eval.py --label before --out F.json
      python experiments/bench/bench_global_eval.py --label after --out F.json
    done
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--label", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    spec = papers.SPAFL_FMNIST_METHODS["fedavg"]
    config = fjs.RunConfig.from_json(dict(algorithm="fedavg", lr=spec["lr"], seed=0, rounds=1, data_dir=args.data_dir,
                                          options=dict(spec["options"]), **papers.SPAFL_FMNIST_BASE))
    exp = fjs.build(config)
    engine = exp.engine
    state, _ = engine.advance(engine.init(jax.random.PRNGKey(0)), exp.data, 1)
    t = time.perf_counter()
    first = engine.evaluate(state, exp.data)
    first_seconds = time.perf_counter() - t
    seconds = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        result = engine.evaluate(state, exp.data)
        seconds.append(time.perf_counter() - t)
    record = {"label": args.label, "code": fjs.__file__, "first_seconds_incl_compile": first_seconds,
              "seconds": seconds, "median_seconds": float(np.median(seconds)),
              "accuracy": result["accuracy"], "global_accuracy": result["global_accuracy"],
              "same_as_first_call": result["accuracy"] == first["accuracy"],
              "load_average": os.getloadavg()}
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {
        "setting": "FedAvg, SpaFL FMNIST setting (100 clients, 10,000 test images, LeNet-5-Caffe), after 1 round",
        "backend": jax.default_backend(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "jax": jax.__version__, "runs": []}
    data["runs"].append(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
