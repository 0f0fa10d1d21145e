"""General-purpose models (the papers' own models live in their own modules)."""
from __future__ import annotations

from fedjax_sparse.models.base import Conv, Dense, Flatten, sequential
from fedjax_sparse.models.registry import register_model


@register_model("lenet5_caffe")
def lenet5_caffe(input_shape, num_classes, **options):
    """LeNet-5-Caffe (SpaFL's FMNIST model): conv 20 5x5, pool, conv 50 5x5,
    pool, fc 500, fc classes; no biases. 580 rows on 28x28x1 inputs."""
    return sequential("lenet5_caffe", input_shape, num_classes, [
        Conv("conv1", 20, 5, pool=2),
        Conv("conv2", 50, 5, pool=2),
        Flatten(),
        Dense("fc1", 500),
        Dense("fc2", num_classes, relu=False),
    ], **options)


@register_model("cnn_small")
def cnn_small(input_shape, num_classes, **options):
    """A small CNN for 8x8 digits and quick tests: conv 16 3x3 SAME, pool, fc 64, fc classes."""
    return sequential("cnn_small", input_shape, num_classes, [
        Conv("conv1", 16, 3, padding="SAME", pool=2),
        Flatten(),
        Dense("fc1", 64),
        Dense("fc2", num_classes, relu=False),
    ], **options)


@register_model("mlp")
def mlp(input_shape, num_classes, hidden: int = 200, **options):
    """Two hidden layers of ``hidden`` units (McMahan et al.'s 2NN)."""
    return sequential("mlp", input_shape, num_classes, [
        Flatten(),
        Dense("fc1", hidden, bias=True),
        Dense("fc2", hidden, bias=True),
        Dense("fc3", num_classes, bias=True, relu=False),
    ], **options)


@register_model("logreg")
def logreg(input_shape, num_classes, **options):
    """Multinomial logistic regression (the FedProx synthetic baseline model)."""
    return sequential("logreg", input_shape, num_classes, [
        Flatten(),
        Dense("fc", num_classes, bias=True, relu=False),
    ], **options)
