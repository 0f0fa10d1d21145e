"""FjORD (Horváth et al., NeurIPS 2021): ordered dropout.

Every local step samples a width p ~ U(p_min, p_max) (SpaFL's setting, appendix
A.1.1: U(0.4, 0.6)) and trains the sub-model of the first ``ceil(p C)``
channels of every layer but the last (HeteroFL's nested slices,
``mechanisms.widths.WidthLayout``), so the p = 0.4 sub-model is a prefix of the p = 0.6
one and channels beyond the step's width get exactly zero gradient (their
activations are zeroed; see ``heterofl``). The same p holds for every layer of
a step; clients and steps draw independently (the client's private key).

Communication: the client downloads the p_max sub-model (it cannot know its
draws in advance) and uploads the sub-model it actually touched, the prefix of
its largest sampled width (an exact, data-dependent count); 32 bits per value.
Aggregation: as FjORD's Alg. 1 and HeteroFL, every entry is averaged over the
sampled clients whose uploaded sub-model holds it (uniform, or data-size
weighted); entries no client held keep their value.
Evaluation: the global model cut to ``eval_rate`` (default p_max, the widest
trained sub-model).
Realisation (``sliced=True``, default): the client trains the p_max sub-model
cut out of the broadcast model (``WidthLayout.slice``, static shapes), with each
step's narrower width applied by zeroing activations inside it; ``sliced=False``
zeroes them in the full model (the same computation, tested, at dense cost).
Left out: FjORD's optional self-distillation (KD) and its discrete width set /
per-device tiers (SpaFL samples p continuously, all clients alike).

FLOPs: exact, 6 x the MACs of each step's sub-model x the step's real examples
(per layer ``sum_steps in_kept * out_kept * examples``, an int32 count: enough
for LeNet/CNN-sized layers and local rounds, not for 10^9 channel-pair-examples).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics
from fedjax_sparse.algorithms.heterofl_family import WIDTH_UNWRAPPABLE, HeteroFLMessage, width_layout
from fedjax_sparse.mechanisms.widths import WidthLayout, per_entry_mean
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.supervised import sgd
from fedjax_sparse.models.base import Model
from fedjax_sparse.core.training import masked_cross_entropy, model_rng, run_local_epochs


def sample_width(key: jax.Array, p_min: float, p_max: float) -> jax.Array:
    """One step's width p ~ U(p_min, p_max)."""
    return jax.random.uniform(key, (), jnp.float32, p_min, p_max)


def ordered_dropout_train(model: Model, layout: WidthLayout, optimizer: optax.GradientTransformation,
                          variables: dict, data, key: jax.Array, *, p_min: float, p_max: float, epochs: int,
                          batch_size: int, preprocess):
    """Local SGD where step s trains the width-p_s sub-model (p_s drawn from the
    step's key). Returns (variables, LocalStats, widest counts [L], pair-examples [L])."""
    def loss_fn(params, stats, batch, hooks, rng):
        logits, new_stats = model.apply({"params": params, "batch_stats": stats}, batch.x,
                                        train=True, hooks=hooks, sample_mask=batch.mask, rng=rng)
        return masked_cross_entropy(logits, batch.y, batch.mask), new_stats

    def step(carry, batch, step_index, num_steps, step_key):
        params, stats, opt_state, widest, pair_examples = carry
        counts = layout.counts(sample_width(step_key, p_min, p_max))
        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, batch,
                                                                            layout.hooks(counts),
                                                                            model_rng(step_key))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        examples = batch.mask.sum().astype(jnp.int32)
        carry = (params, new_stats, opt_state, jnp.maximum(widest, counts),
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

    def init(key):
        return FjORDServerState(model.init(key)), ()

    def broadcast(server: FjORDServerState, round_index):
        return server.variables

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
        held = jax.vmap(lambda c: layout.held(server.variables, c))(messages.counts)
        weights = ctx.weights if weighted else jnp.ones_like(ctx.weights)
        new = per_entry_mean(server.variables, messages.variables, held, weights)
        return FjORDServerState(new), {"mean_upload_fraction": jax.vmap(layout.fraction)(messages.counts).mean()}

    def global_predict(server: FjORDServerState, x):
        return layout.predict(model, server.variables, eval_counts, sliced)(x)

    return Algorithm("fjord", init, broadcast, client_update, server_update, global_predict=global_predict,
                     hparams=dict(p_min=p_min, p_max=p_max, eval_rate=eval_rate or p_max, sliced=sliced))
