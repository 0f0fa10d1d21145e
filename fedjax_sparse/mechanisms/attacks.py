"""Model-poisoning attacks by colluding malicious clients, as pure array functions.

One threat model for every attack: ``Threat`` (a fixed, seeded subset of client ids,
``malicious_clients``, and what the attackers know, ``KNOWLEDGE``), whose ``split(client_ids)`` gives
a round's ``is_malicious`` [K] (the rows an attack replaces) and ``known`` [K] (the rows the attacker
sees). Deciding when and how to attack: ``fedjax_sparse.algorithms.compose.with_attack`` (float updates
of any algorithm), SignSGD in ``fedjax_sparse.algorithms.robust`` and FSL in
``fedjax_sparse.algorithms.fsl_family`` (docs/design.md, "Composition: any attack meets any aggregator").
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.mechanisms.robust_aggregation import (masked_mean, multi_krum_select, pairwise_sq_distances,
                                                          sort_rows, trimmed_mean_with_copies)

DEVIATIONS = ("std", "sign", "unit_vec")
KNOWLEDGE = ("all", "malicious")


def malicious_clients(num_clients: int, fraction: float, seed: int) -> np.ndarray:
    """[N] bool: the first floor(fraction * N) clients of a seeded permutation."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"malicious_fraction must be in [0, 1), got {fraction}")
    count = int(math.floor(fraction * num_clients))
    mask = np.zeros(num_clients, bool)
    mask[np.random.default_rng(seed).permutation(num_clients)[:count]] = True
    return mask


