"""Rounds/s against processes and devices (issue 12): the same run as 1 process, 1 process with
several devices, and several jax.distributed processes, side by side in one invocation.

Every configuration is a real ``python -m fedjax_sparse run`` (processes launched here, on this
machine, with ``--xla_force_host_platform_device_count`` giving each its CPU "devices"); speed is
the run's own ``rounds_per_second_after_first_chunk`` (evaluation included, compilation excluded),
and the final accuracies show the configurations computed the same thing.

``--baseline-tree DIR`` also runs the single-process default from another checkout (e.g. a git
worktree of the commit before a change), so a before/after of the single-process path sits in the
same file.

    python experiments/bench/bench_processes.py --data-dir ../shared/data \
        --out experiments/results/perf/multiprocess_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# SpaFL, Fashion-MNIST LeNet-5-Caffe, as experiments/reproduce/spafl_fmnist.py, with 1 local epoch and a
# cohort of 8 (it must split evenly over 1, 2 and 4 devices) so the whole comparison takes minutes.
RUN = ["run", "--algorithm", "spafl", "--dataset", "fashion_mnist", "--model", "lenet5_caffe",
       "--num-clients", "100", "--clients-per-round", "8", "--local-epochs", "1", "--batch-size", "64",
       "--lr", "0.001", "--partition", "dirichlet:0.2", "--min-client-samples", "64", "--preprocess", "raw",
       "--option", "alpha=0.002", "--option", "momentum=0.9", "--seed", "1", "--quiet",
       "--compile-cache", "off"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_config(name: str, processes: int, devices: int, parallelism: str, args, tree: Path = ROOT) -> dict:
    """One configuration: ``processes`` processes with ``devices`` CPU devices each."""
    out = Path(tempfile.mkdtemp(prefix="bench_processes_")) / name
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(tree))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    command = [sys.executable, "-m", "fedjax_sparse", *RUN, "--data-dir", str(args.data_dir), "--rounds",
               str(args.rounds), "--eval-every", str(args.eval_every), "--client-parallelism", parallelism,
               "--out", str(out)]
    port = _free_port()
    t = time.perf_counter()
    procs = []
    for i in reversed(range(processes)):
        extra = [] if processes == 1 else ["--coordinator", f"localhost:{port}", "--num-processes",
                                           str(processes), "--process-id", str(i)]
        procs.append(subprocess.Popen(command + extra, env=env, cwd=str(tree), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t
    if any(p.returncode for p in procs):
        raise SystemExit(f"{name} failed:\n" + "\n".join(log[-3000:] for log in logs))
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    row = {"name": name, "processes": processes, "devices_per_process": devices,
           "client_parallelism": config["client_parallelism"], "client_devices": config.get("client_devices"),
           "rounds_per_second": summary["rounds_per_second_after_first_chunk"],
           "first_chunk_seconds_incl_compile": summary["first_chunk_seconds_incl_compile"],
           "wall_seconds": wall, "final_accuracy": summary["final_accuracy"], "final_loss_row": None,
           "code": str(tree)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    row["final_loss_row"] = rows[-1]["loss"]
    print(f"{name:<34} {row['rounds_per_second']:.3f} rounds/s  first chunk "
          f"{row['first_chunk_seconds_incl_compile']:.1f} s  final accuracy {row['final_accuracy']:.4f}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=3)
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="another checkout whose single-process default run is timed too (before/after)")
    ap.add_argument("--repeats", type=int, default=3, help="before/after pairs of the single-process default")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    configs = [("one process, map (CPU default)", 1, 1, "auto"),
               ("one process, vmap, 1 device", 1, 1, "vmap"),
               ("one process, vmap, 2 devices", 1, 2, "vmap"),
               ("two processes x 1 device", 2, 1, "vmap"),
               ("two processes x 2 devices", 2, 2, "vmap")]
    results = []
    if args.baseline_tree is not None:
        results.append(run_config("before: one process, map", 1, 1, "auto", args, tree=args.baseline_tree))
    for name, processes, devices, parallelism in configs:
        results.append(run_config(name, processes, devices, parallelism, args))
    if args.baseline_tree is not None:  # alternated, so drift in the machine's load shows
        for _ in range(args.repeats - 1):
            results.append(run_config("before: one process, map (again)", 1, 1, "auto", args, tree=args.baseline_tree))
            results.append(run_config("one process, map (CPU default, again)", 1, 1, "auto", args))
    vmap_accuracies = {r["final_accuracy"] for r in results if r["client_parallelism"] == "vmap"}
    report = {
        "what": "SpaFL Fashion-MNIST LeNet-5-Caffe, 100 clients, 8 per round, 1 local epoch, "
                f"{args.rounds} rounds, evaluation of all clients every {args.eval_every}: rounds/s after the "
                "first chunk (evaluation included) for processes x CPU devices on this machine",
        "command": "python experiments/bench/bench_processes.py --data-dir ../shared/data"
                   + ("" if args.baseline_tree is None else " --baseline-tree <worktree of the previous commit>")
                   + f" --rounds {args.rounds} --eval-every {args.eval_every} --repeats {args.repeats}"
                   + f" --out {args.out}",
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
        "results": results,
        "vmap_final_accuracies_distinct": sorted(vmap_accuracies),
        "single_process_before_after": None if args.baseline_tree is None else {
            "before_rounds_per_second": [r["rounds_per_second"] for r in results if r["name"].startswith("before")],
            "after_rounds_per_second": [r["rounds_per_second"] for r in results
                                        if r["name"].startswith("one process, map")]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
