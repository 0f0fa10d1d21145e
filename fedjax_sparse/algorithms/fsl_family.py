"""FSL: Federated Supermask Learning, and Sparse-FSL (seed 003, Algorithms 1-3).

Clients train edge-popup scores over one seed's frozen supernetwork and upload each layer's ranking
of the edges (Sparse-FSL: only its top ``upload_fraction``); the server's VOTE turns the rankings
into the global one; malicious clients submit the reverse (App. A.1). The round, the options, the
communication count, the deviations and the simulation shortcuts: docs/fsl.md.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.errors import arg
from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.algorithms.robust import LR_SCHEDULES, local_lr, make_threat
from fedjax_sparse.algorithms.supervised import predict_fn
from fedjax_sparse.mechanisms import attacks
from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.models.base import Hooks
from fedjax_sparse.core.training import Batch, masked_cross_entropy, model_rng, run_local_epochs

FSL_OPTIONS = dict(subnet_fraction=0.5, upload_fraction=1.0, weight_init="signed_constant", mask_by="abs",
                   momentum=0.9, weight_decay=1e-4, lr_decay=0.999, lr_schedule="cosine_epoch",
                   malicious_fraction=0.0, attack="reverse", attacker_knowledge="malicious_population",
                   attacker_clients=25, malicious_seed=-1)
FSL_KNOWLEDGE = ("malicious_population",) + attacks.KNOWLEDGE


class FslServerState(NamedTuple):
    """Server state of FSL and Sparse-FSL (clients keep nothing); every field is {layer: ...}."""
    kernels: dict         # {layer: kernel-shaped} the global subnetwork's masked kernels (evaluation cache)
    ranking: dict         # {layer: [n_l] int32} the global ranking R_g, least to most important edge
    sorted_scores: dict   # {layer: [n_l]} the seed's initial scores, sorted ascending
    weights: dict         # {layer: kernel-shaped} the seed's frozen weights


def _kernel_shapes(task: Task, name: str) -> dict:
    """{layer: kernel shape}; FSL needs a model made of kernels only."""
    variables = jax.eval_shape(task.model.init, jax.random.PRNGKey(0))
    extra = {f"{layer}.{k}" for layer, p in variables["params"].items() for k in p if k != "kernel"}
    if extra or jax.tree_util.tree_leaves(variables.get("batch_stats", {})):
        raise ValueError(f"{name}: every weight must be a supernetwork edge, but model {task.model.name!r} "
                         f"has biases/BatchNorm ({sorted(extra)[:3]}...); use a bias-free model such as "
                         "fsl_lenet or conv8")
    return {layer.name: tuple(layer.kernel_shape) for layer in task.model.layers}


def global_kernels(ranking: dict, weights: dict, sorted_scores: dict, fraction: float, mask_by: str) -> dict:
    """The global subnetwork's kernels ``w * mask`` for a global ranking (per layer)."""
    out = {}
    for name, w in weights.items():
        if mask_by == "raw":
            mask = sm.mask_from_ranking(ranking[name], fraction)
        else:
            scores = jnp.abs(sm.reorder_scores(sorted_scores[name], ranking[name]))
            mask = sm.topk_mask(scores, fraction, nonnegative=True)
        out[name] = w * mask.reshape(w.shape)
    return out


