"""Plain supervised local training shared by the FedAvg family of algorithms."""
from __future__ import annotations

from typing import Callable

import jax
import optax

from fedjax_sparse.data.federated import ClientData
from fedjax_sparse.models.base import Hooks, Model, NO_HOOKS
from fedjax_sparse.core.training import Batch, masked_cross_entropy, model_rng, run_local_epochs


def sgd(lr: optax.ScalarOrSchedule, momentum: float = 0.0, weight_decay: float = 0.0, clip_norm: float | None = None):
    """SGD as PyTorch defines it (weight decay added to the gradient)."""
    parts = []
    if clip_norm:
        parts.append(optax.clip_by_global_norm(clip_norm))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.sgd(lr, momentum=momentum or None))
    return optax.chain(*parts)


def sgd_step(model: Model, optimizer: optax.GradientTransformation, params: dict, stats: dict, opt_state,
             batch: Batch, rng: jax.Array, hooks: Hooks = NO_HOOKS,
             extra_loss: Callable[[dict], jax.Array] | None = None,
             grad_transform: Callable[[dict], dict] | None = None):
    """One optimiser step on ``batch``'s masked cross-entropy (+ ``extra_loss(params)``) through
    ``hooks``, ``rng`` the model's own randomness. Returns (params, batch_stats, opt_state, loss)."""
    def loss_fn(params, stats, batch: Batch, rng):
        logits, new_stats = model.apply({"params": params, "batch_stats": stats}, batch.x,
                                        train=True, hooks=hooks, sample_mask=batch.mask, rng=rng)
        loss = masked_cross_entropy(logits, batch.y, batch.mask)
        if extra_loss is not None:
            loss = loss + extra_loss(params)
        return loss, new_stats

    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, batch, rng)
    if grad_transform is not None:
        grads = grad_transform(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_stats, opt_state, loss


def local_train(model: Model, optimizer: optax.GradientTransformation, variables: dict,
                opt_state, data: ClientData, key: jax.Array, *, epochs: int, batch_size: int,
                preprocess: Callable, hooks: Hooks = NO_HOOKS,
                extra_loss: Callable[[dict], jax.Array] | None = None,
                grad_transform: Callable[[dict], dict] | None = None):
    """Trains ``variables["params"]`` with cross-entropy (+ ``extra_loss(params)``).

    ``grad_transform`` edits gradients before the optimiser (SCAFFOLD's
    control-variate correction). Returns (variables, opt_state, LocalStats).
    """
    def step(carry, batch, step_index, num_steps, step_key):
        params, stats, opt_state, loss = sgd_step(model, optimizer, *carry, batch, model_rng(step_key), hooks,
                                                  extra_loss, grad_transform)
        return (params, stats, opt_state), loss

    carry = (variables["params"], variables.get("batch_stats", {}), opt_state)
    (params, stats, opt_state), stats_out = run_local_epochs(
        step, carry, data, key, epochs=epochs, batch_size=batch_size, preprocess=preprocess)
    return {"params": params, "batch_stats": stats}, opt_state, stats_out


def predict_fn(model: Model, variables: dict, hooks: Hooks = NO_HOOKS):
    return lambda x: model.apply(variables, x, train=False, hooks=hooks)[0]
