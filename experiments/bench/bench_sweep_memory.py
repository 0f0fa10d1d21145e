"""Peak memory of a sweep whose members each hold a large client state, before and after the sweep
opened one program's members at a time.

The sweep: SpaFL on Fashion-MNIST with 500 clients (each member keeps 500 personalised LeNet-5-Caffe
models and their momentum, 1.6 GiB), a DP target epsilon over 5 values (untraceable: a program per
value), one seed, 10 rounds (so that most clients' rows have been written: untouched
rows of a fresh state are not yet resident). Run as ``python -m fedjax_sparse run --sweep ...`` in a child process
whose peak resident memory (``ru_maxrss``) is read when it ends; once with this checkout's package and
once with ``--before-checkout``'s (a ``git worktree`` of the commit before the change), each run
from its checkout so that it imports its own package, in one invocation.

    git worktree add /tmp/before b24ae2b   # the commit before the change
    python experiments/bench/bench_sweep_memory.py --data-dir ../shared/data --before-checkout /tmp/before \\
        --out experiments/results/perf/sweep_memory_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND = ["--algorithm", "spafl", "--option", "ramp=true", "--option", "momentum=0.9", "--dataset", "fashion_mnist",
           "--model", "lenet5_caffe", "--num-clients", "500", "--clients-per-round", "50", "--local-epochs", "1",
           "--batch-size", "64", "--partition", "dirichlet:0.5", "--min-client-samples", "32", "--preprocess", "raw",
           "--eval-every", "10", "--eval-batch-size", "128", "--rounds", "10", "--lr", "0.001", "--dp-clip", "0.07",
           "--sweep", "dp_target_epsilon=1,2,4,8,16", "--seeds", "0", "--quiet"]


def peak_rss_of_sweep(checkout: Path, data_dir: str) -> dict:
    """Runs the sweep with ``checkout``'s package in a fresh process; its peak RSS and wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        # Run from the checkout: ``-m`` puts the working directory first on sys.path (PYTHONPATH would lose
        # to it, and an editable install of this checkout would answer instead).
        child = subprocess.Popen([sys.executable, "-m", "fedjax_sparse", "run", *COMMAND, "--data-dir",
                                  str(Path(data_dir).resolve()), "--out", str(Path(tmp) / "sweep")], cwd=checkout,
                                 stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)
        if status != 0:
            raise SystemExit(f"the sweep with {checkout} failed (status {status})")
        # ru_maxrss: KiB on Linux
        return {"checkout": str(checkout), "package": package_file(checkout), "peak_rss_gib": usage.ru_maxrss / 2**20,
                "seconds": time.perf_counter() - t0}


def package_file(checkout: Path) -> str:
    """Where ``import fedjax_sparse`` resolves when run from ``checkout`` (the bench checks it is there)."""
    return subprocess.run([sys.executable, "-c", "import fedjax_sparse; print(fedjax_sparse.__file__)"], cwd=checkout,
                          capture_output=True, text=True, check=True).stdout.strip()


def git_head(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--before-checkout", required=True, help="a checkout of the commit before the change")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[2]
    runs = {}
    for name, checkout in (("before", Path(args.before_checkout).resolve()), ("after", here)):
        if not package_file(checkout).startswith(str(checkout)):
            raise SystemExit(f"running from {checkout} imports {package_file(checkout)}, not its own package")
        runs[name] = {**peak_rss_of_sweep(checkout, args.data_dir), "commit": git_head(checkout)}
        print(f"{name} ({runs[name]['commit']}): peak RSS {runs[name]['peak_rss_gib']:.2f} GiB, "
              f"{runs[name]['seconds']:.1f} s", flush=True)
    record = {"command": "python -m fedjax_sparse run " + " ".join(COMMAND), "runs": runs,
              "peak_rss_after_over_before": runs["after"]["peak_rss_gib"] / runs["before"]["peak_rss_gib"],
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30},
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
