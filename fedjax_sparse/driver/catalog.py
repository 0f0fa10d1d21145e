"""What ``python -m fedjax_sparse list`` says about each algorithm (what it is, its paper, its default
learning rate) and each model (the data sets it suits).

An algorithm's lines are read from its registration (``register_algorithm(name, options,
description=, paper=, lr=)``), so a new algorithm is one file: ``ALGORITHMS`` and ``ALGORITHM_LR``
are built from the registry when read (algorithms registered later, in a notebook or a test,
included). ``tests/algorithms/test_every_algorithm.py`` checks that every algorithm of the package and every
model has its line."""
from __future__ import annotations

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
# algorithm's default options (tests/algorithms/test_every_algorithm.py). An algorithm registers another one with
# ``register_algorithm(..., lr=)``: those whose clients train with momentum 0.9 by default (SpaFL's,
# SignSGD's) take a tenth of plain SGD's (CHANGELOG 0.2.0).
# Algorithms registering none (and algorithms given as objects) take DEFAULT_LR.
DEFAULT_LR = 0.1


def _entries():
    from fedjax_sparse.algorithms import registry   # importing the package registers its algorithms
    return [registry.algorithm_entry(name) for name in registry.algorithm_names()]


def algorithm_line(entry) -> str | None:
    """An algorithm's line in ``list``: its description and, in parentheses, its paper."""
    if entry.description is None:
        return None
    return entry.description + (f" ({entry.paper})" if entry.paper else "")


def __getattr__(name: str):
    # ALGORITHMS: name -> "description (paper)"; ALGORITHM_LR: name -> its registered default lr.
    # Read from the registry on each access, so they can never disagree with the registrations.
    if name == "ALGORITHMS":
        return {e.name: algorithm_line(e) for e in _entries() if e.description is not None}
    if name == "ALGORITHM_LR":
        return {e.name: e.lr for e in _entries() if e.lr is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_lr(algorithm) -> float:
    """The learning rate of ``algorithm`` (a name; anything else: DEFAULT_LR) when none is given: the
    one its registration declares (``register_algorithm(..., lr=)``), else DEFAULT_LR."""
    if not isinstance(algorithm, str):
        return DEFAULT_LR
    from fedjax_sparse.algorithms import algorithm_names, registry
    if algorithm not in algorithm_names():
        return DEFAULT_LR   # an unknown name: config.validate refuses it, naming the valid ones
    lr = registry.algorithm_entry(algorithm).lr
    return DEFAULT_LR if lr is None else lr
