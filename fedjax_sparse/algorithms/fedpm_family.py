"""FedPM (Isik et al., ICLR 2023): federated probabilistic masks over frozen
random weights.

Clients train Bernoulli mask logits over the seed's frozen ``+-weight_scale / sqrt(fan_in)`` kernels
and upload one mask sample (1 bit per weight); the server's p is the Beta posterior of the samples.
The reference code's choices and the costs: docs/baselines.md, "FedPM".
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics, tree_weighted_mean
from fedjax_sparse.algorithms.fedavg_family import whole_state
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.models.base import Hooks, Model
from fedjax_sparse.core.training import masked_cross_entropy, model_rng, run_local_epochs

ESTIMATORS = ("mode", "mean")
EVAL_MASKS = ("sample", "threshold")


# ---------------------------------------------------------------- mechanisms
def signed_constant_kernels(key: jax.Array, model: Model, variables: dict, scale: float = math.e) -> dict:
    """``variables`` with every kernel replaced by +-scale/sqrt(fan_in) (random signs)."""
    params = dict(variables["params"])
    for i, layer in enumerate(model.layers):
        c = scale / math.sqrt(layer.fan_in)
        signs = jax.random.rademacher(jax.random.fold_in(key, i), layer.kernel_shape, jnp.float32)
        params[layer.name] = {**params[layer.name], "kernel": c * signs}
    return {**variables, "params": params}


def bernoulli_st(key: jax.Array, logits: jax.Array) -> jax.Array:
    """m ~ Bernoulli(sigmoid(logits)) forward, straight-through to sigmoid(logits) backward."""
    prob = jax.nn.sigmoid(logits)
    sample = jax.random.bernoulli(key, prob).astype(prob.dtype)
    return prob + jax.lax.stop_gradient(sample - prob)


def sample_masks(key: jax.Array, probs: dict) -> dict:
    """One Bernoulli(p) sample per entry, {name: bool array}."""
    return {name: jax.random.bernoulli(jax.random.fold_in(key, i), p)
            for i, (name, p) in enumerate(sorted(probs.items()))}


def posterior_probs(samples: dict, *, estimator: str = "mode", epsilon: float = 0.01) -> dict:
    """The server's p from the K clients' mask samples ({name: [K, ...] 0/1}) under a
    fresh Beta(1, 1) prior: "mode" (reference code: bits smoothed to eps / 1 - eps,
    p = (alpha - 1) / (alpha + beta - 2) = their mean) or "mean" ((sum + 1) / (K + 2))."""
    def one(m):
        m = m.astype(jnp.float32)
        k = m.shape[0]
        if estimator == "mode":
            return (epsilon + (1.0 - 2.0 * epsilon) * m).sum(0) / k
        return (m.sum(0) + 1.0) / (k + 2.0)
    return {name: one(m) for name, m in samples.items()}


def mask_hooks(weights: dict, masks: dict) -> Hooks:
    """Hooks using kernel ``weights[name] * masks[name]`` (the model's own kernel is ignored)."""
    def kernel(name, k):
        return weights[name] * masks[name] if name in masks else k
    return Hooks(kernel=kernel)


# ---------------------------------------------------------------- the algorithm
@dataclasses.dataclass(frozen=True)
class FedPMOptions:
    weight_scale: float = math.e   # frozen weights +-weight_scale / sqrt(fan_in) (reference: e)
    estimator: str = "mode"        # mode (reference: mean of eps-smoothed bits) | mean ((sum+1)/(K+2))
    epsilon: float = 0.01          # the reference's smoothing of the uploaded bits ("mode")
    eval_mask: str = "sample"      # sample (reference: one mask drawn from p) | threshold (p > 0.5)


class FedPMServerState(NamedTuple):
    batch_stats: dict   # averaged BatchNorm running statistics (empty without BatchNorm)
    eval_key: jax.Array  # the evaluation mask's key, advanced every round
    probs: dict         # {layer: p, shaped like the kernel}
    weights: dict       # frozen params (kernels +-c; biases, BatchNorm as initialised)


class FedPMMessage(NamedTuple):
    batch_stats: dict
    mask: dict          # {layer: bool, one Bernoulli(sigmoid(s)) sample}


@register_algorithm("fedpm", FedPMOptions, unwrappable="its clients send binary masks (booleans), not float "
                    "updates, which the server counts into a Beta posterior",
                    description="FedPM: Bayesian supermasks of a frozen random network",
                    paper="Isik et al., ICLR 2023; SpaFL's Table 2")
def fedpm(task: Task, *, weight_scale: float, estimator: str, epsilon: float, eval_mask: str) -> Algorithm:
    for option, value, valid in (("estimator", estimator, ESTIMATORS), ("eval_mask", eval_mask, EVAL_MASKS)):
        if value not in valid:
            raise ValueError(f"fedpm: unknown {option} {value!r}; valid: {', '.join(valid)}")
    if not 0.0 <= epsilon < 0.5:
        raise ValueError(f"fedpm: epsilon must be in [0, 0.5), got {epsilon}")
    model = task.model
    names = [layer.name for layer in model.layers]
    num_mask = sum(layer.num_weights for layer in model.layers)
    stats_bits = accounting.tree_bits(model.init(jax.random.PRNGKey(0)).get("batch_stats", {}))
    optimizer = optax.adam(task.lr)

    def kernels(params):
        return {n: params[n]["kernel"] for n in names}

    def init(key):
        k_model, k_weights, k_probs, k_eval = jax.random.split(key, 4)
        variables = model.init(k_model)
        frozen = signed_constant_kernels(k_weights, model, variables, weight_scale)
        probs = {n: jax.nn.sigmoid(jax.random.normal(jax.random.fold_in(k_probs, i), model.layers[i].kernel_shape))
                 for i, n in enumerate(names)}
        return FedPMServerState(variables.get("batch_stats", {}), k_eval, probs, frozen["params"]), ()

    def client_update(server: FedPMServerState, client_state, data, ctx):
        weights = kernels(server.weights)
        logits0 = {n: jax.scipy.special.logit(jnp.clip(p, 1e-6, 1 - 1e-6)) for n, p in server.probs.items()}

        def loss_fn(logits, stats, batch, key):
            masks = {n: bernoulli_st(jax.random.fold_in(key, i), logits[n]) for i, n in enumerate(names)}
            out, new_stats = model.apply({"params": server.weights, "batch_stats": stats}, batch.x, train=True,
                                         hooks=mask_hooks(weights, masks), sample_mask=batch.mask,
                                         rng=model_rng(key))
            return masked_cross_entropy(out, batch.y, batch.mask), new_stats

        def step(carry, batch, step_index, num_steps, step_key):
            logits, stats, opt_state = carry
            (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(logits, stats, batch, step_key)
            updates, opt_state = optimizer.update(grads, opt_state, logits)
            return (optax.apply_updates(logits, updates), new_stats, opt_state), loss

        train_key, upload_key = jax.random.split(ctx.key)
        (logits, stats, _), local = run_local_epochs(
            step, (logits0, server.batch_stats, optimizer.init(logits0)), data, train_key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess)
        probs = {n: jax.nn.sigmoid(s) for n, s in logits.items()}
        mask = sample_masks(upload_key, probs)
        density = sum(p.sum() for p in probs.values()) / num_mask
        metrics = client_metrics(
            loss=local.loss, flops=accounting.training_flops(model, local.num_examples),
            uplink_bits=num_mask + stats_bits, downlink_bits=accounting.FLOAT_BITS * num_mask + stats_bits,
            density=density, num_examples=local.num_examples,
            upload_ones=sum(m.sum() for m in mask.values()) / num_mask)
        return client_state, FedPMMessage(stats, mask), metrics

    def server_update(server: FedPMServerState, messages: FedPMMessage, ctx):
        probs = posterior_probs(messages.mask, estimator=estimator, epsilon=epsilon)
        stats = tree_weighted_mean(messages.batch_stats, jnp.ones_like(ctx.weights))
        new = FedPMServerState(stats, jax.random.fold_in(server.eval_key, ctx.round), probs, server.weights)
        return new, {"mean_p": sum(p.sum() for p in probs.values()) / num_mask}

    def global_predict(server: FedPMServerState, x):
        if eval_mask == "sample":
            masks = {n: m.astype(jnp.float32) for n, m in sample_masks(server.eval_key, server.probs).items()}
        else:
            masks = {n: (p > 0.5).astype(jnp.float32) for n, p in server.probs.items()}
        out, _ = model.apply({"params": server.weights, "batch_stats": server.batch_stats}, x, train=False,
                             hooks=mask_hooks(kernels(server.weights), masks))
        return out

    return Algorithm("fedpm", init, whole_state, client_update, server_update, global_predict=global_predict,
                     hparams=dict(optimizer="adam", weight_scale=weight_scale, estimator=estimator,
                                  eval_mask=eval_mask))