class Threat:
    """Who is malicious and what the attackers know, as static numpy data.

    ``mask`` [N] bool: ``malicious_clients(num_clients, fraction, seed)``, fixed
    for the whole run; ``active``: ``fraction > 0`` (an inactive threat never
    attacks); ``knowledge`` (``KNOWLEDGE``): the malicious clients of a round
    collude and see ``all`` the sampled clients' honest updates, or only their
    ``malicious`` own."""

    def __init__(self, num_clients: int, fraction: float, knowledge: str = "all", seed: int = 0):
        if knowledge not in KNOWLEDGE:
            raise ValueError(f"unknown attacker_knowledge {knowledge!r}; valid: {', '.join(KNOWLEDGE)}")
        self.mask = malicious_clients(num_clients, fraction, seed)
        self.active = fraction > 0
        self.fraction = fraction
        self.knowledge = knowledge

    def split(self, client_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[K] sampled ids -> (is_malicious [K], known [K]) bool."""
        is_mal = jnp.asarray(self.mask)[client_ids]
        known = is_mal if self.knowledge == "malicious" else jnp.ones_like(is_mal)
        return is_mal, known


def deviation(updates: jax.Array, known: jax.Array, kind: str) -> jax.Array:
    """The perturbation direction ``dev`` ([P]); the attack subtracts gamma * dev."""
    mean = masked_mean(updates, known)
    if kind == "unit_vec":
        return mean / jnp.maximum(jnp.linalg.norm(mean), 1e-12)
    if kind == "sign":
        return jnp.sign(mean)
    if kind == "std":
        w = known.astype(updates.dtype)
        var = (w @ jnp.square(updates - mean)) / jnp.maximum(w.sum() - 1.0, 1.0)
        return jnp.sqrt(var)
    raise ValueError(f"unknown deviation {kind!r}; valid: {DEVIATIONS}")


def halving_search(accept, gamma_init: float, steps: int, carry_init=None):
    """Shejwalkar & Houmansadr's search for the largest accepted gamma.

    Starts at ``gamma_init``; after each test moves gamma up (accepted) or down
    by a step that halves every time (gamma_init / 2, / 4, ...). ``accept(gamma,
    carry) -> (bool, carry)``. Returns the last accepted gamma (0 if none).
    """
    def body(_, state):
        gamma, step, best, carry = state
        ok, carry = accept(gamma, carry)
        best = jnp.where(ok, gamma, best)
        gamma = jnp.where(ok, gamma + step, gamma - step)
        return gamma, step / 2, best, carry

    g0 = jnp.float32(gamma_init)
    state = (g0, g0 / 2, jnp.float32(0.0), carry_init)
    return jax.lax.fori_loop(0, steps, body, state)[2]


def min_max_attack(updates, is_malicious, known, *, kind="std", gamma_init=10.0, steps=20):
    """AGR-agnostic min-max (Shejwalkar & Houmansadr, NDSS 2021): replaces the malicious rows of [K, P]
    by mean - gamma * dev (``deviation``: ``std``, ``sign`` or ``unit_vec``), gamma from ``halving_search``."""
    mean = masked_mean(updates, known)
    dev = deviation(updates, known, kind)
    d2 = pairwise_sq_distances(updates)
    both = known[:, None] & known[None, :]
    max_benign = jnp.max(jnp.where(both, d2, 0.0))
    diff = mean[None, :] - updates
    a, b, c = jnp.sum(diff * diff, 1), diff @ dev, jnp.sum(dev * dev)

    def accept(gamma, carry):
        dist = a - 2.0 * gamma * b + gamma * gamma * c   # |mean - gamma dev - delta_i|^2
        return jnp.max(jnp.where(known, dist, 0.0)) <= max_benign, carry

    gamma = halving_search(accept, gamma_init, steps)
    malicious = mean - gamma * dev
    return jnp.where(is_malicious[:, None], malicious[None, :], updates), gamma


def tailored_trimmed_mean_attack(updates, is_malicious, known, trim, *, kind="std", gamma_init=10.0,
                                 steps=20):
    """DYN-OPT (AGR-tailored) against Trimmed-mean: keeps gamma while |TrMean(messages) - mean| grows."""
    mean = masked_mean(updates, known)
    dev = deviation(updates, known, kind)
    benign = ~is_malicious
    sorted_benign = sort_rows(updates, benign)
    n_benign = benign.sum()
    valid = (jnp.arange(updates.shape[0]) < n_benign)[:, None]
    prefix = jnp.concatenate([jnp.zeros_like(updates[:1]),
                              jnp.cumsum(jnp.where(valid, sorted_benign, 0.0), axis=0)], axis=0)
    copies = is_malicious.sum()

    def accept(gamma, prev_loss):
        agg = trimmed_mean_with_copies(sorted_benign, prefix, n_benign, mean - gamma * dev, copies, trim)
        loss = jnp.linalg.norm(agg - mean)
        return loss > prev_loss, loss

    gamma = halving_search(accept, gamma_init, steps, carry_init=jnp.float32(-1.0))
    malicious = mean - gamma * dev
    return jnp.where(is_malicious[:, None], malicious[None, :], updates), gamma


def tailored_multi_krum_attack(updates, is_malicious, known, f, num_select, *, kind="std",
                               gamma_init=10.0, steps=20):
    """DYN-OPT (AGR-tailored) against Multi-Krum: keeps gamma while every malicious update is selected."""
    mean = masked_mean(updates, known)
    dev = deviation(updates, known, kind)
    d2_honest = pairwise_sq_distances(updates)
    diff = mean[None, :] - updates
    a, b, c = jnp.sum(diff * diff, 1), diff @ dev, jnp.sum(dev * dev)
    mal = is_malicious
    count = mal.sum()

    def accept(gamma, carry):
        to_mal = jnp.maximum(a - 2.0 * gamma * b + gamma * gamma * c, 0.0)   # |mal - delta_i|^2
        d2 = jnp.where(mal[:, None] & mal[None, :], 0.0,
                       jnp.where(mal[:, None], to_mal[None, :],
                                 jnp.where(mal[None, :], to_mal[:, None], d2_honest)))
        selected = multi_krum_select(d2, f, num_select)
        return (selected & mal).sum() == count, carry

    gamma = halving_search(accept, gamma_init, steps)
    malicious = mean - gamma * dev
    return jnp.where(is_malicious[:, None], malicious[None, :], updates), gamma


def scale_attack(updates, is_malicious, model, scale: float):
    """The FSL authors' attack on plain FedAvg: the malicious rows of [K, P] become ``scale``
    times ``model`` [P] (the current global model, flattened like the rows)."""
    return jnp.where(is_malicious[:, None], (scale * model)[None, :], updates)


def sign_reverse_attack(signs, is_malicious, known):
    """SignSGD: malicious rows become -sign(sum of the known signs) (ties -> -1)."""
    votes = (signs.astype(jnp.int32) * known[:, None].astype(jnp.int32)).sum(0)
    reverse = jnp.where(votes >= 0, -1, 1).astype(signs.dtype)
    return jnp.where(is_malicious[:, None], reverse[None, :], signs)


def reverse_attack(messages: dict, sizes: dict, is_malicious, known, upload_fraction: float,
                   knowledge: dict | None = None) -> dict:
    """FSL's attack (App. A.1, Alg. 3): the malicious rows become the reverse of the VOTE over the
    attacker's benign rankings: ``knowledge`` ({layer: [M, ...]}) when given,
    else the rows of ``messages`` with ``known`` true."""
    out = {}
    for name, msg in messages.items():
        source, include = (msg, known) if knowledge is None else (knowledge[name], None)
        if upload_fraction >= 1.0:
            aggregate = sm.vote(source, include=include)
            bad = sm.reverse_ranking(aggregate)
        else:
            aggregate = sm.vote_sparse(source, sizes[name], include=include)
            bad = sm.top_of_ranking(sm.reverse_ranking(aggregate), upload_fraction)
        out[name] = jnp.where(is_malicious[:, None], bad[None, :], msg)
    return out


__all__ = ["DEVIATIONS", "KNOWLEDGE", "Threat", "deviation", "halving_search", "malicious_clients", "min_max_attack",
           "reverse_attack", "scale_attack", "sign_reverse_attack", "tailored_multi_krum_attack",
           "tailored_trimmed_mean_attack"]
