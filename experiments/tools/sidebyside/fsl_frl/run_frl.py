"""Driver: the authors' FRL code (github SPIN-UMass/FRL @ 4cf2550, FL_type=FRL, no attack) on MNIST.

Runs FRL's own FRL_train() unchanged with the MNIST config 004 (1000 clients, Dirichlet 1.0 split from the
repo's cached pickle, 25 clients/round, 2 local epochs, batch 8, lr 0.4) for --rounds rounds, CPU, 1 thread.
Wrappers only observe: numpy.random.choice (records each round's cohort), models.LeNet (records the initial
frozen weights and scores), FL_train.test (FRL's own per-round evaluation on the global MNIST test set; we
log its accuracy + timings to JSON). Seeds random, torch AND np.random (FRL leaves np.random unseeded).

    cd /work/sidebyside_fsl && nice -n 10 torchenv/bin/python run_frl.py --seed 1 --rounds 20 --out runs/frl/seed1
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FRL = HERE / "frl"

p = argparse.ArgumentParser()
p.add_argument("--seed", type=int, required=True)
p.add_argument("--rounds", type=int, default=20)
p.add_argument("--out", required=True)
p.add_argument("--data", default="/work/shared/data/mnist")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--export", action="store_true", help="save the initial model (state dict) and cohorts")
cli = p.parse_args()
out = Path(cli.out).resolve()
out.mkdir(parents=True, exist_ok=True)

os.chdir(FRL)                      # the Dirichlet pickle is read relative to the cwd
sys.path.insert(0, str(FRL))
sys.argv = ["main.py", "--config", "experiments/004_config_MNIST_LeNet_FRL_1000users_noniid1.0_nomalicious.txt"]

import random
import numpy as np
import torch

torch.set_num_threads(cli.threads)
from args import args  # noqa: E402  (parses sys.argv + the config)

args.seed = cli.seed
args.data_loc = cli.data
args.FL_global_epochs = cli.rounds - 1   # FRL runs e = 0 .. FL_global_epochs inclusive
args.log_dir = str(out / "Logs")

import data  # noqa: E402
import models  # noqa: E402
import FL_train  # noqa: E402

# ---- observers ------------------------------------------------------------------------------
cohorts = []
_choice = np.random.choice


def recording_choice(*a, **k):
    r = _choice(*a, **k)
    if len(a) >= 2 and a[0] == args.nClients and a[1] == args.round_nclients:
        cohorts.append([int(c) for c in r])
    return r


np.random.choice = recording_choice

_LeNet = models.LeNet
initial = {}


def LeNet_recording():
    m = _LeNet()
    if not initial:
        for n, mod in m.named_modules():
            if hasattr(mod, "scores"):
                initial[n] = {"weight": mod.weight.detach().clone(), "scores": mod.scores.detach().clone()}
    return m


models.LeNet = LeNet_recording

rows = []
_test = FL_train.test
t_last = [None]


def recording_test(loader, model, criterion, device):
    t0 = time.perf_counter()
    loss, acc = _test(loader, model, criterion, device)
    t1 = time.perf_counter()
    r = len(rows) + 1
    rows.append({"round": r, "global_test_accuracy": float(acc), "global_test_loss": float(loss),
                 "train_seconds": t0 - t_last[0], "eval_seconds": t1 - t0,
                 "cohort": cohorts[-1] if cohorts else None})
    (out / "rounds.json").write_text(json.dumps({"seed": cli.seed, "rounds": rows}, indent=1))
    print(f"round {r}: test acc {float(acc):.4f} train {t0 - t_last[0]:.1f}s eval {t1 - t0:.1f}s", flush=True)
    t_last[0] = time.perf_counter()
    return loss, acc


FL_train.test = recording_test

# ---- main.main() as FRL does it, with np.random seeded too -----------------------------------
random.seed(args.seed)
torch.manual_seed(args.seed)
np.random.seed(args.seed)
args.run_base_dir = out
(out / "output.txt").write_text(str(args))
dist = getattr(data, args.set)()
tr_loaders, te_loader = dist.get_tr_loaders(), dist.get_te_loader()
args.device = torch.device("cpu")
t_last[0] = time.perf_counter()
t_start = time.perf_counter()
FL_train.FRL_train(tr_loaders, te_loader)
total = time.perf_counter() - t_start

summary = {"seed": cli.seed, "rounds": len(rows), "total_seconds": total,
           "final_global_test_accuracy": rows[-1]["global_test_accuracy"] if rows else None,
           "frl_commit": "4cf2550", "torch": torch.__version__, "threads": cli.threads}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
if cli.export:
    torch.save({n: v for n, v in initial.items()}, out / "initial_model.pt")
    (out / "cohorts.json").write_text(json.dumps({"format": "fedjax_sparse.cohorts/1", "rounds": cohorts}))
    import pickle
    parts, _ = pickle.load(open(f"{args.set}_train_dirichlet_a_1.0_n1000.pkl", "rb"))
    (out / "frl_partition_raw.json").write_text(json.dumps({str(k): [int(i) for i in v] for k, v in parts.items()}))
print(json.dumps(summary))
