"""HeteroFL (Diao, Ding & Tarokh, ICLR 2021): width-scaled nested sub-models.

A client of rate p trains the first ``ceil(p C)`` output channels of every layer but the last; the
server averages every entry over the sampled clients holding it (:func:`per_entry_mean`).
``sliced=True`` trains the cut-out sub-model, ``sliced=False`` the full model with the dropped
channels zeroed (same numbers, dense cost). Details and costs: docs/baselines.md, "HeteroFL".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sparse.errors import arg
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics, mean_weights
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.fedavg_family import model_server
from fedjax_sparse.algorithms.supervised import local_train, sgd
from fedjax_sparse.mechanisms.widths import WidthLayout, per_entry_mean
from fedjax_sparse.models.base import NO_HOOKS, Model, check_layer_kinds

def width_layout(model: Model, name: str, sliced: bool, whose: str) -> WidthLayout:
    """The model's WidthLayout, once it is checked to take width scaling (HeteroFL's and FjORD's):
    dense/conv layers, each hidden layer's channels droppable beyond ``whose`` width, and, ``sliced``,
    widths its own code does not fix (a Flax module cannot run a cut-out sub-model)."""
    if sliced and model.fixed_widths:
        raise ValueError(f"{name}: model {model.name} fixes its layers' widths in its own code (a Flax module), so "
                         f"no narrower sub-model can be cut out of it; add {arg('option', 'sliced=false')} (the full "
                         "model with the dropped channels zeroed: the same numbers as slicing, tested on the zoo)")
    check_layer_kinds(model, name, ("dense", "conv"), "narrows dense/conv layers' output channels",
                      other_macs=False, grouped=False)
    model.check_unit_drops(name, [layer.name for layer in model.layers[:-1]],
                           f"zeroes each hidden layer's channels beyond {whose} width")
    return WidthLayout.from_model(model, model.init(jax.random.PRNGKey(0)))


def parse_rates(rates: str) -> tuple[float, ...]:
    try:
        values = tuple(float(r) for r in str(rates).split(",") if r.strip())
    except ValueError:
        values = ()
    if not values or not all(0.0 < r <= 1.0 for r in values):
        raise ValueError(f"heterofl: rates must be comma-separated numbers in (0, 1], got {rates!r}")
    return values


# ---------------------------------------------------------------- the algorithm
@dataclasses.dataclass(frozen=True)
class HeteroFLOptions:
    rates: str = "0.5"          # width levels; client c trains level c % len(levels) (SpaFL: 0.5 for all)
    eval_rate: float = 0.0      # width of the evaluated global model (0: the largest rate)
    momentum: float = 0.0       # the clients' SGD momentum
    weighted: bool = False      # data-size weighted per-entry mean (False: each holder counts once)
    sliced: bool = True         # train the cut-out sub-model (False: the full model, dropped channels zeroed)


class HeteroFLServerState(NamedTuple):
    variables: dict   # the global (full-width) model


class HeteroFLMessage(NamedTuple):
    counts: jax.Array   # [L] int32 kept output channels (the client's level)
    variables: dict     # the client's model (only the held entries are read)

# Why --aggregator / --attack (algorithms.compose) cannot wrap the width-scaled algorithms (FjORD too).
WIDTH_UNWRAPPABLE = ("its clients send sub-models of different widths with their integer widths, which the "
                     "server averages entry by entry over the clients holding each entry")


def width_server(model: Model, layout: WidthLayout, state, weighted: bool, eval_counts, sliced: bool):
    """(``init``, ``broadcast``, ``entry_mean``, ``global_predict``) of a width-scaled server (HeteroFL's,
    FjORD's) holding the full-width model as ``state(variables)``: ``entry_mean(server, messages, ctx)`` is
    the new state, every entry the (data-size ``weighted`` or uniform) mean over the sampled clients holding
    it (:func:`per_entry_mean`); ``global_predict``: the global model cut to ``eval_counts``."""
    def entry_mean(server, messages: HeteroFLMessage, ctx):
        held = jax.vmap(lambda c: layout.held(server.variables, c))(messages.counts)
        weights = mean_weights(ctx, weighted)
        return state(per_entry_mean(server.variables, messages.variables, held, weights))

    def global_predict(server, x):
        return layout.predict(model, server.variables, eval_counts, sliced)(x)
    return *model_server(model, state), entry_mean, global_predict


@register_algorithm("heterofl", HeteroFLOptions, unwrappable=WIDTH_UNWRAPPABLE,
                    description="HeteroFL: clients train width-scaled sub-models", paper="Diao et al., ICLR 2021")
def heterofl(task: Task, *, rates: str, eval_rate: float, momentum: float, weighted: bool,
             sliced: bool) -> Algorithm:
    model = task.model
    layout = width_layout(model, "heterofl", sliced, "a client's")
    levels = parse_rates(rates)
    table = jnp.asarray([layout.static_counts(r) for r in levels], jnp.int32)   # [levels, L]
    eval_counts = layout.static_counts(eval_rate or max(levels))
    optimizer = sgd(task.lr, momentum)
    init, broadcast, entry_mean, global_predict = width_server(model, layout, HeteroFLServerState, weighted,
                                                               eval_counts, sliced)

    def train(variables, data, key, hooks):
        return local_train(model, optimizer, variables, optimizer.init(variables["params"]), data, key,
                           epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess,
                           hooks=hooks)

    def train_sliced(static, variables, data, key):
        new_sub, _, stats = train(layout.slice(variables, static), data, key, NO_HOOKS)
        return layout.unslice(variables, new_sub, static), stats

    branches = [functools.partial(train_sliced, layout.static_counts(level)) for level in levels]

    def client_update(variables, client_state, data, ctx):
        level = ctx.client_id % len(levels)
        counts = table[level]
        if not sliced:
            new_vars, _, stats = train(variables, data, ctx.key, layout.hooks(counts))
        else:   # one level: switch calls its branch directly
            new_vars, stats = jax.lax.switch(level, branches, variables, data, ctx.key)
        bits = layout.bits(counts)
        metrics = client_metrics(
            loss=stats.loss, flops=layout.training_flops(counts, stats.num_examples), uplink_bits=bits,
            downlink_bits=bits, density=layout.fraction(counts), num_examples=stats.num_examples)
        return client_state, HeteroFLMessage(counts, new_vars), metrics

    def server_update(server: HeteroFLServerState, messages: HeteroFLMessage, ctx):
        return entry_mean(server, messages, ctx), {}

    return Algorithm("heterofl", init, broadcast, client_update, server_update, global_predict=global_predict,
                     hparams=dict(rates=levels, eval_rate=eval_rate or max(levels), sliced=sliced))
