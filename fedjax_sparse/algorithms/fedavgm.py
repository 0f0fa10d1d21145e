"""FedAvgM (Hsu, Qi & Brown 2019): FedAvg whose server applies momentum to the
averaged client update. Also the worked example of docs/design.md: a whole
algorithm in one file, with typed options and state.

Server, per round: ``delta = mean_k (w_k - w)`` (data-size weighted unless
``weighted=False``), ``v <- beta v + delta``, ``w <- w + server_lr v``.
``beta = 0`` and ``server_lr = 1`` is FedAvg. BatchNorm statistics are averaged
as FedAvg does (momentum on running statistics has no meaning).
Clients: FedAvg's (local SGD from the broadcast model, fresh optimiser, dense
model both ways in float32).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.algorithms.base import Algorithm, Task, cohort_mean, tree_weighted_mean
from fedjax_sparse.algorithms.fedavg import dense_client_update
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import predict_fn, sgd


@dataclasses.dataclass(frozen=True)
class FedAvgMOptions:
    server_momentum: float = 0.9   # beta
    server_lr: float = 1.0         # eta
    momentum: float = 0.0          # the clients' SGD momentum
    weighted: bool = True          # data-size weighted mean of the client models


class FedAvgMServerState(NamedTuple):
    variables: dict   # the global model {"params": ..., "batch_stats": ...}
    velocity: dict    # server momentum, shaped like variables["params"]


def server_momentum_step(server: FedAvgMServerState, mean_variables: dict, *, beta: float,
                         server_lr: float) -> FedAvgMServerState:
    """One FedAvgM server step from the clients' (weighted) mean model."""
    delta = jax.tree_util.tree_map(jnp.subtract, mean_variables["params"], server.variables["params"])
    velocity = jax.tree_util.tree_map(lambda v, d: beta * v + d, server.velocity, delta)
    params = jax.tree_util.tree_map(lambda w, v: w + server_lr * v, server.variables["params"], velocity)
    return FedAvgMServerState({**mean_variables, "params": params}, velocity)


@register_algorithm("fedavgm", FedAvgMOptions, description="FedAvg with server momentum",
                    paper="Hsu et al. 2019")
def fedavgm(task: Task, *, server_momentum: float, server_lr: float, momentum: float,
            weighted: bool) -> Algorithm:
    model = task.model

    def init(key):
        variables = model.init(key)
        return FedAvgMServerState(variables, jax.tree_util.tree_map(jnp.zeros_like, variables["params"])), ()

    def broadcast(server: FedAvgMServerState, round_index):
        return server.variables

    def server_update(server: FedAvgMServerState, messages, ctx):
        weights = ctx.weights if weighted else jnp.ones_like(ctx.weights)
        # A Poisson cohort (ctx.mask): its real clients' mean; an empty round's mean is the model itself
        # (a zero delta: the momentum alone moves it).
        mean = tree_weighted_mean(messages, weights) if getattr(ctx, "mask", None) is None else cohort_mean(
            messages, weights, ctx.mask, server.variables)
        new = server_momentum_step(server, mean, beta=server_momentum, server_lr=server_lr)
        return new, {"velocity_norm": optax.tree.norm(new.velocity)}

    def global_predict(server: FedAvgMServerState, x):
        return predict_fn(model, server.variables)(x)

    return Algorithm("fedavgm", init, broadcast, dense_client_update(task, sgd(task.lr, momentum)),
                     server_update, global_predict=global_predict, varying_cohort=True)
