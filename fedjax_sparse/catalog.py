"""What ``python -m fedjax_sparse list`` says about each algorithm (what it is, its paper) and each
model (the data sets it suits). Plain data; ``tests/test_discovery.py`` checks that every registered
algorithm and model has its line, so a new one is listed with a description."""
from __future__ import annotations

ALGORITHMS = {
    "caldas": "federated dropout: each client trains a random sub-model (Caldas et al. 2018, "
              "\"Expanding the reach of federated learning\")",
    "fedavg": "federated averaging of local SGD (McMahan et al., AISTATS 2017)",
    "fedavg_robust": "FedAvg with a robust aggregator under a model-poisoning attack "
                     "(Shejwalkar & Houmansadr, NDSS 2021)",
    "fedavgm": "FedAvg with server momentum (Hsu et al. 2019)",
    "feddrop": "FedDrop: synchronised channel dropout with per-client keep rates optimised by the server "
               "(docs/feddrop.md)",
    "fedpm": "FedPM: Bayesian supermasks of a frozen random network (Isik et al., ICLR 2023; SpaFL's Table 2)",
    "fedprox": "FedAvg with a proximal term mu/2 |w - w_server|^2 (Li et al., MLSys 2020)",
    "fjord": "FjORD: ordered dropout, clients train nested width sub-models (Horvath et al., NeurIPS 2021)",
    "fsl": "FSL: federated supermask learning, clients exchange edge rankings of a frozen network "
           "(ICLR 2022 submission; docs/fsl.md)",
    "heterofl": "HeteroFL: clients train width-scaled sub-models (Diao et al., ICLR 2021)",
    "local": "local training only, nothing communicated (the personalisation baseline)",
    "multi_krum": "FedAvg with Multi-Krum aggregation (Blanchard et al., NeurIPS 2017), under attack",
    "scaffold": "SCAFFOLD: control variates against client drift (Karimireddy et al., ICML 2020)",
    "sfsl": "Sparse-FSL: FSL whose clients upload only their top ranks (FSL paper; docs/fsl.md)",
    "signsgd": "SignSGD with majority vote (Bernstein et al., ICLR 2019)",
    "spafl": "SpaFL: trainable per-neuron thresholds, only thresholds communicated, personal sparse weights "
             "(Kim et al., NeurIPS 2024; docs/spafl.md)",
    "spafl_local": "SpaFL's local training alone, nothing communicated (SpaFL's ablation)",
    "spafl_no_eq13": "SpaFL without the global-threshold weight update of eq. 13 (SpaFL's ablation)",
    "spafl_thresholds_only": "SpaFL training only the thresholds, weights frozen (SpaFL's ablation)",
    "topk": "top-k sparsified updates, optional error feedback (Aji & Heafield 2017; Alistarh et al. 2018)",
    "trimmed_mean": "FedAvg with coordinate-wise trimmed mean (Yin et al., ICML 2018), under attack",
    "unidrop": "uniform channel dropout at one rate for every client (FedDrop's baseline)",
}

# model -> the data sets it suits (by input shape; the first is the one its paper used).
MODELS = {
    "cnn7": "cifar10, cifar10_sample, svhn (32x32x3; SpaFL's CIFAR-10 CNN)",
    "cnn_small": "digits (8x8x1; quick tests), any small image",
    "conv8": "cifar10, svhn (32x32x3; FSL's CIFAR-10 model)",
    "feddrop_fmnist_cnn": "fashion_mnist, mnist, emnist_letters (28x28x1; FedDrop's Table 6)",
    "feddrop_svhn_cnn": "svhn, cifar10 (32x32x3; FedDrop's Table 7)",
    "feddrop_vgg9": "cifar10, svhn (32x32x3; FedDrop's Table 8)",
    "fsl_lenet": "mnist, fashion_mnist, emnist_letters (28x28x1; FSL's MNIST model)",
    "lenet5_caffe": "fashion_mnist, mnist, emnist_letters, svhn (SpaFL's FMNIST model)",
    "logreg": "synthetic (FedProx's synthetic data), any flat features",
    "mlp": "mnist, fashion_mnist, digits, synthetic (McMahan et al.'s 2NN)",
    "resnet18_narrow": "cifar100, cifar10 (32x32x3; SpaFL's CIFAR-100 ResNet-18)",
    "vit_small": "cifar10 (32x32x3; SpaFL's ViT)",
}

# The client learning rate a run uses when none is given (``RunConfig(lr=None)``, no ``--lr``): one that
# trains every built-in image data set with the default preprocessing (unit-scaled pixels) and the
# algorithm's default options (tests/test_default_lr.py). Clients that train with momentum 0.9 by
# default (SpaFL's, SignSGD's) take a tenth of plain SGD's: at 0.1 SpaFL diverged on Fashion-MNIST
# (round 21). Algorithms not listed (and algorithms given as objects) take DEFAULT_LR.
DEFAULT_LR = 0.1
ALGORITHM_LR = {
    "spafl": 0.01, "spafl_no_eq13": 0.01, "spafl_thresholds_only": 0.01, "spafl_local": 0.01,
    "signsgd": 0.01,
}


def default_lr(algorithm) -> float:
    """The learning rate of ``algorithm`` (a name; anything else: DEFAULT_LR) when none is given."""
    return ALGORITHM_LR.get(algorithm, DEFAULT_LR) if isinstance(algorithm, str) else DEFAULT_LR
