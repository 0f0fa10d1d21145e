"""Driver for the SpaFL authors' FMNIST code (news-vt/SpaFL_NeruIPS_2024, main/fmnist),
unmodified, run from /work/sidebyside/spafl_authors/main/fmnist.

Differences from their train.py (the only ones):
  * torchvision.datasets.FashionMNIST is replaced by a small IDX reader of the same
    files that exposes the same .data (uint8 [N,28,28] tensor) and .targets (int64
    tensor) in file order; torchvision/wandb/matplotlib (imported by Simulator.py but
    only used for downloading/logging/plots) are stubbed as modules in sys.modules;
    wandb.log is captured to record the per-round numbers.
  * torch.set_num_threads(1); comm_rounds = --rounds.
  * The seed's draws are exported: partition (re-derived from a copy of the numpy RNG
    state by running their own Non_iid_split on index arrays), initial weights (their
    initial model's state dict), and the client-sampling sequence (recorded from
    Server.sample_clients).
  * --thresholds-only (the paper's Table 1 ablation, not in their code): weights frozen
    with requires_grad False and their own --th_update 0.
Everything else (seeding order, partition, model, training, evaluation, logging) is theirs.
"""
import argparse, gzip, json, os, sys, time, types, random, copy
import numpy as np

AUTH = "/work/sidebyside/spafl_authors/main/fmnist"
DATA = "/work/shared/data/fashion_mnist"

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, required=True)
ap.add_argument("--rounds", type=int, default=50)
ap.add_argument("--out", required=True)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--thresholds-only", action="store_true",
                help="the paper's Table 1 ablation, which their code has no switch for: every layer's weight "
                     "frozen (requires_grad False, so their SGD skips it) and their --th_update 0 (no eq. 13)")
ap.add_argument("--export-only", action="store_true", help="write the draws (cohorts by replaying their np.random.choice calls) and stop")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)

# ---- stubs for modules used only for download / logging / plotting
records = []
t_last = [time.time()]
def _wandb_log(d, *k, **kw):
    if "te_accuracy" in d:
        now = time.time()
        records.append({"round": len(records) + 1, "accuracy": float(d["te_accuracy"]),
                        "density": float(d["density"]), "loss": float(d["te_loss"]),
                        "round_seconds": now - t_last[0]})
        t_last[0] = now
        with open(os.path.join(a.out, "curve.json"), "w") as f:
            json.dump({"seed": a.seed, "rounds": records}, f)
        with open(os.path.join(a.out, "cohorts.json"), "w") as f:
            json.dump({"format": "fedjax_sparse.cohorts/1", "seed": a.seed, "rounds": cohorts}, f)
wandb = types.ModuleType("wandb"); wandb.init = lambda *x, **k: None; wandb.log = _wandb_log
tv = types.ModuleType("torchvision"); tv.datasets = types.ModuleType("torchvision.datasets")
tv.transforms = types.ModuleType("torchvision.transforms"); tv.transforms.ToTensor = object
mpl = types.ModuleType("matplotlib"); mpl.pyplot = types.ModuleType("matplotlib.pyplot")
sys.modules.update({"wandb": wandb, "torchvision": tv, "torchvision.datasets": tv.datasets,
                    "torchvision.transforms": tv.transforms, "matplotlib": mpl, "matplotlib.pyplot": mpl.pyplot})

import torch
from torch.utils.data import DataLoader
torch.set_num_threads(a.threads)
os.chdir(AUTH); sys.path.insert(0, AUTH)
from model import lenet
from utils import create_logger, makedirs
from Simulator import Simulator
from Split_Data import Non_iid_split
from server import Server_Class


def _idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)

class FMNIST:  # what torchvision.datasets.FashionMNIST exposes and their code uses
    def __init__(self, train):
        p = "train" if train else "t10k"
        self.data = torch.from_numpy(_idx(f"{DATA}/{p}-images-idx3-ubyte.gz").copy())
        self.targets = torch.from_numpy(_idx(f"{DATA}/{p}-labels-idx1-ubyte.gz").astype(np.int64))

class _Idx:  # same .targets, .data = positions (to read the partition's indices)
    def __init__(self, ds):
        self.targets = ds.targets
        self.data = torch.arange(len(ds.targets), dtype=torch.int64).view(-1, 1, 1)

# record the client-sampling sequence
cohorts = []
_orig_sample = Server_Class.Server.sample_clients
def _sample(self):
    s = _orig_sample(self); cohorts.append([int(i) for i in s]); return s
Server_Class.Server.sample_clients = _sample


