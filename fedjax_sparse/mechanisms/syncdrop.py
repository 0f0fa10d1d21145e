"""Channel dropout with per-client keep probabilities (FedDrop's SyncDrop) and
the FLOPs model of the resulting sparse networks (docs/feddrop.md, "FedDrop round").

SyncDrop (eq. 3): channel n of client c is kept iff ``u^n < p_c^n`` and scaled by ``1 / p_c^n``; the
uniforms ``u`` come from the round's shared key (``channel_uniforms``), so clients drop *correlated*
channel sets without communicating: ``E[d_i d_j] = min(p_i, p_j)`` (eq. 4). A client's keep
probabilities are one flat vector ``[num_channels]`` laid out layer after layer by a
:class:`ChannelLayout`, the shape the server optimises and stores (``[N, num_channels]``). FLOPs:
:class:`SparseFlopsModel` (App. B, eq. 9-10).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.models.base import Hooks, Model


# ---------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class ChannelLayout:
    """Which layers carry a dropout layer, and their channel counts, in order.

    A flat keep-probability vector ``[total]`` holds layer ``names[g]`` at
    ``[offsets[g], offsets[g] + sizes[g])``.
    """
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def from_model(cls, model: Model, kinds: Sequence[str] = ("conv",)) -> "ChannelLayout":
        """Every layer of the given kinds (default: convs, as in the paper)."""
        layers = [layer for layer in model.layers if layer.kind in kinds]
        return cls(tuple(l.name for l in layers), tuple(int(l.out_units) for l in layers))

    @property
    def total(self) -> int:
        return int(sum(self.sizes))

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.sizes[:-1]))

    def split(self, flat: jax.Array) -> dict[str, jax.Array]:
        """[..., total] -> {name: [..., size]}."""
        return {name: flat[..., o:o + s] for name, o, s in zip(self.names, self.offsets, self.sizes)}

    def layer_means(self, flat: jax.Array) -> jax.Array:
        """[..., total] -> [..., num_layers]: the mean over each layer's channels."""
        return jnp.stack([x.mean(-1) for x in self.split(flat).values()], axis=-1)


# ---------------------------------------------------------------- SyncDrop
def channel_uniforms(key: jax.Array, step: jax.Array, layout: ChannelLayout) -> jax.Array:
    """[total] U(0,1) draws for one local step: layer g's block comes from
    ``fold_in(fold_in(key, step), g)``. With the round's shared key every
    client gets the same numbers for the same step and layer."""
    step_key = jax.random.fold_in(key, step)
    return jnp.concatenate([jax.random.uniform(jax.random.fold_in(step_key, g), (size,))
                            for g, size in enumerate(layout.sizes)])


def keep_mask(uniforms: jax.Array, keep_probs: jax.Array) -> jax.Array:
    """d = 1[u < p] as float32 (eq. 3): p = 1 always keeps, p = 0 never."""
    return (uniforms < keep_probs).astype(jnp.float32)


def dropout_scale(mask: jax.Array, keep_probs: jax.Array, rescale: bool = True) -> jax.Array:
    """Per-channel multiplier d / p (inverted dropout), or d without rescaling."""
    if not rescale:
        return mask
    return jnp.where(mask > 0, 1.0 / jnp.maximum(keep_probs, 1e-12), 0.0)


def syncdrop(h: jax.Array, keep_probs: jax.Array, uniforms: jax.Array, rescale: bool = True) -> jax.Array:
    """Eq. (3) on one activation, channels last: h [..., C], p [C], u [C]."""
    return h * dropout_scale(keep_mask(uniforms, keep_probs), keep_probs, rescale)


def channel_scale_hooks(layout: ChannelLayout, scales: jax.Array) -> Hooks:
    """Hooks multiplying each layout layer's output channels by ``scales``
    ([total]); other layers pass through. ``scales`` may be a tracer."""
    per_layer = layout.split(scales)

    def activation(name, h):
        if name in per_layer:
            return h * per_layer[name].astype(h.dtype)
        return h
    return Hooks(activation=activation)


