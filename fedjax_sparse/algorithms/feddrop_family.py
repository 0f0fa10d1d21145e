"""FedDrop (trajectory-weighted SyncDrop on FedAvg) and UniDrop.

FedDrop's clients train with SyncDrop at their own per-channel keep probabilities, and the server
re-optimises the sampled clients' probabilities from their trajectory similarity (eq. 8,
``optimise_keep_probs``); UniDrop keeps one constant probability meeting the budget. The round, the
FLOPs model (eq. 10), the options and the costs: docs/feddrop.md.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.errors import arg
from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics, tree_weighted_mean
from fedjax_sparse.algorithms.fedavg_family import global_model_predict, whole_state
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import sgd, sgd_step
from fedjax_sparse.mechanisms.syncdrop import (INIT_SCHEMES, ChannelLayout, SparseFlopsModel, channel_scale_hooks,
                                              channel_uniforms, dropout_aware_init, dropout_scale, keep_mask,
                                              solve_scaling)
from fedjax_sparse.models.base import Model, check_layer_kinds
from fedjax_sparse.core.training import model_rng, run_local_epochs

PSD_SHIFTS = ("always", "negative", "none")


# ---------------------------------------------------------------- server: similarity
def channel_trajectories(model: Model, layout: ChannelLayout, old_params: dict, new_params: dict) -> dict:
    """Per-channel parameter updates dtheta = old - new of the layout's layers.

    new_params leaves carry a leading client axis [K, ...]. Returns
    {name: [K, fan_in (+1 with a bias), C]}: column n is channel n's update.
    """
    out = {}
    for name in layout.names:
        size = model.layer(name).out_units
        old, new = old_params[name], new_params[name]
        k = new["kernel"].shape[0]
        parts = [(old["kernel"][None] - new["kernel"]).reshape(k, -1, size)]
        if "bias" in new:
            parts.append((old["bias"][None] - new["bias"]).reshape(k, 1, size))
        out[name] = jnp.concatenate(parts, axis=1)
    return out


def trajectory_similarity(trajectories: dict, layout: ChannelLayout, data_shares: jax.Array,
                          keep_probs: jax.Array) -> jax.Array:
    """S [total, K, K]: S[n, i, j] = l_i l_j max(p_i^n, p_j^n) dtheta_i^n . dtheta_j^n.

    trajectories: {name: [K, F, C]}; data_shares l [K] (sum 1); keep_probs
    [K, total] (the probabilities the clients trained with).
    """
    gram = jnp.concatenate([jnp.einsum("kfc,lfc->ckl", trajectories[name], trajectories[name])
                            for name in layout.names], axis=0)
    p = keep_probs.T  # [total, K]
    pmax = jnp.maximum(p[:, :, None], p[:, None, :])
    return gram * pmax * (data_shares[:, None] * data_shares[None, :])[None]


def shift_to_psd(similarity: jax.Array, mode: str = "always") -> jax.Array:
    """Adds -lambda_min * I to each S^n ([total, K, K]): "always" subtracts the
    smallest eigenvalue (reference code), "negative" only when it is negative,
    "none" leaves S alone. max(p_i, p_j) weighting can break Lemma 3's PSD-ness,
    and a non-PSD S^n makes eq. (7) unbounded in the wrong direction."""
    if mode == "none":
        return similarity
    sym = 0.5 * (similarity + jnp.swapaxes(similarity, 1, 2))
    lam_min = jnp.linalg.eigvalsh(sym)[:, 0]
    if mode == "negative":
        lam_min = jnp.minimum(lam_min, 0.0)
    eye = jnp.eye(similarity.shape[-1], dtype=similarity.dtype)
    return sym - lam_min[:, None, None] * eye[None]


def normalise_similarity(similarity: jax.Array) -> jax.Array:
    """S / sum(S) (a PSD S has a non-negative total); all zeros stays zeros."""
    total = similarity.sum()
    return jnp.where(total > 1e-30, similarity / jnp.maximum(total, 1e-30), jnp.zeros_like(similarity))


# ---------------------------------------------------------------- server: optimisation
def dropout_objective(inv_keep: jax.Array, similarity: jax.Array) -> jax.Array:
    """Eq. (7) in x = 1/q: sum_nij S[n,i,j] min(x_i^n, x_j^n); x [K, total]."""
    x = inv_keep.T  # [total, K]
    return (similarity * jnp.minimum(x[:, :, None], x[:, None, :])).sum()


def dropout_objective_and_grad(inv_keep: jax.Array, similarity: jax.Array):
    """Eq. (7) and its gradient ``2 sum_j S_ij (1[x_i < x_j] + 1/2 1[x_i = x_j])`` in one pass over a
    symmetric S, its value x . grad (degree-1 homogeneity): no extra [total, K, K] temporaries, about
    20x cheaper on CPU than autodiff of ``dropout_objective`` (docs/feddrop.md)."""
    x = inv_keep.T  # [total, K]
    xi, xj = x[:, :, None], x[:, None, :]
    weights = jnp.where(xi < xj, 1.0, jnp.where(xi == xj, 0.5, 0.0))
    grad = 2.0 * (similarity * weights).sum(-1)  # [total, K]
    return (x * grad).sum(), grad.T


class OptimiserInfo(NamedTuple):
    objective_start: jax.Array  # [] eq. (7) at the (feasible) start
    objective_end: jax.Array    # [] eq. (7) at the result
    loss_start: jax.Array       # [] eq. (8) at the start
    loss_end: jax.Array         # [] eq. (8) at the result
    iterations: jax.Array       # [] int32, gradient steps tried
    rejected: jax.Array         # [] int32, NaN/infeasible steps reverted
    slack: jax.Array            # [] g(q) at the result (>= 0; r = 1 without a budget)


def feasible_start(keep_probs: jax.Array, flops: SparseFlopsModel, budget: float | None,
                   min_keep: float, margin: float = 1e-3) -> jax.Array:
    """p [K, total] moved strictly inside g >= 0: scaled down uniformly so that
    the mean FLOPs ratio is r (1 - margin) if it is not already below that;
    if clipping to ``min_keep`` breaks it, the uniform solution is used."""
    p = jnp.clip(keep_probs, min_keep, 1.0)
    if budget is None or budget >= 1.0:
        return p
    target = budget * (1.0 - margin)
    s = jnp.minimum(solve_scaling(*flops.scaling_coefficients(p), target), 1.0)
    scaled = jnp.clip(p * s, min_keep, 1.0)
    uniform = solve_scaling(*flops.scaling_coefficients(jnp.ones_like(p)), target)
    uniform = jnp.broadcast_to(jnp.clip(uniform, min_keep, 1.0), p.shape)
    return jnp.where(flops.budget_slack(scaled, budget) > 0, scaled, uniform)


def optimise_keep_probs(similarity: jax.Array, keep_probs: jax.Array, flops: SparseFlopsModel, *,
                        budget: float | None, mu: float = 1e-4, lr: float = 1.0, max_iters: int = 10000,
                        check_every: int = 1000, tol: float = 1e-5, min_keep: float = 0.01):
    """Minimises eq. (8) over q [K, total] from the warm start ``keep_probs``.

    similarity [total, K, K] (PSD-shifted and normalised). ``budget`` None (or
    mu = 0) drops the barrier, leaving eq. (7) alone, minimised at q = 1
    (Thm. 3). Returns (q [K, total], OptimiserInfo).
    """
    use_barrier = budget is not None and budget < 1.0 and mu > 0
    barrier_value_and_grad = jax.value_and_grad(
        lambda x: -mu * jnp.log(flops.budget_slack(1.0 / x, 1.0 if budget is None else budget)))

    def value_and_grad(x):
        value, grad = dropout_objective_and_grad(x, similarity)
        if use_barrier:
            b_value, b_grad = barrier_value_and_grad(x)
            value, grad = value + b_value, grad + b_grad
        return value, grad
    lo, hi = 1.0, 1.0 / min_keep
    x0 = 1.0 / feasible_start(keep_probs, flops, budget, min_keep)
    f0, g0 = value_and_grad(x0)

    class State(NamedTuple):
        it: jax.Array
        rejected: jax.Array
        lr: jax.Array
        x: jax.Array
        f: jax.Array
        g: jax.Array
        best_x: jax.Array
        best_f: jax.Array
        check_f: jax.Array
        done: jax.Array

    def cond(s):
        return (s.it < max_iters) & ~s.done

    def body(s):
        x_try = jnp.clip(s.x - s.lr * s.g, lo, hi)
        f_try, g_try = value_and_grad(x_try)
        ok = jnp.isfinite(f_try) & jnp.all(jnp.isfinite(g_try))
        x, f, g = (jnp.where(ok, a, b) for a, b in ((x_try, s.x), (f_try, s.f), (g_try, s.g)))
        lr = jnp.where(ok, s.lr, 0.5 * s.lr)
        better = ok & (f_try < s.best_f)
        best_x = jnp.where(better, x_try, s.best_x)
        best_f = jnp.where(better, f_try, s.best_f)
        it = s.it + 1
        at_check = (it % check_every) == 0
        stalled = (s.check_f - best_f) <= tol * jnp.abs(s.check_f)
        done = (at_check & stalled) | (lr < 1e-20)
        check_f = jnp.where(at_check, best_f, s.check_f)
        return State(it, s.rejected + (~ok).astype(jnp.int32), lr, x, f, g, best_x, best_f, check_f, done)

    finite0 = jnp.isfinite(f0) & jnp.all(jnp.isfinite(g0))
    init = State(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.asarray(lr, jnp.float32),
                 x0, f0, jnp.where(jnp.isfinite(g0), g0, 0.0), x0, f0, f0, ~finite0)
    final = jax.lax.while_loop(cond, body, init)
    q = 1.0 / final.best_x
    slack = flops.budget_slack(q, budget if budget is not None else 1.0)
    info = OptimiserInfo(dropout_objective(x0, similarity), dropout_objective(final.best_x, similarity),
                         f0, final.best_f, final.it, final.rejected, slack)
    return q, info


# ---------------------------------------------------------------- client: SyncDrop training
def syncdrop_local_train(model: Model, optimizer: optax.GradientTransformation, layout: ChannelLayout,
                         flops: SparseFlopsModel, variables: dict, keep_probs: jax.Array, data, key: jax.Array,
                         draw_key: jax.Array, *, epochs: int, batch_size: int, preprocess, rescale: bool = True):
    """Local SGD with channel dropout (fresh optimiser state). Step s draws
    ``channel_uniforms(draw_key, s)``: pass the round's shared key for SyncDrop,
    a private key for independent dropout. Returns (variables, LocalStats,
    sampled forward FLOPs summed over the examples seen)."""
    def step(carry, batch, step_index, num_steps, step_key):
        params, stats, opt_state, sampled = carry
        mask = keep_mask(channel_uniforms(draw_key, step_index, layout), keep_probs)
        hooks = channel_scale_hooks(layout, dropout_scale(mask, keep_probs, rescale))
        params, stats, opt_state, loss = sgd_step(model, optimizer, params, stats, opt_state, batch,
                                                  model_rng(step_key), hooks)
        sampled = sampled + flops.forward_of_mask(mask) * batch.mask.sum()
        return (params, stats, opt_state, sampled), loss

    params = variables["params"]
    carry = (params, variables.get("batch_stats", {}), optimizer.init(params), jnp.zeros((), jnp.float32))
    (params, stats, _, sampled), local_stats = run_local_epochs(
        step, carry, data, key, epochs=epochs, batch_size=batch_size, preprocess=preprocess)
    return {"params": params, "batch_stats": stats}, local_stats, sampled


# ---------------------------------------------------------------- the algorithms
class FedDropServerState(NamedTuple):
    """Server state (also the broadcast) of FedDrop and UniDrop; clients keep nothing."""
    keep_probs: jax.Array   # [N, C] float32 keep probability of each client's C dropout channels
    variables: dict         # the global model {"params": ..., "batch_stats": ...}


FEDDROP_OPTIONS = dict(
    budget=0.5,               # r: FLOPs budget ratio (eq. 5)
    mu=1e-4,                  # log-barrier strength (eq. 8); the reference code uses ~1e-3
    synchronized=True,        # SyncDrop (shared draws) or independent draws (ablation)
    rescale=True,             # scale kept channels by 1/p (ablation: False)
    init="paper",             # paper | reference | model (see dropout.dropout_aware_init)
    optimize=True,            # False: keep the initial uniform p (UniDrop)
    opt_lr=1.0, opt_iters=10000, opt_check_every=1000, opt_tol=1e-5,
    min_keep=0.01,            # lower bound on optimised keep probabilities
    psd_shift="always",       # always | negative | none
    dense_input_sparsity=True,  # dense layers fed by dropped channels get cheaper (eq. 10)
    count_activations=False,  # add eq. 9's ReLU FLOPs (off: same convention as the other methods)
)

UNIDROP_OPTIONS = dict(budget=0.5, synchronized=False, rescale=True, init="paper",
                       dense_input_sparsity=True, count_activations=False)


def _dropout_fedavg(task: Task, name: str, *, budget, mu, synchronized, rescale, init, optimize, opt_lr,
                    opt_iters, opt_check_every, opt_tol, min_keep, psd_shift, dense_input_sparsity,
                    count_activations) -> Algorithm:
    for option, value, valid in (("init", init, INIT_SCHEMES), ("psd_shift", psd_shift, PSD_SHIFTS)):
        if value not in valid:
            raise ValueError(f"{name}: unknown {option} {value!r}; valid: {', '.join(valid)}")
    for option, value in (("budget", budget), ("min_keep", min_keep)):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name}: {option} must be in (0, 1], got {value}")
    model = task.model
    check_layer_kinds(model, name, ("dense", "conv"), "drops output channels of conv layers (input sparsity of "
                      "dense ones)", other_macs=False, grouped=False)
    if not model.sequential:
        # eq. (10) takes a layer's input sparsity from its input_layer's dropout, which a residual
        # stream (identity + dropped branch) does not follow
        raise ValueError(f"{name}: model {model.name} is not sequential (residual or attention); FedDrop's "
                         f"channel dropout and FLOPs model need a sequential {arg('model')} such as cnn7 or "
                         "lenet5_caffe")
    layout = ChannelLayout.from_model(model)
    # Its FLOPs model counts how many of a layer's inputs are dropped, not which rows read them: any order.
    model.check_unit_drops(name, layout.names, "drops the output channels of the conv layers", any_order=True)
    if not layout.names:
        raise ValueError(f"{name}: model {model.name} has no conv layers to drop channels of")
    flops = SparseFlopsModel.build(model, layout, input_sparsity_in_dense=dense_input_sparsity,
                                   count_activations=count_activations)
    p0 = flops.uniform_keep_prob(budget)
    if optimize and p0 < min_keep:
        raise ValueError(f"{name}: the uniform keep probability {p0:.4f} for budget {budget} is below "
                         f"min_keep={min_keep}; lower min_keep or raise the budget")
    optimizer = sgd(task.lr)
    opt_budget = budget if budget < 1.0 else None

    def init_fn(key):
        key_model, key_init = jax.random.split(key)
        variables = dropout_aware_init(key_init, model.init(key_model), model, layout, p0, init)
        keep_probs = jnp.full((task.num_clients, layout.total), p0, jnp.float32)
        return FedDropServerState(keep_probs=keep_probs, variables=variables), ()

    def client_update(payload: FedDropServerState, client_state, data, ctx):
        variables = payload.variables
        keep_probs = payload.keep_probs[ctx.client_id]
        key_train, key_private_draws = jax.random.split(ctx.key)
        draw_key = ctx.shared_key if synchronized else key_private_draws
        new_vars, stats, sampled = syncdrop_local_train(
            model, optimizer, layout, flops, variables, keep_probs, data, key_train, draw_key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess,
            rescale=rescale)
        model_bits = accounting.tree_bits(variables)
        down = model_bits + (layout.total * accounting.FLOAT_BITS if optimize else 0)
        # An expectation under the keep probabilities: float factors, summed in float64 on the host.
        expected = accounting.Cost.term(3, flops.forward(keep_probs), stats.num_examples.astype(jnp.float32))
        metrics = client_metrics(
            loss=stats.loss, flops=expected, uplink_bits=model_bits, downlink_bits=down,
            density=keep_probs.mean(), num_examples=stats.num_examples,
            flops_ratio=flops.ratio(keep_probs))
        message = {"variables": new_vars, "sampled_flops": 3.0 * sampled}
        return client_state, message, metrics

    def server_update(server_state: FedDropServerState, messages, ctx):
        shares = ctx.weights / jnp.maximum(ctx.weights.sum(), 1e-12)
        old = server_state.variables
        new = tree_weighted_mean(messages["variables"], ctx.weights)
        metrics = {"sampled_flops": messages["sampled_flops"].sum()}
        keep_all = server_state.keep_probs
        if optimize:
            p_round = keep_all[ctx.client_ids]
            traj = channel_trajectories(model, layout, old["params"], messages["variables"]["params"])
            sim = trajectory_similarity(traj, layout, shares, p_round)
            sim = normalise_similarity(shift_to_psd(sim, psd_shift))
            q, info = optimise_keep_probs(sim, p_round, flops, budget=opt_budget, mu=mu, lr=opt_lr,
                                          max_iters=opt_iters, check_every=opt_check_every, tol=opt_tol,
                                          min_keep=min_keep)
            keep_all = keep_all.at[ctx.client_ids].set(q)
            metrics.update(opt_objective_start=info.objective_start, opt_objective_end=info.objective_end,
                           opt_loss_start=info.loss_start, opt_loss_end=info.loss_end,
                           opt_iterations=info.iterations, opt_rejected=info.rejected,
                           budget_slack=info.slack, flops_ratio_next=flops.ratio(q).mean(),
                           keep_mean=q.mean(), keep_min=q.min(), keep_max=q.max(), keep_std=q.std())
        return FedDropServerState(keep_probs=keep_all, variables=new), metrics

    hparams = {"initial_keep_prob": p0, "num_dropout_channels": layout.total,
               "dropout_layers": list(layout.names)}
    return Algorithm(name, init_fn, whole_state, client_update, server_update,
                     personal_predict=None, global_predict=global_model_predict(model), hparams=hparams)


@register_algorithm("feddrop", FEDDROP_OPTIONS, description="FedDrop: synchronised channel dropout with per-client "
                    "keep rates optimised by the server", paper="docs/feddrop.md")
def feddrop(task: Task, **options) -> Algorithm:
    return _dropout_fedavg(task, "feddrop", **options)


@register_algorithm("unidrop", UNIDROP_OPTIONS,
                    description="uniform channel dropout at one rate for every client (FedDrop's baseline)")
def unidrop(task: Task, **options) -> Algorithm:
    fixed = {k: v for k, v in FEDDROP_OPTIONS.items() if k not in UNIDROP_OPTIONS}
    return _dropout_fedavg(task, "unidrop", **{**fixed, **options, "optimize": False})


__all__ = ["FEDDROP_OPTIONS", "FedDropServerState", "OptimiserInfo", "UNIDROP_OPTIONS", "channel_trajectories",
           "dropout_objective", "dropout_objective_and_grad",
           "feasible_start", "feddrop", "normalise_similarity", "optimise_keep_probs", "shift_to_psd",
           "syncdrop_local_train", "trajectory_similarity", "unidrop"]
