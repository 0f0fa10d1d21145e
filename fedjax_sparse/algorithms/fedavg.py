"""FedAvg (McMahan et al. 2017) and Local training (no communication).

FedAvg: the server model goes down, each sampled client runs local SGD from it
(optimizer state fresh each round) and sends its model back; the new server
model is the data-size weighted mean (``weighted=False``: uniform mean),
moved by ``server_lr`` from the old one. BatchNorm running statistics are
averaged like parameters. Communication: the whole model (float32) each way.

Local: every client trains its own model on its own data and never
communicates; its optimizer state persists across rounds.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sparse import accounting
from fedjax_sparse.algorithms.base import Algorithm, Task, client_metrics, cohort_mean, replicate, tree_weighted_mean
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import local_train, predict_fn, sgd

# The fields of every state class are declared in the sorted order of the dict keys the state had
# before it was typed: checkpoints store the state's leaves in flatten order (sorted keys for a
# dict, field order for a NamedTuple), so this keeps checkpoints of earlier versions loadable.


class FedAvgServerState(NamedTuple):
    """Server state of FedAvg and of the other algorithms whose server holds only the global
    model (FedProx, ``fedavg_robust``/``trimmed_mean``/``multi_krum``, SignSGD, TopK)."""
    variables: dict   # the global model {"params": ..., "batch_stats": ...}, leaves shaped as the model's


class LocalClientState(NamedTuple):
    """Client state of Local training; every leaf has a leading client axis [N, ...]."""
    opt_state: Any    # the client's optimiser state (persists across rounds), [N, ...] leaves
    variables: dict   # the client's own model {"params": ..., "batch_stats": ...}, [N, ...] leaves


def dense_client_update(task: Task, optimizer, extra_loss_for=None):
    """The FedAvg family's client: local SGD from the broadcast model (fresh
    optimiser state), the whole model back, float32 both ways.
    ``extra_loss_for(variables)`` returns a loss term on the params that may
    depend on the broadcast model (FedProx's proximal term)."""
    model = task.model

    def client_update(variables, client_state, data, ctx):
        new_vars, _, stats = local_train(
            model, optimizer, variables, optimizer.init(variables["params"]), data, ctx.key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess,
            extra_loss=None if extra_loss_for is None else extra_loss_for(variables))
        bits = accounting.tree_bits(variables)
        metrics = client_metrics(
            loss=stats.loss, flops=accounting.training_flops(model, stats.num_examples),
            uplink_bits=bits, downlink_bits=bits, density=1.0, num_examples=stats.num_examples)
        return client_state, new_vars, metrics
    return client_update


def global_model_predict(model):
    """global_predict for algorithms whose server state has a ``variables`` field."""
    def global_predict(server_state, x):
        return predict_fn(model, server_state.variables)(x)
    return global_predict


FEDAVG_OPTIONS = dict(momentum=0.0, weight_decay=0.0, server_lr=1.0, weighted=True, clip_norm=0.0)


@register_algorithm("fedavg", FEDAVG_OPTIONS, description="federated averaging of local SGD",
                    paper="McMahan et al., AISTATS 2017")
def fedavg(task: Task, *, momentum, weight_decay, server_lr, weighted, clip_norm) -> Algorithm:
    model = task.model
    optimizer = sgd(task.lr, momentum, weight_decay, clip_norm or None)

    def init(key):
        return FedAvgServerState(model.init(key)), ()

    def broadcast(server_state: FedAvgServerState, round_index):
        return server_state.variables

    client_update = dense_client_update(task, optimizer)

    def server_update(server_state: FedAvgServerState, messages, ctx):
        weights = ctx.weights if weighted else jnp.ones_like(ctx.weights)
        old = server_state.variables
        # A Poisson cohort (ctx.mask): the mean over its real clients; an empty round keeps the model.
        mask = getattr(ctx, "mask", None)
        mean = tree_weighted_mean(messages, weights) if mask is None else cohort_mean(messages, weights, mask, old)
        new = jax.tree_util.tree_map(lambda o, m: o + server_lr * (m - o), old, mean)
        return FedAvgServerState(new), {}

    return Algorithm("fedavg", init, broadcast, client_update, server_update,
                     personal_predict=None, global_predict=global_model_predict(model), varying_cohort=True)


LOCAL_OPTIONS = dict(momentum=0.0, weight_decay=0.0, clip_norm=0.0)


@register_algorithm("local", LOCAL_OPTIONS, unwrappable="its clients send nothing (each trains alone)",
                    description="local training only, nothing communicated (the personalisation baseline)")
def local(task: Task, *, momentum, weight_decay, clip_norm) -> Algorithm:
    model = task.model
    optimizer = sgd(task.lr, momentum, weight_decay, clip_norm or None)

    def init(key):
        # All clients start from the same initial model, as in the papers.
        variables = model.init(key)
        state = LocalClientState(opt_state=optimizer.init(variables["params"]), variables=variables)
        return (), replicate(state, task.num_clients)

    def broadcast(server_state, round_index):
        return ()

    def client_update(payload, client_state: LocalClientState, data, ctx):
        new_vars, opt_state, stats = local_train(
            model, optimizer, client_state.variables, client_state.opt_state, data, ctx.key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess)
        metrics = client_metrics(
            loss=stats.loss, flops=accounting.training_flops(model, stats.num_examples),
            uplink_bits=0.0, downlink_bits=0.0, density=1.0, num_examples=stats.num_examples)
        return LocalClientState(opt_state=opt_state, variables=new_vars), (), metrics

    def server_update(server_state, messages, ctx):
        return server_state, {}

    def personal_predict(server_state, client_state: LocalClientState, client_id, x):
        return predict_fn(model, client_state.variables)(x)

    return Algorithm("local", init, broadcast, client_update, server_update,
                     personal_predict=personal_predict, global_predict=None)
