"""Example Flax models, written as a user would write them, for ``from_flax`` and ``--model``.

``LeNet5Caffe`` is the zoo's ``lenet5_caffe`` (SpaFL's FMNIST model) in ``flax.linen``; given the
zoo's weights it computes the same logits bit for bit, and trains to the same numbers
(``tests/models/test_flax_models.py``). From the command line::

    python -m fedjax_sparse run --model fedjax_sparse.models.flax_examples:LeNet5Caffe ...

``NnxLeNet5Caffe`` is the same network in ``flax.nnx`` (built for 28x28x1 inputs by default).
"""
from __future__ import annotations

import flax.linen as nn
from flax import nnx


class LeNet5Caffe(nn.Module):
    """conv 20 5x5, max-pool 2, conv 50 5x5, max-pool 2, fc 500, fc ``num_classes``; ReLU; no biases."""
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(20, (5, 5), padding="VALID", use_bias=False, name="conv1")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(50, (5, 5), padding="VALID", use_bias=False, name="conv2")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(500, use_bias=False, name="fc1")(x))
        return nn.Dense(self.num_classes, use_bias=False, name="fc2")(x)


class NnxLeNet5Caffe(nnx.Module):
    """The same network in ``flax.nnx``; ``flat_features`` is 800 on 28x28 inputs (50 x 4 x 4)."""

    def __init__(self, num_classes: int = 10, flat_features: int = 800, in_channels: int = 1, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.conv1 = nnx.Conv(in_channels, 20, (5, 5), padding="VALID", use_bias=False, rngs=rngs)
        self.conv2 = nnx.Conv(20, 50, (5, 5), padding="VALID", use_bias=False, rngs=rngs)
        self.fc1 = nnx.Linear(flat_features, 500, use_bias=False, rngs=rngs)
        self.fc2 = nnx.Linear(500, num_classes, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        return self.fc2(nnx.relu(self.fc1(x.reshape(x.shape[0], -1))))


__all__ = ["LeNet5Caffe", "NnxLeNet5Caffe"]
