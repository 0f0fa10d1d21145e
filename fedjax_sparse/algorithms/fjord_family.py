"""FjORD (Horváth et al., NeurIPS 2021): ordered dropout.

Every local step draws a width p ~ U(p_min, p_max) and trains HeteroFL's nested width-p sub-model
(``mechanisms.widths.WidthLayout``); the server averages every entry over the clients that uploaded
it. Details and costs: docs/baselines.md, "FjORD".
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics
from fedjax_sparse.algorithms.heterofl_family import WIDTH_UNWRAPPABLE, HeteroFLMessage, width_layout, width_server
from fedjax_sparse.mechanisms.widths import WidthLayout
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import sgd, sgd_step
from fedjax_sparse.models.base import Model
from fedjax_sparse.core.training import model_rng, run_local_epochs


def sample_width(key: jax.Array, p_min: float, p_max: float) -> jax.Array:
    """One step's width p ~ U(p_min, p_max)."""
    return jax.random.uniform(key, (), jnp.float32, p_min, p_max)


def ordered_dropout_train(model: Model, layout: WidthLayout, optimizer: optax.GradientTransformation,
                          variables: dict, data, key: jax.Array, *, p_min: float, p_max: float, epochs: int,
                          batch_size: int, preprocess):
    """Local SGD where step s trains the width-p_s sub-model (p_s drawn from the
    step's key). Returns (variables, LocalStats, widest counts [L], pair-examples [L])."""
    def step(carry, batch, step_index, num_steps, step_key):
        params, stats, opt_state, widest, pair_examples = carry
        counts = layout.counts(sample_width(step_key, p_min, p_max))
        params, stats, opt_state, loss = sgd_step(model, optimizer, params, stats, opt_state, batch,
                                                  model_rng(step_key), layout.hooks(counts))
        examples = batch.mask.sum().astype(jnp.int32)
        carry = (params, stats, opt_state, jnp.maximum(widest, counts),
                 pair_examples + layout.pair_counts(counts) * examples)
        return carry, loss

    params = variables["params"]
    zeros = jnp.zeros((len(layout.names),), jnp.int32)
    carry = (params, variables.get("batch_stats", {}), optimizer.init(params), zeros, zeros)
    (params, stats, _, widest, pair_examples), local_stats = run_local_epochs(
        step, carry, data, key, epochs=epochs, batch_size=batch_size, preprocess=preprocess)
    return {"params": params, "batch_stats": stats}, local_stats, widest, pair_examples


@dataclasses.dataclass(frozen=True)
class FjORDOptions:
    p_min: float = 0.4          # per-step width p ~ U(p_min, p_max) (SpaFL: 0.4, 0.6)
    p_max: float = 0.6
    eval_rate: float = 0.0      # width of the evaluated global model (0: p_max)
    momentum: float = 0.0       # the clients' SGD momentum
    weighted: bool = False      # data-size weighted per-entry mean (False: each holder counts once)
    sliced: bool = True         # train the cut-out p_max sub-model (False: the full model, channels zeroed)


class FjORDServerState(NamedTuple):
    variables: dict   # the global (full-width) model


@register_algorithm("fjord", FjORDOptions, unwrappable=WIDTH_UNWRAPPABLE,
                    description="FjORD: ordered dropout, clients train nested width sub-models",
                    paper="Horvath et al., NeurIPS 2021")
def fjord(task: Task, *, p_min: float, p_max: float, eval_rate: float, momentum: float,
          weighted: bool, sliced: bool) -> Algorithm:
    if not 0.0 < p_min <= p_max <= 1.0:
        raise ValueError(f"fjord: need 0 < p_min <= p_max <= 1, got p_min={p_min}, p_max={p_max}")
    model = task.model
    layout = width_layout(model, "fjord", sliced, "a step's")
    download = layout.static_counts(p_max)
    download_bits = accounting.FLOAT_BITS * layout.num_values(download)
    eval_counts = layout.static_counts(eval_rate or p_max)
    optimizer = sgd(task.lr, momentum)
    init, broadcast, entry_mean, global_predict = width_server(model, layout, FjORDServerState, weighted,
                                                               eval_counts, sliced)

    def client_update(variables, client_state, data, ctx):
        trained = layout.slice(variables, download) if sliced else variables
        new_vars, stats, widest, pair_examples = ordered_dropout_train(
            model, layout, optimizer, trained, data, ctx.key, p_min=p_min, p_max=p_max,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess)
        if sliced:
            new_vars = layout.unslice(variables, new_vars, download)
        # A client that ran no step (no data) uploads nothing and is held nowhere.
        metrics = client_metrics(
            loss=stats.loss, flops=accounting.Cost.terms(layout.flops_unit, pair_examples),
            uplink_bits=layout.bits(widest), downlink_bits=download_bits, density=layout.fraction(widest),
            num_examples=stats.num_examples)
        return client_state, HeteroFLMessage(widest, new_vars), metrics

    def server_update(server: FjORDServerState, messages: HeteroFLMessage, ctx):
        upload = jax.vmap(layout.fraction)(messages.counts).mean()
        return entry_mean(server, messages, ctx), {"mean_upload_fraction": upload}

    return Algorithm("fjord", init, broadcast, client_update, server_update, global_predict=global_predict,
                     hparams=dict(p_min=p_min, p_max=p_max, eval_rate=eval_rate or p_max, sliced=sliced))
