"""Composition: robust aggregators and model-poisoning attacks as wrappers around
any algorithm whose client messages are float pytrees (FedAvg, FedAvgM,
FedProx, SCAFFOLD, SpaFL's thresholds, FedDrop's models...), so every attack
meets every aggregator. An algorithm whose clients send something else (FSL's
integer rankings, SignSGD's signs, FedPM's masks, HeteroFL's and FjORD's
sub-models, nothing at all for Local) declares it when it registers
(``register_algorithm(..., unwrappable=...)``), and ``config.validate`` refuses
``--aggregator`` / ``--attack`` around it in one line before anything is built.

    alg = with_attack(with_aggregator(make_algorithm("spafl", task), "trimmed_mean"),
                      "min_max", malicious_fraction=0.2, seed=0)

The server side of a round then runs, outermost first: the attack replaces the
sampled malicious clients' messages, the aggregator reduces the [K, P]
flattened messages to one robust aggregate and hands the wrapped server K
copies of it, so a server that (weighted-)averages its messages applies the
robust aggregate exactly; then the wrapped ``server_update`` runs unchanged.
A server that uses the individual messages beyond their mean (FedDrop's
trajectory similarity) sees K identical rows: wrap such algorithms with an
attack only, or read the result knowing that.

The mechanisms themselves live in ``fedjax_sparse.mechanisms`` (trimmed mean,
Multi-Krum, the min-max attack); ``algorithms/robust.py`` keeps the FSL paper's
FedAvg-based baselines with their own training schedule (its Table 2).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedjax_sparse.algorithms.base import Algorithm
from fedjax_sparse.mechanisms.attacks import malicious_clients, min_max_attack
from fedjax_sparse.mechanisms.robust_aggregation import krum_count, multi_krum, trimmed_mean

WRAPPER_AGGREGATORS = ("mean", "trimmed_mean", "multi_krum")
WRAPPER_ATTACKS = ("min_max",)


def flatten_messages(messages):
    """Stacked messages (leaves [K, ...], all floating) -> ([K, P] float32, unravel of one row)."""
    leaves = jax.tree_util.tree_leaves(messages)
    if not leaves:
        raise TypeError("robust wrappers need client messages, but the clients send nothing (e.g. Local, SpaFL "
                        "with share_thresholds=false); wrap an algorithm whose clients send float updates")
    bad = [leaf.dtype for leaf in leaves if not jnp.issubdtype(leaf.dtype, jnp.floating)]
    if bad:
        raise TypeError(f"robust wrappers need float client messages, got dtypes {sorted(set(map(str, bad)))} "
                        "(FSL's rankings have their own VOTE and reverse-ranking attack)")
    first = jax.tree_util.tree_map(lambda x: x[0], messages)
    _, unravel = ravel_pytree(first)
    flat = jax.vmap(lambda m: ravel_pytree(m)[0])(messages).astype(jnp.float32)
    return flat, unravel


def with_aggregator(alg: Algorithm, aggregator: str, *, trim_fraction: float = 0.1) -> Algorithm:
    """``alg`` whose server sees the robust aggregate of its clients' messages.

    ``trimmed_mean`` drops the ``floor(trim_fraction * K)`` largest and smallest
    values of every coordinate; ``multi_krum`` assumes that many malicious
    clients and averages the ``K - 2f - 2`` it selects; ``mean`` is the uniform mean."""
    if aggregator not in WRAPPER_AGGREGATORS:
        raise ValueError(f"unknown aggregator {aggregator!r}; valid: {', '.join(WRAPPER_AGGREGATORS)}")
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")

    def server_update(server_state, messages, ctx):
        flat, unravel = flatten_messages(messages)
        k = flat.shape[0]
        f = int(math.floor(trim_fraction * k))
        metrics = {}
        if aggregator == "trimmed_mean":
            aggregate = trimmed_mean(flat, jnp.int32(f))
        elif aggregator == "multi_krum":
            aggregate, selected = multi_krum(flat, jnp.int32(f), krum_count(k, jnp.int32(f)))
            metrics["krum_selected"] = selected.sum()
        else:
            aggregate = flat.mean(0)
        row = unravel(aggregate)
        robust = jax.tree_util.tree_map(lambda leaf, ref: jnp.broadcast_to(leaf, ref.shape).astype(ref.dtype),
                                        row, messages)
        new_state, inner_metrics = alg.server_update(server_state, robust, ctx)
        return new_state, {**inner_metrics, **metrics}

    return dataclasses.replace(alg, name=f"{alg.name}+{aggregator}", server_update=server_update,
                               hparams={**alg.hparams, "aggregator": aggregator, "trim_fraction": trim_fraction})


def with_attack(alg: Algorithm, attack: str, *, num_clients: int, malicious_fraction: float, seed: int = 0,
                knowledge: str = "all", deviation: str = "std", gamma_init: float = 10.0,
                search_steps: int = 20) -> Algorithm:
    """``alg`` under a model-poisoning attack by a fixed ``malicious_fraction`` of its clients.

    ``min_max`` (Shejwalkar & Houmansadr 2021, AGR-agnostic): every sampled
    malicious client sends ``mean - gamma * dev`` of the known benign updates
    (``knowledge``: ``all`` sampled clients' or only the ``malicious`` ones'),
    with the largest gamma whose distance to every benign update stays within
    their largest pairwise distance. Updates are taken relative to the
    broadcast payload when messages have its structure (FedAvg's models), else
    the messages themselves are perturbed (SpaFL's thresholds)."""
    if attack not in WRAPPER_ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; valid: {', '.join(WRAPPER_ATTACKS)}")
    if knowledge not in ("all", "malicious"):
        raise ValueError(f"unknown knowledge {knowledge!r}; valid: all, malicious")
    mask = jnp.asarray(malicious_clients(num_clients, malicious_fraction, seed))
    if not bool(np.any(np.asarray(mask))):
        raise ValueError(f"malicious_fraction={malicious_fraction} of {num_clients} clients makes no client malicious")

    def server_update(server_state, messages, ctx):
        is_mal = mask[ctx.client_ids]
        known = jnp.ones_like(is_mal) if knowledge == "all" else is_mal
        flat, unravel = flatten_messages(messages)
        payload = alg.broadcast(server_state, ctx.round)
        row_structure = jax.tree_util.tree_structure(jax.tree_util.tree_map(lambda x: x[0], messages))
        if jax.tree_util.tree_structure(payload) == row_structure:
            reference = ravel_pytree(payload)[0].astype(jnp.float32)
        else:
            reference = jnp.zeros(flat.shape[1], jnp.float32)
        attacked, gamma = min_max_attack(flat - reference[None], is_mal, known, kind=deviation,
                                         gamma_init=gamma_init, steps=search_steps)
        rows = jax.vmap(unravel)(attacked + reference[None])
        poisoned = jax.tree_util.tree_map(lambda new, ref: new.astype(ref.dtype), rows, messages)
        poisoned = jax.lax.cond(is_mal.any(), lambda: poisoned, lambda: messages)
        new_state, metrics = alg.server_update(server_state, poisoned, ctx)
        return new_state, {**metrics, "malicious_clients": is_mal.sum(), "attack_gamma": gamma}

    return dataclasses.replace(alg, name=f"{alg.name}+{attack}", server_update=server_update,
                               hparams={**alg.hparams, "attack": attack, "malicious_fraction": malicious_fraction})
