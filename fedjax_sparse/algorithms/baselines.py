"""FedDrop's baselines on the round engine: FedProx (Li et al. 2020), SCAFFOLD
(Karimireddy et al. 2020, Alg. 1, options I and II) and the federated dropout of Caldas et al. 2018
(each client trains a random sub-model; the server averages each weight over the clients holding it).
FedAvg itself is in fedavg_family.py. Details: docs/feddrop.md, "Options".
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.errors import arg
from fedjax_sparse.core import accounting
from fedjax_sparse.algorithms.fedavg_family import (FedAvgServerState, client_mean, dense_client_update,
                                                    global_model_predict, model_server, whole_state)
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics, mean_weights, replicate, tree_weighted_mean
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import local_train, sgd
from fedjax_sparse.models.base import Hooks, Model, check_layer_kinds
from fedjax_sparse.core.training import masked_cross_entropy, model_rng, run_local_epochs


# Field order is the checkpoints' leaf order (docs/design.md, "Algorithm states"): never reorder.
# FedProx's server state is FedAvg's (fedavg.FedAvgServerState); its clients keep nothing.


class ScaffoldServerState(NamedTuple):
    """SCAFFOLD's server state (also its broadcast)."""
    control: dict     # the server control variate c, shaped like variables["params"]
    variables: dict   # the global model x {"params": ..., "batch_stats": ...}


class ScaffoldClientState(NamedTuple):
    """SCAFFOLD's client state; leaves have a leading client axis [N, ...]."""
    control: dict     # the client control variates c_i, [N, ...] leaves shaped like params


class CaldasServerState(NamedTuple):
    """Federated dropout (Caldas et al.)'s server state (also its broadcast); clients keep nothing."""
    mask_key: jax.Array   # PRNG key the sub-model masks are derived from (folded with round, client)
    variables: dict       # the global model {"params": ..., "batch_stats": ...}


def tree_sq_distance(a, b) -> jax.Array:
    return optax.tree.norm(optax.tree.sub(a, b), squared=True)


# ---------------------------------------------------------------- FedProx
FEDPROX_OPTIONS = dict(mu=0.01, weighted=True)


@register_algorithm("fedprox", FEDPROX_OPTIONS, description="FedAvg with a proximal term mu/2 |w - w_server|^2",
                    paper="Li et al., MLSys 2020")
def fedprox(task: Task, *, mu, weighted) -> Algorithm:
    model = task.model
    optimizer = sgd(task.lr)

    init, broadcast = model_server(model)

    def proximal_term(variables):
        anchor = jax.lax.stop_gradient(variables["params"])
        return lambda params: 0.5 * mu * tree_sq_distance(params, anchor)

    client_update = dense_client_update(task, optimizer, extra_loss_for=proximal_term)

    def server_update(server_state, messages, ctx):   # an empty Poisson round keeps the model
        return FedAvgServerState(client_mean(messages, ctx, weighted, server_state.variables)), {}

    return Algorithm("fedprox", init, broadcast, client_update, server_update,
                     global_predict=global_model_predict(model), varying_cohort=True)


# ---------------------------------------------------------------- SCAFFOLD
SCAFFOLD_OPTIONS = dict(variant="II", server_lr=1.0, weighted=True)


def full_local_gradient(model: Model, params: dict, stats: dict, data, *, batch_size: int, preprocess):
    """grad f_i(params): the mean cross-entropy gradient over all of the client's
    samples (one unshuffled pass, exact for partial batches)."""
    def step(grad_sum, batch, step_index, num_steps, key):
        def loss_fn(p):
            logits, _ = model.apply({"params": p, "batch_stats": stats}, batch.x, train=True,
                                    sample_mask=batch.mask, rng=model_rng(key))
            return masked_cross_entropy(logits, batch.y, batch.mask)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        n = batch.mask.sum()
        return jax.tree_util.tree_map(lambda s, g: s + n * g, grad_sum, grads), loss

    grad_sum, local = run_local_epochs(step, optax.tree.zeros_like(params), data, jax.random.PRNGKey(0), epochs=1,
                                       batch_size=batch_size, preprocess=preprocess, shuffle=False)
    count = jnp.maximum(data.count, 1).astype(jnp.float32)
    return jax.tree_util.tree_map(lambda s: s / count, grad_sum), local


@register_algorithm("scaffold", SCAFFOLD_OPTIONS, description="SCAFFOLD: control variates against client drift",
                    paper="Karimireddy et al., ICML 2020")
