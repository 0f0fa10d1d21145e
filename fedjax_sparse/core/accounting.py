"""Cost accounting: training FLOPs and communication bits.

Conventions (papers' appendices): a multiply-accumulate is 2 FLOPs; backward =
2 x forward, so one training example costs 3 x forward; a layer whose kept
fraction is d costs d x its dense FLOPs; communication counts 32-bit floats
unless an algorithm says otherwise, summed over the sampled clients of a round.

Exactness: bits and FLOPs routinely exceed 2^24 per client (float32 loses units
there). A client reports a :class:`Cost`, a sum of terms ``unit * a * b`` with a
static Python-number ``unit`` and small int32 counts ``a, b`` traced on the
device; the host multiplies and sums them as Python ints (:func:`cost_per_round`).
Only expectations (FedDrop's FLOPs under keep probabilities) use float factors,
summed in float64. docs/design.md, "Cost accounting".
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedjax_sparse.models.base import Model

FLOAT_BITS = 32


def layer_forward_flops(model: Model) -> np.ndarray:
    """[L] dense forward FLOPs per example of each weight layer (2 x MACs)."""
    return np.array([2.0 * layer.macs for layer in model.layers], np.float64)


def forward_flops(model: Model, layer_density: Sequence | jax.Array | None = None):
    """Forward FLOPs per example; ``layer_density`` [L] scales each layer
    (float32: for expectations and plots, not for the recorded totals)."""
    dense = layer_forward_flops(model)
    if layer_density is None:
        return float(dense.sum())
    return jnp.dot(jnp.asarray(dense, jnp.float32), jnp.asarray(layer_density, jnp.float32))


def training_flops_per_example(model: Model) -> int:
    """Exact dense training FLOPs of one example: 3 x 2 x MACs (forward + 2x backward)."""
    return 3 * 2 * int(model.forward_macs)


def training_flops(model: Model, num_examples) -> "Cost":
    """Exact FLOPs of dense training on ``num_examples`` (int) examples."""
    return Cost.term(training_flops_per_example(model), num_examples)


def row_training_flops(model: Model) -> tuple[int, ...]:
    """[L] exact training FLOPs of one example through one output row (neuron /
    filter) of each layer: 3 x 2 x MACs / out_units (an integer: a row's MACs
    are its fan-in times the output positions)."""
    out = []
    for layer in model.layers:
        if layer.macs % layer.out_units:
            raise ValueError(f"layer {layer.name}: {layer.macs} MACs do not split into {layer.out_units} rows")
        out.append(6 * (layer.macs // layer.out_units))
    return tuple(out)


def weight_training_flops(model: Model) -> tuple[int, ...]:
    """[L] exact training FLOPs of one example through one weight of each layer:
    3 x 2 x (output positions) = 6 x MACs / num_weights."""
    out = []
    for layer in model.layers:
        if layer.macs % layer.num_weights:
            raise ValueError(f"layer {layer.name}: {layer.macs} MACs are not a multiple of its "
                             f"{layer.num_weights} weights")
        out.append(6 * (layer.macs // layer.num_weights))
    return tuple(out)


def num_values(tree) -> int:
    """Number of scalars in a pytree (static: from shapes)."""
    return int(sum(np.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(tree)))


def tree_bits(tree, bits_per_value: int = FLOAT_BITS) -> int:
    return num_values(tree) * bits_per_value


# ---------------------------------------------------------------- exact costs
def _exact_unit(unit):
    """Python int when the unit is integral (exact arithmetic), else float."""
    if isinstance(unit, (bool, np.bool_)):
        raise TypeError("a cost unit must be a number, not a bool")
    if isinstance(unit, (int, np.integer)):
        return int(unit)
    unit = float(unit)
    return int(unit) if unit.is_integer() else unit


@struct.dataclass
class Cost:
    """A non-negative cost ``sum_t units[t] * factors[t, 0] * factors[t, 1]``.

    ``factors``: [T, 2] int32 (exact counts; float32 only for expectations),
    traced, gaining leading client / round axes under vmap and scan;
    ``units``: T static Python numbers. Costs add by concatenating terms.
    """
    factors: jax.Array
    units: tuple = struct.field(pytree_node=False)

    @classmethod
    def constant(cls, value) -> "Cost":
        """A static amount (e.g. the bits of a fixed-size message)."""
        return cls(jnp.ones((1, 2), jnp.int32), (_exact_unit(value),))

    @classmethod
    def term(cls, unit, a, b=1) -> "Cost":
        """``unit * a * b`` with traced counts ``a``, ``b`` (ints, or floats for expectations)."""
        a, b = jnp.asarray(a), jnp.asarray(b)
        dtype = jnp.int32 if all(jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_
                                 for x in (a, b)) else jnp.float32
        return cls(jnp.stack([a.astype(dtype), b.astype(dtype)]).reshape(1, 2), (_exact_unit(unit),))

    @classmethod
    def terms(cls, units: Sequence, a: jax.Array, b=None) -> "Cost":
        """One term per unit: ``units[t] * a[t] * b[t]`` (``a``, ``b``: [T])."""
        a = jnp.asarray(a)
        b = jnp.ones_like(a) if b is None else jnp.broadcast_to(jnp.asarray(b), a.shape)
        dtype = jnp.int32 if jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.integer) \
            else jnp.float32
        return cls(jnp.stack([a.astype(dtype), b.astype(dtype)], axis=-1), tuple(_exact_unit(u) for u in units))

    def __add__(self, other: "Cost") -> "Cost":
        if not isinstance(other, Cost):
            return NotImplemented
        dtype = jnp.result_type(self.factors.dtype, other.factors.dtype)
        return Cost(jnp.concatenate([self.factors.astype(dtype), other.factors.astype(dtype)], axis=-2),
                    self.units + other.units)

    def total(self):
        """Host-side exact value summed over any leading (client, round) axes: a Python
        int, or a float when a factor or unit is fractional."""
        factors = np.asarray(self.factors)
        return cost_per_round(Cost(factors.reshape((1, -1) + factors.shape[-2:]), self.units))[0]

    def __int__(self) -> int:
        return int(self.total())

    def __float__(self) -> float:
        return float(self.total())


def as_cost(value) -> Cost:
    """A Cost from a Cost, a static number, or a traced count (int: exact; float: float64 on the host)."""
    if isinstance(value, Cost):
        return value
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return Cost.constant(value)
    return Cost.term(1, value)


def cost_per_round(cost: Cost, leading_axes: int = 1):
    """Host-side exact value of a stacked Cost.

    ``cost.factors``: [R, K, T, 2] (rounds, clients) as fetched from the device
    (or [K, T, 2] with ``leading_axes=0``). Returns a list of R Python numbers:
    ints when every factor and unit is an integer (exact at any size), floats
    (float64 sums) otherwise. The client and term sums are exact int64
    (each factor < 2^31, a product < 2^62).
    """
    factors = np.asarray(cost.factors)
    if leading_axes == 0:
        factors = factors[None]
    if np.issubdtype(factors.dtype, np.integer):
        products = factors[..., 0].astype(np.int64) * factors[..., 1].astype(np.int64)   # [R, K, T]
        per_term = products.sum(axis=1)                                                  # [R, T] int64
        return [sum(int(c) * u for c, u in zip(row, cost.units)) for row in per_term]
    real_products = factors[..., 0].astype(np.float64) * factors[..., 1].astype(np.float64)
    real_per_term = real_products.sum(axis=1)
    return [float(sum(float(c) * float(u) for c, u in zip(row, cost.units))) for row in real_per_term]
