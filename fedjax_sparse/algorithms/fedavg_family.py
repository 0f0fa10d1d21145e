"""FedAvg (McMahan et al. 2017) with any server optimiser from optax, and Local training (no
communication).

FedAvg's server hands the pseudo-gradient ``g = w - mean`` of the clients' (weighted) mean model to
``server_optimizer`` (Reddi et al., ICLR 2021): ``sgd`` (``server_lr = 1`` is FedAvg), ``momentum``,
``adam``, ``yogi``, ``adagrad``; ``fedavgm``, ``fedadam``, ``fedyogi`` and ``fedadagrad`` fix it. Each
optimiser's formula, how tau maps to optax's eps and where optax differs from the paper: docs/design.md,
"FedAvg's server optimisers". Local: every client trains its own model and never communicates.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import (Algorithm, Task, client_metrics, cohort_mean, mean_weights, replicate,
                                          tree_weighted_mean)
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import local_train, predict_fn, sgd
from fedjax_sparse.errors import arg
from fedjax_sparse.models.base import Model

# Field order is the checkpoints' leaf order (docs/design.md, "Algorithm states"): never reorder.


class FedAvgServerState(NamedTuple):
    """Server state of FedAvg (``server_optimizer=sgd``) and of the other algorithms whose server holds
    only the global model (FedProx, ``fedavg_robust``/``trimmed_mean``/``multi_krum``, SignSGD, TopK)."""
    variables: dict   # the global model {"params": ..., "batch_stats": ...}, leaves shaped as the model's


def model_server(model: Model, state: Callable[[dict], Any] = FedAvgServerState) -> tuple[Callable, Callable]:
    """(``init``, ``broadcast``) of a server holding the global model alone, as ``state(variables)``:
    no client state; the clients receive the model."""
    return (lambda key: (state(model.init(key)), ())), (lambda server, round_index: server.variables)


def whole_state(server_state, round_index):
    """``broadcast`` of a server whose clients receive its whole state."""
    return server_state


def client_mean(messages, ctx, weighted: bool, empty):
    """The clients' data-size weighted (``weighted``) or uniform mean of ``messages`` (leaves [K, ...]); of
    a Poisson cohort (``ctx.mask``) over its real clients, ``empty`` when none is (an empty round's)."""
    weights = mean_weights(ctx, weighted)
    mask = getattr(ctx, "mask", None)
    return tree_weighted_mean(messages, weights) if mask is None else cohort_mean(messages, weights, mask, empty)


# One class per server optimiser, not None fields: orbax restores no checkpoint lacking a field.
class FedAvgMServerState(NamedTuple):
    """Server state under ``server_optimizer=momentum`` (``fedavgm``)."""
    variables: dict   # the global model
    # the server momentum of the mean update (Hsu et al.'s v), shaped like variables["params"]; optax's
    # trace of the pseudo-gradient is -v
    velocity: dict


class FedOptServerState(NamedTuple):
    """Server state under ``server_optimizer=adam|yogi|adagrad`` (``fedadam``, ``fedyogi``, ``fedadagrad``)."""
    variables: dict   # the global model
    opt_state: Any    # the optax optimiser's state (its moments shaped like variables["params"])


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


SERVER_OPTIMIZERS = ("sgd", "momentum", "adam", "yogi", "adagrad")
# Each server hyper-parameter beside server_lr, its default (the paper's beta1, beta2, tau; Hsu et
# al.'s beta) and the optimisers that read it.
SERVER_HPARAMS = dict(server_momentum=0.9, server_b1=0.9, server_b2=0.99, server_tau=1e-3)
READ_BY = {"server_momentum": ("momentum",), "server_b1": ("adam", "yogi"), "server_b2": ("adam", "yogi"),
           "server_tau": ("adam", "yogi", "adagrad")}
CLIENT_OPTIONS = dict(momentum=0.0, weight_decay=0.0, weighted=True, clip_norm=0.0)
FEDAVG_OPTIONS = dict(momentum=0.0, weight_decay=0.0, server_lr=1.0, weighted=True, clip_norm=0.0,
                      server_optimizer="sgd", **SERVER_HPARAMS)


def make_server_optimizer(name: str, server_lr, *, server_momentum=0.9, server_b1=0.9, server_b2=0.99,
                          server_tau=1e-3) -> optax.GradientTransformation:
    """The optax optimiser ``name`` (one of SERVER_OPTIMIZERS) the server applies to the pseudo-gradient
    (docs/design.md, "FedAvg's server optimisers", gives each one's formula and how tau maps to eps)."""
    if name == "sgd":
        return optax.sgd(server_lr)
    if name == "momentum":
        # The momentum is passed even when 0, so the state (its velocity) has one structure for every value.
        return optax.sgd(server_lr, momentum=server_momentum)
    if name == "adam":
        return optax.adam(server_lr, b1=server_b1, b2=server_b2, eps=server_tau)
    if name == "yogi":
        # optax.yogi with its accumulators' start (fixed at 1e-6 there) at the paper's v_{-1} = tau**2.
        return optax.chain(optax.scale_by_yogi(b1=server_b1, b2=server_b2, eps=server_tau,
                                               initial_accumulator_value=server_tau ** 2),
                           optax.scale_by_learning_rate(server_lr))
    if name == "adagrad":
        # optax adds eps under the root and starts the sum at 0 here: sqrt(tau**2 + sum g**2).
        return optax.adagrad(server_lr, initial_accumulator_value=0.0, eps=server_tau ** 2)
    raise ValueError(f"{arg('option', f'server_optimizer={name!r}')}: expected one of {', '.join(SERVER_OPTIMIZERS)}")


def check_server_options(algorithm: str, optimizer: str, given: dict, defaults: dict) -> None:
    """Refuses, in one line, a server hyper-parameter set away from its default for an optimiser that does
    not read it (``fedavg --option server_b2=0.9`` under sgd would change nothing), and values outside the
    optimiser's range. Traced values (a sweep's) were checked concretely before."""
    make_server_optimizer(optimizer, 1.0)   # an unknown name: its one-line error
    concrete = {k: v for k, v in given.items() if isinstance(v, (int, float))}
    for key, value in concrete.items():
        if key in READ_BY and optimizer not in READ_BY[key] and value != defaults.get(key, value):
            raise ValueError(f"{arg('option', f'{key}={value}')} of algorithm {algorithm}: "
                             f"server_optimizer={optimizer} does not read it (only {', '.join(READ_BY[key])}); "
                             "drop it or choose one of those")
    for key in ("server_momentum", "server_b1", "server_b2"):
        if key in concrete and not 0.0 <= concrete[key] < 1.0:
            raise ValueError(f"{arg('option', f'{key}={concrete[key]}')} of algorithm {algorithm}: expected "
                             f"0 <= {key} < 1")
    if optimizer in READ_BY["server_tau"] and "server_tau" in concrete and not concrete["server_tau"] > 0:
        raise ValueError(f"{arg('option', 'server_tau=' + str(concrete['server_tau']))} of algorithm {algorithm}: "
                         "expected tau > 0 "
                         "(it keeps the adaptive step finite where the second moment is 0)")


def server_step(optimizer: optax.GradientTransformation, kind: str, server, mean: dict, server_lr):
    """One server step of the FedAvg family from the clients' (weighted) mean model ``mean``: ``kind``'s
    optax ``optimizer`` applied to the pseudo-gradient ``params - mean["params"]``. ``server``: a
    FedAvgServerState (sgd), FedAvgMServerState (momentum) or FedOptServerState; returns the same class."""
    params = server.variables["params"]
    pseudo_gradient = jax.tree_util.tree_map(jnp.subtract, params, mean["params"])
    if kind == "momentum":   # the stored velocity v is minus optax's trace (see FedAvgMServerState)
        state = optax.tree_utils.tree_set(optimizer.init(params),
                                          trace=jax.tree_util.tree_map(jnp.negative, server.velocity))
    elif kind == "sgd":
        state = optimizer.init(params)   # stateless: nothing is stored
    else:
        state = server.opt_state
    updates, state = optimizer.update(pseudo_gradient, state, params)
    new_params = optax.apply_updates(params, updates)
    if kind == "sgd":   # FedAvg's rule for the other collections: moved by server_lr like the weights
        others = jax.tree_util.tree_map(lambda o, m: o + server_lr * (m - o), server.variables, mean)
        return FedAvgServerState({**others, "params": new_params})
    variables = {**mean, "params": new_params}
    if kind == "momentum":
        return FedAvgMServerState(variables, jax.tree_util.tree_map(jnp.negative,
                                                                   optax.tree_utils.tree_get(state, "trace")))
    return FedOptServerState(variables, state)


def build_fedavg(task: Task, *, name: str = "fedavg", momentum, weight_decay, server_lr, weighted, clip_norm,
                 server_optimizer: str = "sgd", **server_hparams) -> Algorithm:
    """FedAvg whose server applies ``server_optimizer`` (see the module docstring); ``server_hparams``:
    the SERVER_HPARAMS it reads (others take their defaults)."""
    kind = server_optimizer
    optimizer = make_server_optimizer(kind, server_lr, **{**SERVER_HPARAMS, **server_hparams})
    model = task.model
    client_optimizer = sgd(task.lr, momentum, weight_decay, clip_norm or None)

    def init(key):
        variables = model.init(key)
        if kind == "sgd":
            return FedAvgServerState(variables), ()
        if kind == "momentum":
            return FedAvgMServerState(variables, jax.tree_util.tree_map(jnp.zeros_like, variables["params"])), ()
        return FedOptServerState(variables, optimizer.init(variables["params"])), ()

    broadcast = model_server(model)[1]

    def server_update(server_state, messages, ctx):
        # An empty Poisson round's mean is the model itself (a zero pseudo-gradient: sgd keeps the model, a
        # momentum or moment alone moves it).
        mean = client_mean(messages, ctx, weighted, server_state.variables)
        new = server_step(optimizer, kind, server_state, mean, server_lr)
        return new, ({"velocity_norm": optax.tree.norm(new.velocity)} if kind == "momentum" else {})

    return Algorithm(name, init, broadcast, dense_client_update(task, client_optimizer), server_update,
                     personal_predict=None, global_predict=global_model_predict(model), varying_cohort=True,
                     hparams={"server_optimizer": kind})


@register_algorithm("fedavg", FEDAVG_OPTIONS, description="federated averaging of local SGD; --option "
                    "server_optimizer=momentum|adam|yogi|adagrad (with server_lr) for FedAvgM, FedAdam, FedYogi, "
                    "FedAdagrad", paper="McMahan et al., AISTATS 2017")
def fedavg(task: Task, *, momentum, weight_decay, server_lr, weighted, clip_norm, server_optimizer,
           **server_hparams) -> Algorithm:
    check_server_options("fedavg", server_optimizer, server_hparams, FEDAVG_OPTIONS)
    return build_fedavg(task, momentum=momentum, weight_decay=weight_decay, server_lr=server_lr, weighted=weighted,
                        clip_norm=clip_norm, server_optimizer=server_optimizer, **server_hparams)


def _register_server_optimizer(name: str, optimizer: str, options, description: str, paper: str):
    """``name``: FedAvg with ``optimizer`` fixed, its options those its optimiser reads."""
    @register_algorithm(name, options, description=description, paper=paper)
    def builder(task: Task, **given) -> Algorithm:
        check_server_options(name, optimizer, given, {})
        return build_fedavg(task, name=name, server_optimizer=optimizer, **{**CLIENT_OPTIONS, **given})
    builder.__doc__ = f"FedAvg with --option server_optimizer={optimizer} ({description})."
    return builder


def _adaptive_options(optimizer: str, server_lr: float) -> dict:
    reads = [key for key, readers in READ_BY.items() if optimizer in readers]
    return dict(server_lr=server_lr, **{key: SERVER_HPARAMS[key] for key in reads}, **CLIENT_OPTIONS)


# FedAvgM keeps its options of before (server_momentum: Hsu et al.'s beta; momentum: the clients'), its state
# (velocity) and its numbers.
fedavgm = _register_server_optimizer("fedavgm", "momentum",
                                     dict(server_momentum=0.9, server_lr=1.0, momentum=0.0, weighted=True),
                                     "FedAvg with server momentum (fedavg --option server_optimizer=momentum)",
                                     "Hsu et al. 2019")
# Default server lr 0.01: a starting point to tune (docs/design.md, "FedAvg's server optimisers").
fedadam = _register_server_optimizer("fedadam", "adam", _adaptive_options("adam", 0.01),
                                     "FedAvg whose server applies Adam (fedavg --option server_optimizer=adam)",
                                     "Reddi et al., ICLR 2021")
fedyogi = _register_server_optimizer("fedyogi", "yogi", _adaptive_options("yogi", 0.01),
                                     "FedAvg whose server applies Yogi (fedavg --option server_optimizer=yogi)",
                                     "Reddi et al., ICLR 2021")
fedadagrad = _register_server_optimizer("fedadagrad", "adagrad", _adaptive_options("adagrad", 0.01),
                                        "FedAvg whose server applies Adagrad (fedavg --option "
                                        "server_optimizer=adagrad)", "Reddi et al., ICLR 2021")


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
