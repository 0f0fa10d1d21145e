"""Re-creates FRL seed-S's draws without training (same RNG consumption order as run_frl.py / FRL main + FRL_train):
initial model (torch.manual_seed(S) then LeNet with MaskConv + signed_constant) and the 20 cohorts
(np.random.seed(S), one np.random.choice(1000, 25, replace=False) per round). Checked afterwards against the
cohorts that run_frl.py records in rounds.json.
    cd /work/sidebyside_fsl && torchenv/bin/python replay_draws_frl.py 1 runs/frl_draws/seed1
"""
import json, os, sys, random, pickle
from pathlib import Path
seed, out = int(sys.argv[1]), Path(sys.argv[2]).resolve()
out.mkdir(parents=True, exist_ok=True)
HERE = Path(__file__).resolve().parent
os.chdir(HERE / "frl"); sys.path.insert(0, str(HERE / "frl"))
sys.argv = ["main.py", "--config", "experiments/004_config_MNIST_LeNet_FRL_1000users_noniid1.0_nomalicious.txt"]
import numpy as np, torch
from args import args
random.seed(seed); torch.manual_seed(seed); np.random.seed(seed)
args.conv_type = 'MaskConv'; args.conv_init = 'signed_constant'; args.bn_type = "NonAffineNoStatsBN"   # as FRL_train
import models
m = models.LeNet()
init = {n: {"weight": mod.weight.detach().clone(), "scores": mod.scores.detach().clone()}
        for n, mod in m.named_modules() if hasattr(mod, "scores")}
torch.save(init, out / "initial_model.pt")
cohorts = [[int(c) for c in np.random.choice(1000, 25, replace=False)] for _ in range(20)]
(out / "cohorts.json").write_text(json.dumps({"format": "fedjax_sparse.cohorts/1", "rounds": cohorts}))
parts, _ = pickle.load(open("MNIST_train_dirichlet_a_1.0_n1000.pkl", "rb"))
(out / "frl_partition_raw.json").write_text(json.dumps({str(k): [int(i) for i in v] for k, v in parts.items()}))
print("ok", cohorts[0][:5])