def fsl_local_step(model, optimizer: optax.GradientTransformation, params: dict, subnet_fraction: float,
                   mask_by: str, lr: jax.Array, carry: tuple, batch: Batch,
                   rng: jax.Array | None = None) -> tuple[tuple, jax.Array]:
    """One edge-popup step: the frozen ``params`` masked by the top ``subnet_fraction`` of
    each layer's scores (straight-through gradient to the scores), SGD ``scores -= lr * update``.
    ``carry``: (scores {layer: kernel-shaped}, optimizer state); ``rng``: the model's own randomness
    (its dropout: ``training.model_rng(step_key)``). Returns (carry, loss)."""
    scores, opt_state = carry

    def loss_fn(scores):
        hooks = Hooks(kernel=lambda layer, w: w * sm.supermask(scores[layer], subnet_fraction, mask_by))
        logits, _ = model.apply({"params": params, "batch_stats": {}}, batch.x, train=True, hooks=hooks,
                                sample_mask=batch.mask, rng=rng)
        return masked_cross_entropy(logits, batch.y, batch.mask)

    loss, grads = jax.value_and_grad(loss_fn)(scores)
    updates, opt_state = optimizer.update(grads, opt_state, scores)
    scores = jax.tree_util.tree_map(lambda s, u: s - lr * u, scores, updates)
    return (scores, opt_state), loss

# Why --aggregator / --attack (algorithms.compose) cannot wrap FSL: it has its own vote and attack.
FSL_UNWRAPPABLE = ("its clients send rankings (integers), not float updates, and the server votes on them (FSL has "
                   f"its own attack: {arg('option', 'malicious_fraction=F')})")


@register_algorithm("fsl", FSL_OPTIONS, unwrappable=FSL_UNWRAPPABLE,
                    description="FSL: federated supermask learning, clients exchange edge rankings of a frozen "
                    "network", paper="ICLR 2022 submission; docs/fsl.md")
