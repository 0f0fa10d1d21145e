"""The local training loop over one client's padded data (docs/design.md, "Replicas": the local loop).

As in the papers' PyTorch code, a client runs ``epochs`` passes over *its own* samples, each a fresh
shuffle cut into ``ceil(count / batch_size)`` batches, the last one partial (``drop_last=False``) and
masked, so padding never enters a loss or metric. The loop is a ``fori_loop`` of the client's own trip
count (under ``vmap``: the longest client's, the finished ones frozen by a select).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.data.federated import ClientData


class Batch(NamedTuple):
    x: jax.Array     # [B, ...] float32, preprocessed
    y: jax.Array     # [B] int32
    mask: jax.Array  # [B] float32, 1 for real samples, 0 for padding


class LocalStats(NamedTuple):
    loss: jax.Array         # [] mean training loss over all samples seen
    num_steps: jax.Array    # [] int32
    num_examples: jax.Array  # [] int32: epochs * count (samples processed)


StepFn = Callable[[object, Batch, jax.Array, jax.Array, jax.Array], tuple[object, jax.Array]]


# The model's own randomness (its dropout layers) draws from ``fold_in(step_key, MODEL_RNG_STREAM)``: a
# stream of its own, so it changes no other draw a step makes (models without dropout are unchanged).
MODEL_RNG_STREAM = 0x6D6F64  # "mod"


# The name scope of one local training step (``run_local_epochs``), which tells its loop apart in a program.
LOCAL_STEP_SCOPE = "local_step"


# Set while tracing a round whose local loops are left out (``without_local_steps``): what the round costs
# besides its steps, so that a cost analysis of the whole round less this one is the cost of one step.
_WITHOUT_LOCAL_STEPS = contextvars.ContextVar("fedjax_sparse_without_local_steps", default=False)


@contextlib.contextmanager
def without_local_steps():
    """Code traced in this block runs no local step: ``run_local_epochs`` returns its carry as it got it
    (a trace-time choice, for ``programs.local_step_cost``; never a run mode)."""
    token = _WITHOUT_LOCAL_STEPS.set(True)
    try:
        yield
    finally:
        _WITHOUT_LOCAL_STEPS.reset(token)


def model_rng(step_key: jax.Array) -> jax.Array:
    """The key a local training step passes to ``Model.apply(..., train=True, rng=...)`` for the model's
    own randomness (a Flax model's dropout): derived from the step's key, so the same seed gives the
    same numbers; evaluation passes none (dropout off)."""
    return jax.random.fold_in(step_key, MODEL_RNG_STREAM)


def steps_per_epoch(count: jax.Array, batch_size: int) -> jax.Array:
    return (count + batch_size - 1) // batch_size


def epoch_orders(key: jax.Array, count: jax.Array, max_n: int, epochs: int,
                 shuffle: bool = True) -> jax.Array:
    """[epochs, max_n] positions into the client's index row: the ``count``
    valid positions first (shuffled per epoch), padding positions last."""
    positions = jnp.arange(max_n)
    if not shuffle:
        return jnp.broadcast_to(positions, (epochs, max_n))
    # One 1-D draw per epoch: with partitionable threefry (JAX's default) element
    # i depends only on (key, i), so the shuffle of a client's real samples does
    # not change with the padding width -- padded and unpadded clients agree.
    noise = jnp.stack([jax.random.uniform(jax.random.fold_in(key, e), (max_n,)) for e in range(epochs)])
    noise = jnp.where(positions[None, :] < count, noise, 2.0)
    return jnp.argsort(noise, axis=1).astype(jnp.int32)


def gather_batch(data: ClientData, order: jax.Array, start: jax.Array, batch_size: int,
                 preprocess: Callable[[jax.Array], jax.Array]) -> Batch:
    """Batch of positions order[start:start+B]; positions >= count are masked."""
    padded = jnp.concatenate([order, jnp.zeros((batch_size,), order.dtype)])
    positions = jax.lax.dynamic_slice(padded, (start,), (batch_size,))
    valid = (start + jnp.arange(batch_size)) < data.count
    pool_idx = data.indices[positions]
    x = preprocess(data.x[pool_idx])
    y = data.y[pool_idx]
    return Batch(x, y, valid.astype(jnp.float32))


def run_local_epochs(step_fn: StepFn, carry, data: ClientData, key: jax.Array, *, epochs: int,
                     batch_size: int, preprocess: Callable[[jax.Array], jax.Array],
                     shuffle: bool = True):
    """Runs ``step_fn(carry, batch, step, num_steps, key) -> (carry, loss)``
    over ``epochs`` passes of the client's data. Returns (carry, LocalStats)."""
    max_n = data.indices.shape[0]
    key_order, key_steps = jax.random.split(key)
    orders = epoch_orders(key_order, data.count, max_n, epochs, shuffle)
    spe = steps_per_epoch(data.count, batch_size)
    num_steps = epochs * spe

    def body(step, state):
        carry, loss_sum = state
        epoch, b = step // jnp.maximum(spe, 1), step % jnp.maximum(spe, 1)
        batch = gather_batch(data, orders[epoch], b * batch_size, batch_size, preprocess)
        # The scope names the step's ops in the program's metadata (fedjax_sparse.tools.programs counts its kernels).
        with jax.named_scope(LOCAL_STEP_SCOPE):
            carry, loss = step_fn(carry, batch, step, num_steps, jax.random.fold_in(key_steps, step))
        return carry, loss_sum + loss * batch.mask.sum()

    if _WITHOUT_LOCAL_STEPS.get():
        loss_sum = jnp.zeros((), jnp.float32)
    else:
        carry, loss_sum = jax.lax.fori_loop(0, num_steps, body, (carry, jnp.zeros((), jnp.float32)))
    examples = epochs * data.count
    return carry, LocalStats(loss_sum / jnp.maximum(examples, 1), num_steps, examples)


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over the real (mask=1) samples."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