def scaffold(task: Task, *, variant, server_lr, weighted) -> Algorithm:
    if variant not in ("I", "II"):
        raise ValueError(f"scaffold: variant must be 'I' or 'II', got {variant!r}")
    model = task.model
    optimizer = sgd(task.lr)

    def init(key):
        variables = model.init(key)
        control = optax.tree.zeros_like(variables["params"])
        return (ScaffoldServerState(control=control, variables=variables),
                ScaffoldClientState(control=replicate(control, task.num_clients)))

    def client_update(payload: ScaffoldServerState, client_state: ScaffoldClientState, data, ctx):
        variables, c_server = payload.variables, payload.control
        c_client = client_state.control
        correction = jax.tree_util.tree_map(lambda ci, c: c - ci, c_client, c_server)
        new_vars, _, stats = local_train(
            model, optimizer, variables, optimizer.init(variables["params"]), data, ctx.key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess,
            grad_transform=lambda grads: jax.tree_util.tree_map(jnp.add, grads, correction))
        x, y = variables["params"], new_vars["params"]
        flops = accounting.training_flops(model, stats.num_examples)
        if variant == "I":
            c_new, _ = full_local_gradient(model, x, variables.get("batch_stats", {}), data,
                                           batch_size=task.batch_size, preprocess=task.preprocess)
            flops = flops + accounting.training_flops(model, data.count)
        else:
            scale = 1.0 / (jnp.maximum(stats.num_steps, 1).astype(jnp.float32) * task.lr)
            c_new = jax.tree_util.tree_map(lambda ci, c, xx, yy: ci - c + scale * (xx - yy),
                                           c_client, c_server, x, y)
        delta_c = jax.tree_util.tree_map(jnp.subtract, c_new, c_client)
        model_bits = accounting.tree_bits(variables)
        control_bits = accounting.tree_bits(c_server)
        metrics = client_metrics(
            loss=stats.loss, flops=flops, uplink_bits=model_bits + control_bits,
            downlink_bits=model_bits + control_bits, density=1.0, num_examples=stats.num_examples)
        return ScaffoldClientState(control=c_new), {"variables": new_vars, "delta_control": delta_c}, metrics

    def server_update(server_state: ScaffoldServerState, messages, ctx):
        weights = mean_weights(ctx, weighted)
        mean = tree_weighted_mean(messages["variables"], weights)
        new = jax.tree_util.tree_map(lambda o, m: o + server_lr * (m - o), server_state.variables, mean)
        control = jax.tree_util.tree_map(lambda c, dc: c + dc.sum(0) / task.num_clients,
                                         server_state.control, messages["delta_control"])
        return ScaffoldServerState(control=control, variables=new), {}

    return Algorithm("scaffold", init, whole_state, client_update, server_update,
                     global_predict=global_model_predict(model))


# ---------------------------------------------------------------- Caldas et al.
CALDAS_OPTIONS = dict(keep=0.75, drop_dense=True, per_client=False, rescale=False, weighted=True)


def droppable_layers(model: Model, drop_dense: bool) -> list[str]:
    """Hidden layers whose units federated dropout may remove (never the logits)."""
    last = model.layers[-1].name
    return [l.name for l in model.layers
            if l.name != last and (l.kind == "conv" or (drop_dense and l.kind == "dense"))]


def sample_unit_masks(key: jax.Array, model: Model, layers: list[str], keep: float) -> dict:
    """{layer: [out_units] 0/1}: exactly max(1, round(keep * C)) units kept,
    uniformly at random, independently per layer."""
    masks = {}
    for g, name in enumerate(layers):
        size = model.layer(name).out_units
        kept = max(1, int(round(keep * size)))
        rank = jnp.argsort(jnp.argsort(jax.random.uniform(jax.random.fold_in(key, g), (size,))))
        masks[name] = (rank < kept).astype(jnp.float32)
    return masks


