"""The FSL paper's (seed 003) weight-training baselines: FedAvg under robust aggregators and
model-poisoning attacks (Table 2), SignSGD and TopK (Table 1).

All train the global model locally as the authors' code does (``train_update``) and send their
update ``delta = w_local - w_global`` [P]; ``fedavg_robust`` wraps ``paper_fedavg`` (an
``algorithms.compose.UpdateServer``) with ``compose.with_aggregator`` and ``compose.with_attack``.
Options and attacks: docs/fsl.md, "Baselines".
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedjax_sparse.errors import arg
from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics, mean_weights, replicate
from fedjax_sparse.algorithms.compose import ATTACKS, WRAPPER_AGGREGATORS, UpdateServer, with_aggregator, with_attack
from fedjax_sparse.algorithms.fedavg_family import FedAvgServerState, global_model_predict, model_server
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import local_train, sgd
from fedjax_sparse.mechanisms.attacks import DEVIATIONS, Threat, sign_reverse_attack
from fedjax_sparse.mechanisms.robust_aggregation import sign_majority, topk_sparsify
from fedjax_sparse.mechanisms.supermask import kept_count
from fedjax_sparse.core.training import steps_per_epoch

LR_SCHEDULES = ("cosine_epoch", "cosine_step", "constant")


class TopkClientState(NamedTuple):
    """TopK's client state."""
    residual: jax.Array | None   # [N, P] float32 unsent error-feedback residual; None without error feedback


