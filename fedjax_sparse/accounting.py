"""Cost accounting: training FLOPs and communication bits.

Conventions (issue #2; papers' appendices):
* a multiply-accumulate is 2 FLOPs; forward FLOPs of a layer = 2 * MACs;
* backward = 2 x forward, so one training example costs 3 x forward;
* a layer whose kept fraction is d costs d x its dense FLOPs (pruned rows /
  dropped channels cost nothing forward or backward);
* communication counts 32-bit floats unless an algorithm says otherwise, summed
  over all sampled clients of a round, uplink and downlink separately.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.models.base import Model

FLOAT_BITS = 32


def layer_forward_flops(model: Model) -> np.ndarray:
    """[L] dense forward FLOPs per example of each weight layer (2 x MACs)."""
    return np.array([2.0 * layer.macs for layer in model.layers], np.float64)


def forward_flops(model: Model, layer_density: Sequence | jax.Array | None = None):
    """Forward FLOPs per example; ``layer_density`` [L] scales each layer."""
    dense = layer_forward_flops(model)
    if layer_density is None:
        return float(dense.sum())
    return jnp.dot(jnp.asarray(dense, jnp.float32), jnp.asarray(layer_density, jnp.float32))


def training_flops(model: Model, num_examples, layer_density=None):
    """FLOPs of training on ``num_examples`` examples (forward + 2x backward)."""
    return 3.0 * forward_flops(model, layer_density) * num_examples


def num_values(tree) -> int:
    """Number of scalars in a pytree (static: from shapes)."""
    return int(sum(np.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(tree)))


def tree_bits(tree, bits_per_value: int = FLOAT_BITS) -> int:
    return num_values(tree) * bits_per_value


def gbit(bits: float) -> float:
    return bits / 1e9


def megabytes(bits: float) -> float:
    return bits / 8 / 1e6


def summarize_layers(model: Model) -> list[Mapping]:
    return [dict(name=l.name, kind=l.kind, kernel_shape=list(l.kernel_shape), macs=l.macs,
                 rows=l.out_units, weights=l.num_weights) for l in model.layers]
