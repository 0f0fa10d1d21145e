"""Width scaling: nested sub-models made of the first ``ceil(p C)`` output channels of every layer
(HeteroFL, FjORD's ordered dropout), as static slices or as activation masks.

``WidthLayout`` knows, per layer, which input channels come from which layer (``source``), the
per-channel vectors (bias, BatchNorm) and the residual entries attached to a layer's channels, so it
can cut a sub-model out (``slice`` / ``unslice``), mask the dropped channels (``hooks``), say which
entries a sub-model holds (``held``) and count its exact bits and FLOPs. ``per_entry_mean``: the
server's average of each entry over the clients holding it.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.errors import arg
from fedjax_sparse.core import accounting
from fedjax_sparse.models.base import Hooks, Model

__all__ = ["WidthLayout", "kept_channels", "per_entry_mean"]

_PER_CHANNEL = ("bias", "bn_scale", "bn_bias")   # params holding one value per output channel


def kept_channels(rate, channels: int):
    """ceil(rate * C) clipped to [1, C] (a tiny tolerance so 0.6 * 50 is 30, not 31);
    ``rate`` a Python float (-> int) or a traced scalar (-> int32)."""
    if isinstance(rate, (int, float)):
        return int(min(max(math.ceil(rate * channels - 1e-6), 1), channels))
    k = jnp.ceil(jnp.asarray(rate, jnp.float32) * channels - 1e-4).astype(jnp.int32)
    return jnp.clip(k, 1, channels)


@dataclasses.dataclass(frozen=True)
class WidthLayout:
    """The channel structure of a model, layer after layer.

    ``counts`` ([L] int32: kept output channels of each layer) describes a
    sub-model. Layer l's inputs are the output channels of layer
    ``source[l]`` (-1: the model input, always whole), each repeated
    ``in_per_channel[l]`` times (spatial positions after a flatten).
    ``attached`` lists the model's ``channel_entries`` (a ResNet's
    pre-activation BatchNorms) with the index of the layer whose channels they
    follow; their values are counted in that layer's ``vectors``.

    Residual models work because the kept count depends only on the rate and a
    layer's width: layers whose outputs are summed (a block's second conv, its
    shortcut, the stream) have equal widths, so equal kept prefixes.
    """
    names: tuple[str, ...]
    out_channels: tuple[int, ...]
    scalable: tuple[bool, ...]        # False for the last layer (class outputs kept)
    source: tuple[int, ...]
    in_units: tuple[int, ...]
    in_per_channel: tuple[int, ...]
    kernel_unit: tuple[int, ...]      # kernel entries per (kept input channel, kept output channel)
    flops_unit: tuple[int, ...]       # training FLOPs per example per (input channel, output channel)
    vectors: tuple[int, ...]          # per-output-channel values (bias, BN params, running stats)
    attached: tuple[tuple[str, int], ...] = dataclasses.field(default=(), kw_only=True)   # (entry name, layer index)

    @classmethod
    def from_model(cls, model: Model, variables: dict) -> "WidthLayout":
        index = {layer.name: i for i, layer in enumerate(model.layers)}
        attached = tuple((entry, index[layer]) for entry, layer in model.channel_entries if layer in index)
        extra = sorted(set(variables["params"]) - set(index) - {entry for entry, _ in attached})
        if extra:
            # e.g. a ViT's embeddings and LayerNorms, which follow no layer's output channels
            raise ValueError(f"width scaling (heterofl, fjord) needs every parameter to belong to a weight layer "
                             f"or to be a per-channel entry the model declares (Model.channel_entries); "
                             f"{model.name} also has {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}: "
                             f"choose a {arg('model')} such as cnn7, lenet5_caffe or resnet18_narrow")
        attached_values = [0] * len(model.layers)
        for entry, i in attached:
            for key, value in {**variables["params"][entry], **variables.get("batch_stats", {}).get(entry, {})}.items():
                if value.shape != (model.layers[i].out_units,):
                    raise ValueError(f"{model.name}: {entry}/{key} has shape {value.shape}, not one value per "
                                     f"output channel of {model.layers[i].name} ({model.layers[i].out_units})")
                attached_values[i] += 1
        rows = []   # one per layer: the fields from names to vectors
        for i, layer in enumerate(model.layers):
            s = index[layer.input_layer] if layer.input_layer is not None else -1
            channels_in = layer.in_units if s < 0 else model.layers[s].out_units
            if layer.in_units % channels_in:
                raise ValueError(f"{model.name}: layer {layer.name} has {layer.in_units} inputs, not a multiple "
                                 f"of the {channels_in} channels feeding it; width scaling needs a sequential model")
            p = layer.in_units // channels_in
            groups = channels_in * layer.out_units
            if layer.macs % groups:
                raise ValueError(f"layer {layer.name}: {layer.macs} MACs do not split into {groups} channel pairs")
            params = variables["params"][layer.name]
            stats = variables.get("batch_stats", {}).get(layer.name, {})
            rows.append((layer.name, layer.out_units, i < len(model.layers) - 1, s, layer.in_units, p,
                         int(math.prod(layer.kernel_shape[:-2])) * p, 6 * (layer.macs // groups),
                         sum(k in params for k in _PER_CHANNEL) + len(stats) + attached_values[i]))
        return cls(*map(tuple, zip(*rows)), attached=attached)

    # ---- sub-models
    def counts(self, rate) -> jax.Array:
        """[L] int32 kept output channels at ``rate`` (static or traced)."""
        return jnp.stack([jnp.asarray(kept_channels(rate, c) if s else c, jnp.int32)
                          for c, s in zip(self.out_channels, self.scalable)])

    def static_counts(self, rate: float) -> tuple[int, ...]:
        return tuple(kept_channels(rate, c) if s else c for c, s in zip(self.out_channels, self.scalable))

    def in_counts(self, counts) -> jax.Array:
        """[L] kept input channels (the model input counts as whole)."""
        counts = jnp.asarray(counts)
        return jnp.stack([counts[s] if s >= 0 else jnp.asarray(n, counts.dtype)
                          for s, n in zip(self.source, self.in_units)])

    def out_masks(self, counts) -> dict:
        """{name: [C] float32} 1 for kept output channels."""
        counts = jnp.asarray(counts)
        return {n: (jnp.arange(c) < counts[i]).astype(jnp.float32)
                for i, (n, c) in enumerate(zip(self.names, self.out_channels))}

    def hooks(self, counts) -> Hooks:
        """Hooks zeroing the dropped output channels' activations (traced ``counts`` allowed).

        They also apply to a sliced model (:meth:`slice`) at least as wide as
        ``counts``: its activations have a prefix of the channels."""
        masks = self.out_masks(counts)
        scalable = dict(zip(self.names, self.scalable))
        # an attached entry's output (a pre-activation) carries its layer's channels
        for entry, i in self.attached:
            masks[entry], scalable[entry] = masks[self.names[i]], self.scalable[i]

        def activation(name, h):
            if scalable.get(name, False):
                return h * masks[name][: h.shape[-1]].astype(h.dtype)
            return h
        return Hooks(activation=activation)

    def kept_rows(self, index: int, counts: tuple[int, ...]):
        """Layer ``index``'s kept kernel rows for static ``counts``: a slice when
        they are a prefix, else an int array (a dense layer after a flatten:
        row f belongs to channel ``f % C``)."""
        s = self.source[index]
        if s < 0:
            return slice(None)
        rows = np.flatnonzero(np.arange(self.in_units[index]) % self.out_channels[s] < counts[s])
        if np.array_equal(rows, np.arange(rows.size)):
            return slice(0, int(rows.size))
        return rows

    def _sub_model(self, variables: dict, counts: tuple[int, ...], fn) -> dict:
        """``variables`` with each entry of the ``counts`` sub-model (static) replaced by ``fn(collection,
        entry, key, value, index)``, ``index``: what the sub-model holds of ``value``."""
        params, stats = {}, dict(variables.get("batch_stats", {}))
        entries = [(name, i, self.kept_rows(i, counts)) for i, name in enumerate(self.names)]
        for entry, i, rows in entries + [(entry, i, None) for entry, i in self.attached]:
            k = counts[i]
            params[entry] = {key: fn("params", entry, key, value, (..., rows, slice(k)) if key == "kernel"
                                     and rows is not None else (..., slice(k)))
                             for key, value in variables["params"][entry].items()}
            if entry in stats:
                stats[entry] = {key: fn("batch_stats", entry, key, value, (..., slice(k)))
                                for key, value in stats[entry].items()}
        return {**variables, "params": params, "batch_stats": stats}

    def slice(self, variables: dict, counts: tuple[int, ...]) -> dict:
        """The sub-model itself (static ``counts``): kernels [..., kept rows,
        kept outputs], per-channel vectors [kept outputs]; a model of these
        shapes computes what the full model does under :meth:`hooks`."""
        return self._sub_model(variables, counts, lambda c, e, key, value, index: value[index])

    def unslice(self, variables: dict, sub: dict, counts: tuple[int, ...]) -> dict:
        """``variables`` with the entries of the ``counts`` sub-model replaced by ``sub``'s."""
        return self._sub_model(variables, counts,
                               lambda c, e, key, value, index: value.at[index].set(sub[c][e][key]))

    def predict(self, model: Model, variables: dict, counts: tuple[int, ...], sliced: bool):
        """The ``counts`` sub-model's predict function: the cut-out network
        (``sliced``) or the full one with the dropped channels zeroed."""
        if sliced:
            sub = self.slice(variables, counts)
            return lambda x: model.apply(sub, x, train=False)[0]
        hooks = self.hooks(jnp.asarray(counts))
        return lambda x: model.apply(variables, x, train=False, hooks=hooks)[0]

    def held(self, variables: dict, counts) -> dict:
        """0/1 float masks shaped like ``variables``: the entries the sub-model holds."""
        counts = jnp.asarray(counts)
        outs = self.out_masks(counts)
        ins = self.in_counts(counts)
        params, stats = {}, {}
        for i, name in enumerate(self.names):
            out = outs[name]
            if self.source[i] >= 0:
                channel = jnp.arange(self.in_units[i]) % self.out_channels[self.source[i]]
                inp = (channel < ins[i]).astype(jnp.float32)
            else:
                inp = jnp.ones((self.in_units[i],), jnp.float32)
            layer = {}
            for key, value in variables["params"][name].items():
                if key == "kernel":
                    layer[key] = jnp.broadcast_to(inp[:, None] * out[None, :], value.shape)
                else:
                    layer[key] = jnp.broadcast_to(out, value.shape)
            params[name] = layer
            if name in variables.get("batch_stats", {}):
                stats[name] = {k: jnp.broadcast_to(out, v.shape) for k, v in variables["batch_stats"][name].items()}
        for entry, i in self.attached:
            out = outs[self.names[i]]
            params[entry] = {k: jnp.broadcast_to(out, v.shape) for k, v in variables["params"][entry].items()}
            if entry in variables.get("batch_stats", {}):
                stats[entry] = {k: jnp.broadcast_to(out, v.shape) for k, v in variables["batch_stats"][entry].items()}
        return {**variables, "params": params, "batch_stats": stats}

    # ---- exact costs
    def num_values(self, counts) -> int:
        """Values of the sub-model (host side, static ``counts``)."""
        ins = [counts[s] if s >= 0 else n for s, n in zip(self.source, self.in_units)]
        return int(sum(u * i * c + v * c for u, i, c, v in zip(self.kernel_unit, ins, counts, self.vectors)))

    def bits(self, counts) -> accounting.Cost:
        """Exact 32-bit size of the sub-model with (traced) ``counts``."""
        counts = jnp.asarray(counts, jnp.int32)
        units = [accounting.FLOAT_BITS * u for u in self.kernel_unit + self.vectors]
        a = jnp.concatenate([self.in_counts(counts), counts])
        b = jnp.concatenate([counts, jnp.ones_like(counts)])
        return accounting.Cost.terms(units, a, b)

    def fraction(self, counts) -> jax.Array:
        """[] float32 fraction of the full model's values the sub-model holds."""
        counts = jnp.asarray(counts, jnp.float32)
        ins = self.in_counts(counts)
        ku, v = jnp.asarray(self.kernel_unit, jnp.float32), jnp.asarray(self.vectors, jnp.float32)
        full = self.num_values(self.out_channels)
        return ((ku * ins * counts).sum() + (v * counts).sum()) / full

    def pair_counts(self, counts) -> jax.Array:
        """[L] int32 kept (input channel, output channel) pairs of each layer."""
        counts = jnp.asarray(counts, jnp.int32)
        return self.in_counts(counts) * counts

    def training_flops(self, counts, num_examples) -> accounting.Cost:
        """Exact training FLOPs of ``num_examples`` examples through the sub-model."""
        return accounting.Cost.terms(self.flops_unit, self.pair_counts(counts), num_examples)


def per_entry_mean(old, stacked, held, weights: jax.Array):
    """Each entry's weighted mean over the clients holding it; entries no
    client held keep ``old``. stacked / held leaves [K, ...], weights [K]."""
    def mean(o, x, h):
        w = weights.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype) * h
        den = w.sum(0)
        return jnp.where(den > 0, (w * x).sum(0) / jnp.where(den > 0, den, 1.0), o)
    return jax.tree_util.tree_map(mean, old, stacked, held)