def _check(name: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


# ---------------------------------------------------------------- local training
def local_lr(base_lr: float, lr_decay: float, round_index, step, num_steps, epochs: int, schedule: str):
    """Learning rate of local step ``step`` (of ``num_steps``) in round ``round_index``.

    ``base_lr * lr_decay**round`` times a cosine: ``cosine_epoch`` is the
    authors' ``CosineAnnealingLR(T_max=epochs)`` stepped once per epoch
    (constant within an epoch); ``cosine_step`` anneals over the local steps.
    """
    lr = base_lr * jnp.power(jnp.float32(lr_decay), jnp.asarray(round_index, jnp.float32))
    if schedule == "constant":
        return lr
    if schedule == "cosine_epoch":
        per_epoch = jnp.maximum(num_steps // epochs, 1)
        progress = (step // per_epoch).astype(jnp.float32) / epochs
    elif schedule == "cosine_step":
        progress = step.astype(jnp.float32) / jnp.maximum(num_steps, 1).astype(jnp.float32)
    else:
        raise ValueError(f"unknown lr_schedule {schedule!r}; valid: {LR_SCHEDULES}")
    return lr * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))


def train_update(task: Task, variables: dict, data, ctx, *, momentum, weight_decay, lr_decay,
                 lr_schedule):
    """Local SGD from the global model; returns (delta [P] float32, LocalStats)."""
    num_steps = task.local_epochs * steps_per_epoch(data.count, task.batch_size)

    def schedule(count):
        return local_lr(task.lr, lr_decay, ctx.round, count, num_steps, task.local_epochs, lr_schedule)

    optimizer = sgd(schedule, momentum, weight_decay)
    new_vars, _, stats = local_train(
        task.model, optimizer, variables, optimizer.init(variables["params"]), data, ctx.key,
        epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess)
    old_flat, _ = ravel_pytree(variables["params"])
    new_flat, _ = ravel_pytree(new_vars["params"])
    return new_flat - old_flat, stats


# ---------------------------------------------------------------- shared pieces
TRAIN_OPTIONS = dict(momentum=0.9, weight_decay=1e-4, lr_decay=0.999, lr_schedule="cosine_epoch")
THREAT_OPTIONS = dict(malicious_fraction=0.0, attacker_knowledge="all", malicious_seed=-1)


def make_threat(task: Task, malicious_fraction: float, attacker_knowledge: str, malicious_seed: int) -> Threat:
    """The options ``malicious_fraction``, ``attacker_knowledge``, ``malicious_seed`` (< 0: the run
    seed) as a ``Threat`` (FSL's and SignSGD's attacks and the wrappers use the same)."""
    return Threat(task.num_clients, malicious_fraction, attacker_knowledge,
                  task.seed if malicious_seed < 0 else malicious_seed)


def _make_base(task: Task, name: str, *, momentum, weight_decay, lr_decay, lr_schedule):
    """init / broadcast / train / apply / model / predict shared by the FedAvg-shaped baselines."""
    _check("lr_schedule", lr_schedule, LR_SCHEDULES)
    shapes = jax.eval_shape(task.model.init, jax.random.PRNGKey(0))
    if jax.tree_util.tree_leaves(shapes.get("batch_stats", {})):
        raise ValueError(f"{name} aggregates flat parameter updates and does not handle BatchNorm "
                         f"statistics; model {task.model.name!r} has BatchNorm")
    num_params = accounting.num_values(shapes["params"])
    model = task.model

    init, broadcast = model_server(model)

    def train(variables, data, ctx, uplink_bits):
        """``train_update``: (delta [P], the client's metrics: ``uplink_bits`` up, the dense model down)."""
        delta, stats = train_update(task, variables, data, ctx, momentum=momentum, weight_decay=weight_decay,
                                    lr_decay=lr_decay, lr_schedule=lr_schedule)
        return delta, client_metrics(
            loss=stats.loss, flops=accounting.training_flops(model, stats.num_examples), uplink_bits=uplink_bits,
            downlink_bits=num_params * accounting.FLOAT_BITS, density=1.0, num_examples=stats.num_examples)

    def global_vector(server_state: FedAvgServerState):
        return ravel_pytree(server_state.variables["params"])[0]

    def apply_update(server_state: FedAvgServerState, update, server_lr) -> FedAvgServerState:
        flat, unravel = ravel_pytree(server_state.variables["params"])
        new = dict(server_state.variables, params=unravel(flat + server_lr * update))
        return server_state._replace(variables=new)

    return num_params, init, broadcast, train, apply_update, global_vector, global_model_predict(model)


# ---------------------------------------------------------------- FedAvg, and under robust aggregators
def paper_fedavg(task: Task, *, server_lr: float = 1.0, weighted: bool = False, momentum: float = 0.9,
                 weight_decay: float = 1e-4, lr_decay: float = 0.999, lr_schedule: str = "cosine_epoch",
                 name: str = "paper_fedavg") -> Algorithm:
    """FedAvg as the FSL authors train it: clients send ``delta`` [P] (``train_update``); the server,
    an ``UpdateServer``, adds ``server_lr`` times their mean (uniform, or data-size ``weighted``)."""
    num_params, init, broadcast, train, apply_update, global_vector, global_predict = _make_base(
        task, name, momentum=momentum, weight_decay=weight_decay, lr_decay=lr_decay, lr_schedule=lr_schedule)

    def client_update(variables, client_state, data, ctx):
        delta, metrics = train(variables, data, ctx, num_params * accounting.FLOAT_BITS)
        return client_state, delta, metrics

    def mean(updates, ctx):
        w = mean_weights(ctx, weighted)
        return (w / w.sum()) @ updates

    server = UpdateServer(mean=mean, apply=lambda state, aggregate: apply_update(state, aggregate, server_lr),
                          model=global_vector)
    return Algorithm(name, init, broadcast, client_update, server,
                     personal_predict=None, global_predict=global_predict)


ROBUST_OPTIONS = dict(aggregator="mean", attack="min_max", deviation="std", gamma_init=10.0, attack_scale=1e5,
                      search_steps=20, trim_fraction=-1.0, krum_select=-1, server_lr=1.0,
                      weighted=False, **TRAIN_OPTIONS, **THREAT_OPTIONS)


@register_algorithm("fedavg_robust", ROBUST_OPTIONS,
                    description="FedAvg with a robust aggregator under a model-poisoning attack",
                    paper="Shejwalkar & Houmansadr, NDSS 2021")
def fedavg_robust(task: Task, *, aggregator, attack, deviation, gamma_init, attack_scale, search_steps, trim_fraction,
                  krum_select, server_lr, weighted, momentum, weight_decay, lr_decay, lr_schedule,
                  malicious_fraction, attacker_knowledge, malicious_seed, name="fedavg_robust") -> Algorithm:
    """``paper_fedavg`` whose server aggregates the float updates with ``aggregator``,
    under the ``attack`` of the ``malicious_fraction`` malicious clients."""
    _check("aggregator", aggregator, WRAPPER_AGGREGATORS)
    _check("attack", attack, ATTACKS)
    _check("deviation", deviation, DEVIATIONS)
    alg = paper_fedavg(task, server_lr=server_lr, weighted=weighted, momentum=momentum, weight_decay=weight_decay,
                       lr_decay=lr_decay, lr_schedule=lr_schedule, name=name)
    threat = make_threat(task, malicious_fraction, attacker_knowledge, malicious_seed)
    if aggregator != "mean":   # "mean" is FedAvg's own
        alg = with_aggregator(alg, aggregator, trim_fraction=trim_fraction, krum_select=krum_select, threat=threat)
    alg = with_attack(alg, attack, threat=threat, deviation=deviation, gamma_init=gamma_init,
                      search_steps=search_steps, attack_scale=attack_scale)
    return dataclasses.replace(alg, name=name, hparams={})   # the registry records the options


_ALIAS_OPTIONS = {k: v for k, v in ROBUST_OPTIONS.items() if k != "aggregator"}


@register_algorithm("trimmed_mean", dict(_ALIAS_OPTIONS, attack="tailored"),
                    description="FedAvg with coordinate-wise trimmed mean, under attack", paper="Yin et al., ICML 2018")
def trimmed_mean_algorithm(task: Task, **options) -> Algorithm:
    """FedAvg with coordinate-wise Trimmed-mean (Yin et al. 2018); DYN-OPT attack by default."""
    return fedavg_robust(task, aggregator="trimmed_mean", name="trimmed_mean", **options)


@register_algorithm("multi_krum", dict(_ALIAS_OPTIONS, attack="tailored"),
                    description="FedAvg with Multi-Krum aggregation, under attack",
                    paper="Blanchard et al., NeurIPS 2017")
def multi_krum_algorithm(task: Task, **options) -> Algorithm:
    """FedAvg with Multi-Krum (Blanchard et al. 2017); DYN-OPT attack by default."""
    return fedavg_robust(task, aggregator="multi_krum", name="multi_krum", **options)


# ---------------------------------------------------------------- SignSGD
SIGNSGD_OPTIONS = dict(server_lr=1e-3, attack="reverse", **TRAIN_OPTIONS, **THREAT_OPTIONS)


@register_algorithm("signsgd", SIGNSGD_OPTIONS, unwrappable="its clients send signs (int8), not float "
                    "updates, and the server takes their majority vote (SignSGD has its own attack: "
                    f"{arg('option', 'malicious_fraction=F')})",
                    description="SignSGD with majority vote", paper="Bernstein et al., ICLR 2019",
                    lr=0.01)   # its clients' momentum is 0.9 by default (see catalog.DEFAULT_LR)
def signsgd(task: Task, *, server_lr, attack, momentum, weight_decay, lr_decay, lr_schedule,
            malicious_fraction, attacker_knowledge, malicious_seed) -> Algorithm:
    """SignSGD with majority vote (Bernstein et al. 2019) over local-training updates."""
    _check("attack", attack, ("none", "reverse"))
    num_params, init, broadcast, train, apply_update, _, global_predict = _make_base(
        task, "signsgd", momentum=momentum, weight_decay=weight_decay, lr_decay=lr_decay,
        lr_schedule=lr_schedule)
    threat = make_threat(task, malicious_fraction, attacker_knowledge, malicious_seed)

    def client_update(variables, client_state, data, ctx):
        delta, metrics = train(variables, data, ctx, num_params)
        return client_state, jnp.where(delta >= 0, 1, -1).astype(jnp.int8), metrics   # 1 bit: zero is sent as +

    def server_update(server_state, signs, ctx):
        is_mal, known = threat.split(ctx.client_ids)
        if threat.active and attack == "reverse":
            signs = sign_reverse_attack(signs, is_mal, known)
        return apply_update(server_state, sign_majority(signs), server_lr), {"malicious_clients": is_mal.sum()}

    return Algorithm("signsgd", init, broadcast, client_update, server_update,
                     personal_predict=None, global_predict=global_predict)


# ---------------------------------------------------------------- TopK
TOPK_OPTIONS = dict(fraction=0.5, error_feedback=False, index_coding="bitmap", server_lr=1.0,
                    **TRAIN_OPTIONS)


def topk_uplink_bits(num_params: int, kept: int, index_coding: str) -> int:
    """Values (32 bits each) plus their positions: a 1-bit-per-weight bitmap
    (the paper's Table 1 figures) or ceil(log2 P) bits per sent index."""
    if index_coding == "bitmap":
        return kept * accounting.FLOAT_BITS + num_params
    if index_coding == "indices":
        return kept * (accounting.FLOAT_BITS + max(int(math.ceil(math.log2(num_params))), 1))
    raise ValueError(f"unknown index_coding {index_coding!r}; valid: bitmap, indices")


@register_algorithm("topk", TOPK_OPTIONS, description="top-k sparsified updates, optional error feedback",
                    paper="Aji & Heafield 2017; Alistarh et al. 2018")
def topk(task: Task, *, fraction, error_feedback, index_coding, server_lr, momentum, weight_decay,
         lr_decay, lr_schedule) -> Algorithm:
    """TopK sparsification (Aji & Heafield 2017; Alistarh et al. 2018) of local updates."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"topk fraction must be in (0, 1], got {fraction}")
    num_params, base_init, broadcast, train, apply_update, global_vector, global_predict = _make_base(
        task, "topk", momentum=momentum, weight_decay=weight_decay, lr_decay=lr_decay, lr_schedule=lr_schedule)
    kept = kept_count(num_params, fraction)
    up_bits = topk_uplink_bits(num_params, kept, index_coding)

    def init(key):
        server, _ = base_init(key)
        # Error feedback keeps every client's unsent residual: N x P floats.
        residual = replicate(jnp.zeros((num_params,), jnp.float32), task.num_clients) if error_feedback else None
        return server, TopkClientState(residual)

    def client_update(variables, client_state: TopkClientState, data, ctx):
        delta, metrics = train(variables, data, ctx, up_bits)
        if error_feedback:
            delta = delta + client_state.residual
        sent = topk_sparsify(delta, fraction)
        return TopkClientState(delta - sent if error_feedback else None), sent, metrics

    server = UpdateServer(mean=lambda sent, ctx: sent.mean(0),
                          apply=lambda state, aggregate: apply_update(state, aggregate, server_lr), model=global_vector)
    return Algorithm("topk", init, broadcast, client_update, server,
                     personal_predict=None, global_predict=global_predict)


__all__ = ["LR_SCHEDULES", "ROBUST_OPTIONS", "SIGNSGD_OPTIONS", "THREAT_OPTIONS", "TOPK_OPTIONS", "TRAIN_OPTIONS",
           "TopkClientState", "fedavg_robust", "local_lr", "make_threat", "multi_krum_algorithm", "paper_fedavg",
           "signsgd", "topk", "topk_uplink_bits", "train_update", "trimmed_mean_algorithm"]