def fsl(task: Task, *, subnet_fraction, upload_fraction, weight_init, mask_by, momentum, weight_decay,
        lr_decay, lr_schedule, malicious_fraction, attack, attacker_knowledge, attacker_clients, malicious_seed,
        name="fsl") -> Algorithm:
    for option, value in (("subnet_fraction", subnet_fraction), ("upload_fraction", upload_fraction)):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name}: {option} must be in (0, 1], got {value}")
    for option, value, valid in (("weight_init", weight_init, sm.WEIGHT_INITS), ("mask_by", mask_by, sm.MASK_BY),
                                 ("lr_schedule", lr_schedule, LR_SCHEDULES), ("attack", attack, ("none", "reverse")),
                                 ("attacker_knowledge", attacker_knowledge, FSL_KNOWLEDGE)):
        if value not in valid:
            raise ValueError(f"{name}: unknown {option} {value!r}; valid: {', '.join(valid)}")
    model = task.model
    shapes = _kernel_shapes(task, name)
    sizes = {layer: math.prod(shape) for layer, shape in shapes.items()}
    sparse = upload_fraction < 1.0
    up_bits = sm.ranking_bits(list(sizes.values()), upload_fraction)
    down_bits = sm.ranking_bits(list(sizes.values()))
    population = attacker_knowledge == "malicious_population"
    threat = make_threat(task, malicious_fraction, "malicious" if population else attacker_knowledge, malicious_seed)
    attacking = threat.active and attack == "reverse"
    malicious_ids = np.flatnonzero(threat.mask).astype(np.int32)
    if attacker_clients < 0:
        raise ValueError(f"{name}: attacker_clients must be >= 0 (0 = every malicious client), got {attacker_clients}")
    num_attacker_clients = len(malicious_ids) if attacker_clients == 0 else min(attacker_clients, len(malicious_ids))
    epochs = task.local_epochs
    optimizer = optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(decay=momentum))

    def init(key):
        # Each layer's fan-in from its traced contraction (an attention projection's is not its kernel's shape).
        weights, scores = sm.supernet_from_seed(key, shapes, weight_init,
                                                {layer.name: layer.fan_in for layer in model.layers})
        pinned = task.initial_variables
        if pinned is not None:   # --init-params: frozen weights (and scores, when given) from the file
            weights = {layer: jnp.asarray(pinned["params"][layer]["kernel"]) for layer in shapes}
            scores = {layer: jnp.asarray(pinned.get("scores", {}).get(layer, scores[layer])) for layer in shapes}
        flat = {layer: s.reshape(-1) for layer, s in scores.items()}
        ranking = {layer: sm.ranking(v) for layer, v in flat.items()}            # R_g^1 = ARGSORT(theta_s)
        sorted_scores = {layer: flat[layer][ranking[layer]] for layer in flat}   # SORT(theta_s)
        kernels = global_kernels(ranking, weights, sorted_scores, subnet_fraction, mask_by)
        return FslServerState(kernels=kernels, ranking=ranking, sorted_scores=sorted_scores, weights=weights), ()

    def broadcast(server_state: FslServerState, round_index):
        return {"ranking": server_state.ranking, "weights": server_state.weights,
                "sorted_scores": server_state.sorted_scores}

    def client_update(payload, client_state, data, ctx):
        params = {layer: {"kernel": w} for layer, w in payload["weights"].items()}
        scores = {layer: sm.reorder_scores(payload["sorted_scores"][layer], payload["ranking"][layer])
                  .reshape(shapes[layer]) for layer in shapes}

        def step(carry, batch, step_index, num_steps, key):
            lr = local_lr(task.lr, lr_decay, ctx.round, step_index, num_steps, epochs, lr_schedule)
            return fsl_local_step(model, optimizer, params, subnet_fraction, mask_by, lr, carry, batch,
                                  model_rng(key))

        (scores, _), stats = run_local_epochs(step, (scores, optimizer.init(scores)), data, ctx.key,
                                              epochs=epochs, batch_size=task.batch_size,
                                              preprocess=task.preprocess)
        rankings = {layer: sm.ranking(s) for layer, s in scores.items()}
        if sparse:
            rankings = {layer: sm.top_of_ranking(r, upload_fraction) for layer, r in rankings.items()}
        metrics = client_metrics(
            loss=stats.loss, flops=accounting.training_flops(model, stats.num_examples),
            uplink_bits=up_bits, downlink_bits=down_bits, density=subnet_fraction,
            num_examples=stats.num_examples)
        return client_state, rankings, metrics

    def attacker_training(server_state, key, round_index, sampled_ids):
        """The malicious clients whose benign rankings the attacker votes over this round."""
        ids = jax.random.choice(key, jnp.asarray(malicious_ids), (num_attacker_clients,), replace=False)
        return ids.astype(jnp.int32), threat.split(sampled_ids)[0].any()

    def server_update(server_state: FslServerState, messages, ctx):
        is_mal, known = threat.split(ctx.client_ids)
        if attacking:
            knowledge = ctx.extra_messages if population else None
            messages = jax.lax.cond(
                is_mal.any(), lambda m: attacks.reverse_attack(m, sizes, is_mal, known, upload_fraction, knowledge),
                lambda m: m, messages)
        if sparse:
            ranking = {layer: sm.vote_sparse(m, sizes[layer]) for layer, m in messages.items()}
        else:
            ranking = {layer: sm.vote(m) for layer, m in messages.items()}
        kernels = global_kernels(ranking, server_state.weights, server_state.sorted_scores,
                                 subnet_fraction, mask_by)
        new = server_state._replace(kernels=kernels, ranking=ranking)
        return new, {"malicious_clients": is_mal.sum()}

    def global_predict(server_state: FslServerState, x):
        params = {layer: {"kernel": k} for layer, k in server_state.kernels.items()}
        return predict_fn(model, {"params": params, "batch_stats": {}})(x)

    return Algorithm(name, init, broadcast, client_update, server_update,
                     personal_predict=None, global_predict=global_predict,
                     extra_clients=attacker_training if attacking and population else None)


@register_algorithm("sfsl", dict(FSL_OPTIONS, upload_fraction=0.5), unwrappable=FSL_UNWRAPPABLE,
                    description="Sparse-FSL: FSL whose clients upload only their top ranks",
                    paper="FSL paper; docs/fsl.md")
def sfsl(task: Task, **options) -> Algorithm:
    """Sparse-FSL: FSL whose clients upload only their top ``upload_fraction`` ranks."""
    return fsl(task, name="sfsl", **options)
