"""FRL seed-1 draws -> the project's pinned-draw files.

partition: FRL's client train indices (its cached Dirichlet pickle; FRL trains on all of them, no local test
split); test_from_train=false and client i gets MNIST TEST indices [10 i, 10 i + 10), so the union of the
clients' test sets is the whole MNIST test set and the project's "global_accuracy" equals FRL's metric.
init: FRL's frozen weights and initial scores (1x1-conv "linear" layers reshaped to [out, in]; NCHW
flattening reordered by pinning.params_from_torch). cohorts: copied.

    cd /work/main && .venv/bin/python /work/sidebyside_fsl/export_draws.py /work/sidebyside_fsl/runs/frl/seed1
"""
import json
import sys
from pathlib import Path

import numpy as np

from fedjax_sparse.models import make_model
from fedjax_sparse.driver import pinning

src = Path(sys.argv[1])
dst = src / "pinned"
dst.mkdir(exist_ok=True)
raw = json.loads((src / "frl_partition_raw.json").read_text())
clients = [{"client": i, "train_indices": sorted(raw[str(i)]), "test_indices": list(range(10 * i, 10 * i + 10))}
           for i in range(1000)]
(dst / "partition.json").write_text(json.dumps({"format": "fedjax_sparse.partition/1", "dataset": "mnist",
                                                "num_clients": 1000, "test_from_train": False,
                                                "spec": "FRL MNIST_train_dirichlet_a_1.0_n1000.pkl",
                                                "clients": clients}))
_npz = np.load(src / "initial_model_torch_layout.npz")   # written from initial_model.pt by torchenv
init = {}
for _k in _npz.files:
    _mod, _name = _k.split("/")
    init.setdefault(_mod, {})[_name] = _npz[_k]
model = make_model("fsl_lenet", (28, 28, 1), 10)
names = {layer.name: mod for layer, mod in zip(model.layers, ["convs.0", "convs.2", "linear.0", "linear.2"])}


def as_sd(key):
    sd = {}
    for mod in names.values():
        w = init[mod][key]
        if mod.startswith("linear"):
            w = w.reshape(w.shape[0], w.shape[1])
        sd[f"{mod}.weight"] = w
    return pinning.params_from_torch(model, sd, names=names)["params"]


weights, scores = as_sd("weight"), as_sd("scores")
arrays = {f"params/{l}/kernel": v["kernel"] for l, v in weights.items()}
arrays.update({f"scores/{l}/kernel": v["kernel"] for l, v in scores.items()})
np.savez(dst / "init.npz", **arrays)
cohorts = json.loads((src / "cohorts.json").read_text())
(dst / "cohorts.json").write_text(json.dumps(cohorts))
print({k: v.shape for k, v in arrays.items()}, len(cohorts["rounds"]))
