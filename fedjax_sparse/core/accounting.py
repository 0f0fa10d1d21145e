"""Cost accounting: training FLOPs and communication bits, exactly (docs/design.md, "Cost accounting").

A multiply-accumulate is 2 FLOPs, one training example 3 x forward, a layer whose kept fraction is d costs
d x its dense FLOPs; communication counts 32-bit floats unless an algorithm says otherwise. A client
reports a :class:`Cost` (terms ``unit * a * b``: a static Python-number ``unit``, small int32 counts traced
on the device), which the host multiplies and sums as Python ints (:func:`cost_per_round`); only
expectations (FedDrop's FLOPs under keep probabilities) use float factors, summed in float64.
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


def _training_flops_per(model: Model, units: str, refusal: str) -> tuple[int, ...]:
    """[L] 6 x MACs / ``getattr(layer, units)`` of each layer, exactly (``refusal``: the error's end)."""
    for layer in model.layers:
        if layer.macs % getattr(layer, units):
            raise ValueError(f"layer {layer.name}: {layer.macs} MACs " + refusal.format(getattr(layer, units)))
    return tuple(6 * (layer.macs // getattr(layer, units)) for layer in model.layers)


def row_training_flops(model: Model) -> tuple[int, ...]:
    """[L] exact training FLOPs of one example through one output row (neuron /
    filter) of each layer: 3 x 2 x MACs / out_units (an integer: a row's MACs
    are its fan-in times the output positions)."""
    return _training_flops_per(model, "out_units", "do not split into {} rows")


def weight_training_flops(model: Model) -> tuple[int, ...]:
    """[L] exact training FLOPs of one example through one weight of each layer:
    3 x 2 x (output positions) = 6 x MACs / num_weights."""
    return _training_flops_per(model, "num_weights", "are not a multiple of its {} weights")


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
    exact = np.issubdtype(factors.dtype, np.integer)
    wide = factors.astype(np.int64 if exact else np.float64)
    per_term = (wide[..., 0] * wide[..., 1]).sum(axis=1)                                   # [R, T]
    if exact:
        return [sum(int(c) * u for c, u in zip(row, cost.units)) for row in per_term]
    return [float(sum(float(c) * float(u) for c, u in zip(row, cost.units))) for row in per_term]