def weight_inclusion(model: Model, unit_masks: dict) -> dict:
    """{layer: {"kernel": 0/1 like the kernel, "bias": [out]}} of a sub-model:
    a weight is in it iff its input and output units are. A dense layer fed by
    a flattened conv map sees each channel H*W times (NHWC: channel fastest)."""
    out = {}
    for layer in model.layers:
        ones_out = jnp.ones((layer.out_units,), jnp.float32)
        m_out = unit_masks.get(layer.name, ones_out)
        m_in = jnp.ones((layer.in_units,), jnp.float32)
        if layer.input_layer in unit_masks:
            src = unit_masks[layer.input_layer]
            m_in = jnp.tile(src, layer.in_units // src.shape[0])
        kernel = m_in[:, None] * m_out[None, :]
        out[layer.name] = {"kernel": jnp.broadcast_to(kernel, layer.kernel_shape), "bias": m_out}
    return out


def _inclusion_like(params: dict, inclusion: dict, channel_entries=()) -> dict:
    """The inclusion masks as a tree shaped like ``params``: BN params follow the bias, a per-channel
    entry of a layer (``Model.channel_entries``: a Flax model's BatchNorm) its layer's output
    channels, and any other entry (a LayerNorm, an embedding) is always included."""
    follows = dict(channel_entries)

    def entry(name, key, value):
        layer = name if name in inclusion else follows.get(name)
        if layer is None:
            return jnp.ones(value.shape, jnp.float32)
        return inclusion[layer]["kernel" if key == "kernel" and layer == name else "bias"]
    return {name: {key: entry(name, key, value) for key, value in p.items()} for name, p in params.items()}


@register_algorithm("caldas", CALDAS_OPTIONS, description="federated dropout: each client trains a random sub-model",
                    paper="Caldas et al. 2018, \"Expanding the reach of federated learning\"")
def caldas(task: Task, *, keep, drop_dense, per_client, rescale, weighted) -> Algorithm:
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"caldas: keep must be in (0, 1], got {keep}")
    model = task.model
    check_layer_kinds(model, "caldas", ("dense", "conv"), "drops hidden units of dense/conv layers", other_macs=False,
                      grouped=False)
    if not model.sequential:
        # weight_inclusion reads a layer's kept inputs from its input_layer, which a residual stream breaks
        raise ValueError(f"caldas: model {model.name} is not sequential (residual or attention); federated "
                         f"dropout needs a sequential {arg('model')} such as cnn7 or lenet5_caffe")
    layers = droppable_layers(model, drop_dense)
    model.check_unit_drops("caldas", layers, "drops the units of its hidden layers")
    optimizer = sgd(task.lr)

    def init(key):
        key_model, key_masks = jax.random.split(key)
        return CaldasServerState(mask_key=key_masks, variables=model.init(key_model)), ()

    def masks_for(mask_key, round_index, client_id):
        key = jax.random.fold_in(mask_key, round_index)
        if per_client:
            key = jax.random.fold_in(key, client_id)
        return sample_unit_masks(key, model, layers, keep)

    def client_update(payload: CaldasServerState, client_state, data, ctx):
        variables = payload.variables
        masks = masks_for(payload.mask_key, ctx.round, ctx.client_id)
        factor = 1.0 / keep if rescale else 1.0

        def activation(name, h):
            return h * (masks[name] * factor) if name in masks else h
        new_vars, _, stats = local_train(
            model, optimizer, variables, optimizer.init(variables["params"]), data, ctx.key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess,
            hooks=Hooks(activation=activation))
        inclusion = weight_inclusion(model, masks)
        included = _inclusion_like(variables["params"], inclusion, model.channel_entries)
        sub_values = sum(x.sum().astype(jnp.int32) for x in jax.tree_util.tree_leaves(included))
        bits = accounting.Cost.term(accounting.FLOAT_BITS, sub_values)
        # Exact: every kept weight costs its layer's per-weight FLOPs for every example.
        kept_weights = jnp.stack([inclusion[l.name]["kernel"].sum().astype(jnp.int32) for l in model.layers])
        flops = accounting.Cost.terms(accounting.weight_training_flops(model), kept_weights, stats.num_examples)
        metrics = client_metrics(
            loss=stats.loss, flops=flops, uplink_bits=bits, downlink_bits=bits,
            density=sub_values / accounting.num_values(variables["params"]), num_examples=stats.num_examples)
        return client_state, new_vars, metrics

    def server_update(server_state: CaldasServerState, messages, ctx):
        weights = mean_weights(ctx, weighted)
        old = server_state.variables
        masks = jax.vmap(lambda cid: masks_for(server_state.mask_key, ctx.round, cid))(ctx.client_ids)
        inclusion = jax.vmap(lambda m: _inclusion_like(old["params"], weight_inclusion(model, m),
                                                       model.channel_entries))(masks)

        def combine(o, new, held):
            w = weights.reshape((-1,) + (1,) * o.ndim) * held
            total = w.sum(0)
            return jnp.where(total > 0, (w * new).sum(0) / jnp.maximum(total, 1e-12), o)
        params = jax.tree_util.tree_map(combine, old["params"], messages["params"], inclusion)
        # Statistics without a per-unit owner (BN running stats) are averaged like FedAvg.
        stats = tree_weighted_mean(messages["batch_stats"], weights)
        return CaldasServerState(mask_key=server_state.mask_key,
                                 variables={"params": params, "batch_stats": stats}), {}

    return Algorithm("caldas", init, whole_state, client_update, server_update,
                     global_predict=global_model_predict(model))


__all__ = ["CALDAS_OPTIONS", "FEDPROX_OPTIONS", "SCAFFOLD_OPTIONS", "CaldasServerState", "ScaffoldClientState",
           "ScaffoldServerState", "caldas", "droppable_layers", "fedprox",
           "full_local_gradient", "sample_unit_masks", "scaffold", "tree_sq_distance", "weight_inclusion"]