# ---------------------------------------------------------------- FLOPs
@dataclasses.dataclass(frozen=True)
class SparseFlopsModel:
    """Forward FLOPs per example of a model with channel dropout (eq. 10).

    For weight layer l: ``dense_flops[l] * m_out * m_in + act_flops[l] * m_out``
    where ``m`` is the mean keep probability (or kept fraction, for a drawn
    mask) of the layer's output channels / of its input layer's channels, and
    1 for layers without dropout. ``dense_flops = 2 * MACs`` (the project's
    accounting convention); ``act_flops`` is eq. 9's ReLU term (2 per output
    element), zero unless ``count_activations``.
    """
    layout: ChannelLayout
    dense_flops: tuple[float, ...]
    act_flops: tuple[float, ...]
    out_group: tuple[int, ...]  # layout group of the layer's outputs, -1 if not dropped
    in_group: tuple[int, ...]   # layout group of the layer's inputs, -1 if dense input

    @classmethod
    def build(cls, model: Model, layout: ChannelLayout, *, input_sparsity_in_dense: bool = True,
              count_activations: bool = False) -> "SparseFlopsModel":
        """``input_sparsity_in_dense``: a dense layer fed by dropped conv channels
        costs less too (eq. 10); False treats dense layers as fixed cost (the
        reference code's model)."""
        # A layer fed by the model input (input_layer None) or by a layer without dropout: group -1.
        groups: dict[str | None, int] = {name: g for g, name in enumerate(layout.names)}
        rows = [(2.0 * layer.macs, 2.0 * layer.macs / layer.fan_in if count_activations else 0.0,
                 groups.get(layer.name, -1),
                 -1 if layer.kind == "dense" and not input_sparsity_in_dense else groups.get(layer.input_layer, -1))
                for layer in model.layers]
        return cls(layout, *map(tuple, zip(*rows)))

    @property
    def dense_total(self) -> float:
        """Forward FLOPs per example with nothing dropped."""
        return float(sum(self.dense_flops) + sum(self.act_flops))

    def _terms(self, layer_means: jax.Array):
        """layer_means [..., G] -> (m_out, m_in) each [..., L]."""
        ones = jnp.ones(layer_means.shape[:-1] + (1,), layer_means.dtype)
        ext = jnp.concatenate([layer_means, ones], axis=-1)  # index -1 -> 1
        return ext[..., jnp.array(self.out_group)], ext[..., jnp.array(self.in_group)]

    def forward_from_means(self, layer_means: jax.Array) -> jax.Array:
        m_out, m_in = self._terms(layer_means)
        dense = jnp.asarray(self.dense_flops, jnp.float32)
        act = jnp.asarray(self.act_flops, jnp.float32)
        return (dense * m_out * m_in + act * m_out).sum(-1)

    def forward(self, keep_probs: jax.Array) -> jax.Array:
        """Expected forward FLOPs per example: keep_probs [..., total] -> [...]."""
        return self.forward_from_means(self.layout.layer_means(keep_probs))

    def forward_of_mask(self, mask: jax.Array) -> jax.Array:
        """Forward FLOPs per example of one drawn 0/1 mask [..., total]."""
        return self.forward_from_means(self.layout.layer_means(mask))

    def ratio(self, keep_probs: jax.Array) -> jax.Array:
        """flops(f_hat, p) / flops(f): [..., total] -> [...]."""
        return self.forward(keep_probs) / self.dense_total

    def budget_slack(self, keep_probs: jax.Array, budget: float) -> jax.Array:
        """g(p) of eq. (5): r - mean over clients of the FLOPs ratio; p [K, total]."""
        return budget - self.ratio(keep_probs).mean()

    def scaling_coefficients(self, keep_probs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(a, b, c) with mean_k ratio(s * p_k) = a s^2 + b s + c for a scalar s."""
        m_out, m_in = self._terms(self.layout.layer_means(keep_probs))
        dense = jnp.asarray(self.dense_flops, jnp.float32)
        act = jnp.asarray(self.act_flops, jnp.float32)
        has_out = jnp.array([g >= 0 for g in self.out_group])
        has_in = jnp.array([g >= 0 for g in self.in_group])
        both = (dense * m_out * m_in * (has_out & has_in)).sum(-1)
        one = (dense * m_out * m_in * (has_out ^ has_in)).sum(-1) + (act * m_out * has_out).sum(-1)
        none = (dense * m_out * m_in * ~(has_out | has_in)).sum(-1) + (act * ~has_out).sum(-1)
        d = self.dense_total
        return both.mean() / d, one.mean() / d, none.mean() / d

    def uniform_keep_prob(self, budget: float) -> float:
        """The constant p with ratio(p * 1) = budget (Sec. 3.5: g(p) = 0), from the
        quadratic a p^2 + b p + c = r. Raises if the budget cannot be met."""
        a, b, c = (float(v) for v in self.scaling_coefficients(jnp.ones((1, self.layout.total))))
        if budget >= 1.0:
            return 1.0
        if budget <= c + 1e-12:
            raise ValueError(f"FLOPs budget r={budget} is unattainable: the layers without dropout "
                             f"alone cost {c:.4f} of the dense model; use r > {c:.4f}")
        return float(solve_scaling(a, b, c, budget))


def solve_scaling(a, b, c, target):
    """Positive root s of a s^2 + b s + c = target (a, b >= 0, not both 0)."""
    a, b, c = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), jnp.asarray(c, jnp.float32)
    rhs = target - c
    # Citardauq form: stable for a -> 0 (linear case).
    return 2.0 * rhs / (b + jnp.sqrt(jnp.maximum(b * b + 4.0 * a * rhs, 0.0)) + 1e-30)


# ---------------------------------------------------------------- initialisation
INIT_SCHEMES = ("paper", "reference", "model")


def dropout_aware_init(key: jax.Array, variables: dict, model: Model, layout: ChannelLayout,
                       keep_prob: float, scheme: str = "paper") -> dict:
    """Modified He initialisation for layers under dropout (Thm. 1): weight
    variance ``2 p / fan_in``.

    * ``"paper"``: N(0, 2p/fan_in) on the kernels of the layers followed by a
      dropout layer (the layout's layers);
    * ``"reference"``: U(+-sqrt(6 p / fan_in)) (same variance) on those and on
      the first dense layer, as in the authors' code;
    * ``"model"``: the model's own initialisation (ablation).
    Biases keep the model's initialisation.
    """
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"unknown init scheme {scheme!r}; valid: {INIT_SCHEMES}")
    if scheme == "model":
        return variables
    targets = set(layout.names)
    if scheme == "reference":   # and the first dense layer, if any
        targets.update([l.name for l in model.layers if l.kind == "dense"][:1])
    params = dict(variables["params"])
    for i, layer in enumerate(model.layers):
        if layer.name not in targets:
            continue
        k = jax.random.fold_in(key, i)
        shape, fan_in = layer.kernel_shape, layer.fan_in
        if scheme == "paper":
            kernel = jax.random.normal(k, shape, jnp.float32) * math.sqrt(2.0 * keep_prob / fan_in)
        else:
            bound = math.sqrt(6.0 * keep_prob / fan_in)
            kernel = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
        params[layer.name] = {**params[layer.name], "kernel": kernel}
    return {**variables, "params": params}


__all__ = ["ChannelLayout", "INIT_SCHEMES", "SparseFlopsModel", "channel_scale_hooks", "channel_uniforms",
           "dropout_aware_init", "dropout_scale", "keep_mask", "solve_scaling", "syncdrop"]