def main(args):
    # ---- their train.main, with the dataset swap
    log_folder = os.path.join(args.log_root, args.affix)
    model_folder = os.path.join(args.model_root, args.affix)
    makedirs(log_folder); makedirs(model_folder)
    setattr(args, 'log_folder', log_folder); setattr(args, 'model_folder', model_folder)
    logger = create_logger(log_folder, 'train', 'info')
    device = torch.device("cpu")
    num_classes = 10
    tr_dataset = FMNIST(True)
    te_dataset = FMNIST(False)

    # export: replay their split on index arrays from a copy of the numpy RNG state
    state = np.random.get_state()
    idx_tr, idx_te = Non_iid_split(num_classes, args.num_clients, _Idx(tr_dataset), _Idx(te_dataset), args.alpha)
    np.random.set_state(state)
    Non_iid_tr_datasets, Non_iid_te_datasets = Non_iid_split(
        num_classes, args.num_clients, tr_dataset, te_dataset, args.alpha)
    clients = []
    for k in range(args.num_clients):
        tri = idx_tr[k].x_data.view(-1).to(torch.int64).numpy()
        tei = idx_te[k].x_data.view(-1).to(torch.int64).numpy()
        assert torch.equal(Non_iid_tr_datasets[k].x_data, tr_dataset.data[tri].unsqueeze(1).float())
        assert torch.equal(Non_iid_te_datasets[k].x_data, te_dataset.data[tei].unsqueeze(1).float())
        assert torch.equal(Non_iid_tr_datasets[k].y_data, tr_dataset.targets[tri])
        clients.append({"client": k, "train_indices": tri.tolist(), "test_indices": tei.tolist()})
    with open(os.path.join(a.out, "partition.json"), "w") as f:
        json.dump({"format": "fedjax_sparse.partition/1", "dataset": "fashion_mnist", "num_clients": args.num_clients,
                   "test_from_train": False, "seed": args.seed,
                   "spec": f"authors SpaFL fmnist Non_iid_split alpha={args.alpha} seed={args.seed}",
                   "clients": clients}, f)

    local_tr_data_loaders = [DataLoader(d, num_workers=0, batch_size=args.batch_size, shuffle=True)
                             for d in Non_iid_tr_datasets]
    local_te_data_loaders = [DataLoader(d, num_workers=0, batch_size=args.batch_size, shuffle=True)
                             for d in Non_iid_te_datasets]
    model = lenet.LeNet_5_Masked().to(device)
    if a.thresholds_only:  # only the thresholds train; draws unchanged (no RNG is used here)
        for layer in model.modules():
            if hasattr(layer, "threshold"):
                layer.weight.requires_grad_(False)

    # export the initial model: raw torch (OIHW, [out,in]) and the project's layout
    sd = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    np.savez(os.path.join(a.out, "init_torch.npz"), **sd)
    names = sorted(sd)
    extra = [n for n in names if not n.endswith((".weight", ".threshold"))]
    fc1 = sd["fc3.weight"].reshape(500, 50, 4, 4).transpose(2, 3, 1, 0).reshape(800, 500)
    np.savez(os.path.join(a.out, "init_params.npz"), **{
        "params/conv1/kernel": sd["conv1.weight"].transpose(2, 3, 1, 0),
        "params/conv2/kernel": sd["conv2.weight"].transpose(2, 3, 1, 0),
        "params/fc1/kernel": np.ascontiguousarray(fc1),
        "params/fc2/kernel": sd["fc4.weight"].T.copy()})
    with open(os.path.join(a.out, "init_info.json"), "w") as f:
        json.dump({"state_dict_keys": {n: list(sd[n].shape) for n in names}, "extra_keys": extra,
                   "thresholds_all_zero": all(float(np.abs(sd[n]).max()) == 0 for n in names if n.endswith("threshold"))}, f)

    if a.export_only:  # the loop's only numpy draws are Server.sample_clients (training uses torch RNG)
        server = Server_Class.Server(args, copy.deepcopy(model))
        for _ in range(args.comm_rounds):
            server.sample_clients()
        with open(os.path.join(a.out, "cohorts_predicted.json"), "w") as f:
            json.dump({"format": "fedjax_sparse.cohorts/1", "seed": args.seed, "rounds": cohorts}, f)
        sys.exit(0)
    trainer = Simulator(args, logger, local_tr_data_loaders, local_te_data_loaders, device)
    trainer.initialization(copy.deepcopy(model))
    t_last[0] = time.time()
    trainer.FL_loop()


if __name__ == '__main__':
    sys.argv = [sys.argv[0], "--learning_rate", "0.001", "--th_coeff", "0.002", "--local_epoch", "5",
                "--seed", str(a.seed), "--comm_rounds", str(a.rounds),
                "--th_update", "0" if a.thresholds_only else "1",
                "--log_root", os.path.join(a.out, "log"), "--model_root", os.path.join(a.out, "checkpoint")]
    from train_argument import parser
    args = parser()
    # their seeding, in their order
    random.seed(args.seed); np.random.seed(args.seed); torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed); torch.backends.cudnn.deterministic = True
    t0 = time.time()
    main(args)
    with open(os.path.join(a.out, "cohorts.json"), "w") as f:
        json.dump({"format": "fedjax_sparse.cohorts/1", "seed": args.seed, "rounds": cohorts}, f)
    with open(os.path.join(a.out, "curve.json"), "w") as f:
        json.dump({"seed": a.seed, "rounds": records, "total_seconds": time.time() - t0,
                   "torch": torch.__version__, "numpy": np.__version__, "threads": a.threads,
                   "authors_commit": "d3639ab", "finished": True,
                   "thresholds_only": a.thresholds_only}, f)
