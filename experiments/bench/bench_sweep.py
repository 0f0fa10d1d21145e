"""A 3 x 3 sweep in one process against the 9 separate runs a researcher would otherwise launch.

For each setting: (a) ``run --sweep lr=... --sweep option.alpha=...`` in one process (sequential
members, one compiled program), (b) the same sweep with ``--replica-parallelism vmap``, (c) the 9
grid points as 9 separate ``run`` processes one after another. Wall time of each (processes
included: imports, data, compilation, training, evaluation, files), the ratios, and a check that
every member's final accuracy equals its separate run's. No persistent compilation cache
(``--compile-cache off``), so every separate run compiles as a fresh process would.

    python experiments/bench/bench_sweep.py --data-dir ../shared/data \\
        --out experiments/results/perf/sweep_3x3_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

SETTINGS = {
    # SpaFL on Fashion-MNIST (the paper's data, model and partition), shortened to fit a CPU.
    "spafl_fmnist": ["--algorithm", "spafl", "--dataset", "fashion_mnist", "--model", "lenet5_caffe",
                     "--num-clients", "100", "--clients-per-round", "10", "--local-epochs", "1",
                     "--batch-size", "64", "--partition", "dirichlet:0.2", "--min-client-samples", "64",
                     "--preprocess", "raw", "--eval-every", "5", "--rounds", "5", "--eval-batch-size", "128"],
    # A small model where compilation dominates (the quick look a researcher takes first).
    "spafl_digits": ["--algorithm", "spafl", "--dataset", "digits", "--num-clients", "20",
                     "--clients-per-round", "5", "--local-epochs", "1", "--batch-size", "32",
                     "--partition", "iid", "--eval-every", "10", "--rounds", "10"],
}
GRID = {"lr": ["0.001", "0.002", "0.004"], "option.alpha": ["0.001", "0.002", "0.004"]}
GRID_DIGITS = {"lr": ["0.02", "0.05", "0.1"], "option.alpha": ["0.001", "0.002", "0.004"]}


def cli(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedjax_sparse", "run", *args, "--quiet", "--compile-cache", "off"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def final_accuracy(folder: Path) -> float:
    return json.loads((folder / "summary.json").read_text())["final_accuracy"]


def bench(name: str, flags: list[str], grid: dict, data_dir: str, work: Path) -> dict:
    sweep_flags = [f"--sweep={key}={','.join(values)}" for key, values in grid.items()]
    common = [*flags, "--data-dir", data_dir, "--seed", "0"]
    times = {}
    times["sweep_sequential"] = cli([*common, *sweep_flags, "--replica-parallelism", "sequential",
                                     "--out", str(work / "seq")])
    times["sweep_vmap"] = cli([*common, *sweep_flags, "--replica-parallelism", "vmap", "--out", str(work / "vmap")])
    separate, equal = 0.0, []
    for lr in grid["lr"]:
        for alpha in grid["option.alpha"]:
            out = work / f"sep_{lr}_{alpha}"
            separate += cli([*common, "--lr", lr, "--option", f"alpha={alpha}", "--out", str(out)])
            member = work / "seq" / f"lr={float(lr)},option.alpha={float(alpha)}" / "seed0"
            equal.append(final_accuracy(member) == final_accuracy(out))
    times["separate_runs"] = separate
    return {"setting": name, "flags": flags, "grid": grid, "members": len(equal), "seconds": times,
            "speedup_sequential_vs_separate": separate / times["sweep_sequential"],
            "speedup_vmap_vs_separate": separate / times["sweep_vmap"],
            "members_equal_separate_final_accuracy": all(equal)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--settings", default="spafl_digits,spafl_fmnist")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
              "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg(),
              "python": platform.python_version(), "jax": jax.__version__, "results": []}
    for name in args.settings.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"bench_sweep_{name}_"))
        try:
            grid = GRID_DIGITS if name == "spafl_digits" else GRID
            entry = bench(name, SETTINGS[name], grid, args.data_dir, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(entry, indent=2), flush=True)
        result["results"].append(entry)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
