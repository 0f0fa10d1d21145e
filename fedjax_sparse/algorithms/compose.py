"""Composition: robust aggregators and model-poisoning attacks as wrappers around
any algorithm whose client messages are float pytrees, so every attack meets
every aggregator (docs/design.md, "Composition"). An algorithm whose clients
send something else declares it when it registers
(``register_algorithm(..., unwrappable=...)``).

    alg = with_attack(with_aggregator(make_algorithm("spafl", task), "trimmed_mean"),
                      "min_max", malicious_fraction=0.2, num_clients=task.num_clients, seed=0)

Outermost first, the attack replaces the sampled malicious clients' messages, then the aggregator
reduces them to one robust aggregate: applied exactly by an ``UpdateServer``, handed to any other
server as K copies. Pass the same ``mechanisms.attacks.Threat`` to both wrappers for aggregators
that know how many malicious clients were sampled (``trim_fraction < 0``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedjax_sparse.core.algorithm import Algorithm, ServerContext
from fedjax_sparse.mechanisms.attacks import (DEVIATIONS, Threat, min_max_attack, scale_attack,
                                              tailored_multi_krum_attack, tailored_trimmed_mean_attack)
from fedjax_sparse.mechanisms.robust_aggregation import krum_count, masked_mean, multi_krum, trimmed_mean

WRAPPER_AGGREGATORS = ("mean", "trimmed_mean", "multi_krum")
# What ``--attack`` offers (config.validate reads it); ``with_attack`` takes every one of ATTACKS.
WRAPPER_ATTACKS = ("min_max",)
ATTACKS = ("none", "min_max", "tailored", "scale")


# The collection of a model's variables that holds BatchNorm running statistics (models.base): not
# parameters, so the wrappers (and algorithms.private) only average them (docs/design.md, "Composition").
STATISTICS = "batch_stats"


def _is_statistics(path) -> bool:
    return any(isinstance(key, jax.tree_util.DictKey) and key.key == STATISTICS for key in path)


@dataclasses.dataclass(frozen=True)
class StatisticsSplit:
    """Which leaves of a message pytree are running statistics (under a ``batch_stats`` key, at any depth:
    FedAvg's ``{"params", "batch_stats"}``, SCAFFOLD's and FedDrop's ``{"variables": {...}, ...}``).

    ``split(tree) -> (other leaves, statistics leaves)``, both lists in flatten order (a list is a pytree:
    ``flatten_messages`` and ``ravel_pytree`` take it); ``join`` puts them back. A tree of the same
    structure (one client's row, the broadcast model) splits the same way."""
    treedef: Any
    statistics: tuple[bool, ...]

    @classmethod
    def of(cls, tree) -> "StatisticsSplit":
        paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        return cls(treedef, tuple(_is_statistics(path) for path, _ in paths))

    def split(self, tree) -> tuple[list, list]:
        leaves = self.treedef.flatten_up_to(tree)
        return ([leaf for leaf, stat in zip(leaves, self.statistics) if not stat],
                [leaf for leaf, stat in zip(leaves, self.statistics) if stat])

    def join(self, others, statistics):
        others, statistics = iter(others), iter(statistics)
        return self.treedef.unflatten([next(statistics) if stat else next(others) for stat in self.statistics])


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


@dataclasses.dataclass(frozen=True)
class Aggregator:
    """A robust aggregator of K flattened client updates [K, P].

    ``name``: ``mean`` (uniform), ``trimmed_mean`` (drops the f largest and f
    smallest values of every coordinate, at most (K - 1) // 2: the median) or
    ``multi_krum`` (averages the ``K - 2f - 2`` updates it selects, at least 1;
    ``krum_select`` > 0 overrides the count). f, the number of malicious
    clients the aggregator assumes among K, is ``floor(trim_fraction * K)``, or
    with ``trim_fraction < 0`` the number of malicious clients the ``threat``
    says the round sampled (the FSL paper's setting: the server knows it)."""
    name: str
    trim_fraction: float = 0.1
    krum_select: int = -1
    threat: Threat | None = None

    def __post_init__(self):
        if self.name not in WRAPPER_AGGREGATORS:
            raise ValueError(f"unknown aggregator {self.name!r}; valid: {', '.join(WRAPPER_AGGREGATORS)}")
        if self.trim_fraction < 0 and self.threat is None:
            raise ValueError(f"trim_fraction={self.trim_fraction} < 0 (f = the sampled malicious clients) needs "
                             "the threat: with_aggregator(..., threat=Threat(...))")

    def assumed_malicious(self, k: int, client_ids: jax.Array) -> jax.Array:
        """[] int32: f for a round of ``k`` clients ``client_ids``."""
        if self.trim_fraction < 0:
            assert self.threat is not None   # __post_init__
            return self.threat.split(client_ids)[0].sum()
        return jnp.int32(int(math.floor(self.trim_fraction * k)))

    def num_select(self, k: int, f: jax.Array) -> jax.Array:
        """How many updates Multi-Krum averages."""
        return krum_count(k, f, self.krum_select)

    def __call__(self, flat: jax.Array, ctx: ServerContext, statistics: jax.Array | None = None):
        """[K, P] -> (aggregate [P], server metrics). Multi-Krum reports how many of the
        sampled malicious clients it selected (``malicious_selected``) when it knows the
        threat, else how many updates it selected (``krum_selected``).

        ``statistics`` [K, S] (the clients' running statistics, ``StatisticsSplit``): then returns
        (aggregate, metrics, statistics' aggregate [S]) too, by the same rows: the coordinate-wise trimmed
        mean, the mean of the updates Multi-Krum selected (by the updates' distances alone), the mean. Each
        a mean of some clients' values, so a running variance stays >= 0."""
        k = flat.shape[0]
        f = self.assumed_malicious(k, ctx.client_ids)
        metrics = {}
        if self.name == "trimmed_mean":
            aggregate, reduce = trimmed_mean(flat, f), (lambda rows: trimmed_mean(rows, f))
        elif self.name == "multi_krum":
            aggregate, selected = multi_krum(flat, f, self.num_select(k, f))
            reduce = lambda rows: masked_mean(rows, selected)
            metrics = ({"krum_selected": selected.sum()} if self.threat is None
                       else {"malicious_selected": (selected & self.threat.split(ctx.client_ids)[0]).sum()})
        else:
            aggregate, reduce = flat.mean(0), (lambda rows: rows.mean(0))
        return (aggregate, metrics) if statistics is None else (aggregate, metrics, reduce(statistics))


@dataclasses.dataclass(frozen=True)
class UpdateServer:
    """The server of an algorithm whose clients send flat float updates [P] (``w_local -
    w_global``) that it averages and applies: ``apply(server_state, mean(updates, ctx))``.

    ``mean(updates [K, P], ctx) -> [P]``: the algorithm's own average (FedAvg's
    weighted or uniform one); ``apply(server_state, aggregate [P]) -> server_state``;
    ``model(server_state) -> [P]``: the global model flattened like the updates (what
    the scale attack multiplies). ``aggregator``: set by ``with_aggregator``, which
    replaces ``mean`` by it, so the robust aggregate is applied exactly."""
    mean: Callable[[jax.Array, ServerContext], jax.Array]
    apply: Callable[[Any, jax.Array], Any]
    model: Callable[[Any], jax.Array]
    aggregator: Aggregator | None = None

    def __call__(self, server_state, updates: jax.Array, ctx: ServerContext):
        if self.aggregator is None:
            return self.apply(server_state, self.mean(updates, ctx)), {}
        aggregate, metrics = self.aggregator(updates, ctx)
        return self.apply(server_state, aggregate), metrics


@dataclasses.dataclass(frozen=True)
class AggregatingServer:
    """``server_update`` of any algorithm (not an ``UpdateServer``) behind a robust
    ``aggregator``: the server receives K copies of the aggregate of its flattened messages."""
    server_update: Callable[[Any, Any, ServerContext], tuple[Any, dict]]
    aggregator: Aggregator

    def __call__(self, server_state, messages, ctx: ServerContext):
        # Running statistics neither decide nor get decided like updates: the aggregator selects and
        # trims by the parameters alone and reduces the statistics over the same rows.
        split = StatisticsSplit.of(messages)
        others, statistics = split.split(messages)
        flat, unravel = flatten_messages(others)
        if statistics:
            flat_stats, unravel_stats = flatten_messages(statistics)
            aggregate, metrics, stats_aggregate = self.aggregator(flat, ctx, flat_stats)
            statistics = unravel_stats(stats_aggregate)
        else:
            aggregate, metrics = self.aggregator(flat, ctx)
        row = split.join(unravel(aggregate), statistics)
        robust = jax.tree_util.tree_map(lambda leaf, ref: jnp.broadcast_to(leaf, ref.shape).astype(ref.dtype),
                                        row, messages)
        new_state, inner_metrics = self.server_update(server_state, robust, ctx)
        return new_state, {**inner_metrics, **metrics}


def with_aggregator(alg: Algorithm, aggregator: str, *, trim_fraction: float = 0.1, krum_select: int = -1,
                    threat: Threat | None = None) -> Algorithm:
    """``alg`` whose server sees the robust aggregate of its clients' messages (the options and f:
    ``Aggregator``). An ``UpdateServer`` applies the aggregate exactly; any other server receives K
    copies of it."""
    robust = Aggregator(aggregator, trim_fraction, krum_select, threat)
    inner = alg.server_update
    if isinstance(inner, UpdateServer) and inner.aggregator is None:
        server: Callable = dataclasses.replace(inner, aggregator=robust)
    else:
        server = AggregatingServer(inner, robust)
    return dataclasses.replace(alg, name=f"{alg.name}+{aggregator}", server_update=server,
                               hparams={**alg.hparams, "aggregator": aggregator, "trim_fraction": trim_fraction})


def with_attack(alg: Algorithm, attack: str, *, num_clients: int | None = None,
                malicious_fraction: float | None = None, seed: int = 0, knowledge: str = "all",
                threat: Threat | None = None, deviation: str = "std", gamma_init: float = 10.0,
                search_steps: int = 20, attack_scale: float = 1e5) -> Algorithm:
    """``alg`` under a model-poisoning attack by a fixed subset of its clients.

    The malicious clients: ``threat``, or ``Threat(num_clients,
    malicious_fraction, knowledge, seed)`` (then at least one client must be
    malicious). Every sampled malicious client sends the same update, computed
    from the honest updates the attackers know (``knowledge``: ``all`` sampled
    clients' or only the ``malicious`` ones'):

    ``min_max`` (Shejwalkar & Houmansadr 2021): ``mean - gamma * dev`` of the known updates
    (``deviation``: ``std``, ``sign``, ``unit_vec``), gamma from a halving search (``gamma_init``,
    ``search_steps`` tests); ``tailored`` (DYN-OPT) against the ``with_aggregator`` ``alg`` is wrapped
    in (``min_max`` when there is none or it is ``mean``); ``scale``: ``attack_scale`` times the global
    model (an ``UpdateServer`` or model-shaped messages); ``none``: the malicious clients are only
    counted. The formulas: docs/fsl.md, "Baselines".

    Server metrics: ``malicious_clients`` (sampled this round) and
    ``attack_gamma``. An inactive threat (``malicious_fraction`` 0) never attacks."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; valid: {', '.join(ATTACKS)}")
    if deviation not in DEVIATIONS:
        raise ValueError(f"unknown deviation {deviation!r}; valid: {', '.join(DEVIATIONS)}")
    if threat is None:
        if num_clients is None or malicious_fraction is None:
            raise TypeError("with_attack needs threat=Threat(...), or num_clients= and malicious_fraction=")
        threat = Threat(num_clients, malicious_fraction, knowledge, seed)
        if attack != "none" and not threat.mask.any():
            raise ValueError(f"malicious_fraction={malicious_fraction} of {num_clients} clients makes no client "
                             "malicious")
    inner = alg.server_update
    aggregator: Aggregator | None = getattr(inner, "aggregator", None)   # the with_aggregator inside, if any
    firing = threat.active and attack != "none"
    options = dict(kind=deviation, gamma_init=gamma_init, steps=search_steps)

    def poison(updates, is_mal, known, ctx, model):
        """[K, P] float32 updates -> (the attacked updates, gamma); ``model()`` -> [P]."""
        if attack == "scale":
            return scale_attack(updates, is_mal, model(), attack_scale), jnp.float32(0.0)
        if attack == "tailored" and aggregator is not None and aggregator.name != "mean":
            k = updates.shape[0]
            f = aggregator.assumed_malicious(k, ctx.client_ids)
            if aggregator.name == "trimmed_mean":
                return tailored_trimmed_mean_attack(updates, is_mal, known, f, **options)
            return tailored_multi_krum_attack(updates, is_mal, known, f, aggregator.num_select(k, f), **options)
        return min_max_attack(updates, is_mal, known, **options)

    def poison_messages(server_state, messages, is_mal, known, ctx):
        """Any algorithm's float messages: the attack in update space (relative to the payload). Running
        statistics are not attacked: the malicious clients send their own (an attack built from their
        mean and spread would send negative variances, which no client's data can give)."""
        split = StatisticsSplit.of(messages)
        others, statistics = split.split(messages)
        flat, unravel = flatten_messages(others)
        payload = alg.broadcast(server_state, ctx.round)
        model_shaped = jax.tree_util.tree_structure(payload) == jax.tree_util.tree_structure(messages)
        if model_shaped:
            reference = ravel_pytree(split.split(payload)[0])[0].astype(jnp.float32)
        else:
            reference = jnp.zeros(flat.shape[1], jnp.float32)

        def model():
            if not model_shaped:
                raise TypeError(f"the scale attack needs client messages shaped like the broadcast model "
                                f"(FedAvg's models) or an UpdateServer; {alg.name}'s messages are neither")
            return reference

        attacked, gamma = poison(flat - reference[None], is_mal, known, ctx, model)
        rows = split.join(jax.vmap(unravel)(attacked + reference[None]), statistics)
        poisoned = jax.tree_util.tree_map(lambda new, ref: new.astype(ref.dtype), rows, messages)
        return jax.lax.cond(is_mal.any(), lambda: poisoned, lambda: messages), gamma

    def server_update(server_state, messages, ctx):
        is_mal, known = threat.split(ctx.client_ids)
        gamma = jnp.float32(0.0)
        if firing and isinstance(inner, UpdateServer):
            messages, gamma = poison(messages, is_mal, known, ctx, lambda: inner.model(server_state))
        elif firing:
            messages, gamma = poison_messages(server_state, messages, is_mal, known, ctx)
        new_state, metrics = inner(server_state, messages, ctx)
        return new_state, {**metrics, "malicious_clients": is_mal.sum(), "attack_gamma": gamma}
    server_update.inner = inner   # type: ignore[attr-defined]   # what it wraps (private.released_statistics)

    return dataclasses.replace(alg, name=f"{alg.name}+{attack}", server_update=server_update,
                               hparams={**alg.hparams, "attack": attack, "malicious_fraction": threat.fraction})


__all__ = ["ATTACKS", "STATISTICS", "WRAPPER_AGGREGATORS", "WRAPPER_ATTACKS", "AggregatingServer", "Aggregator",
           "StatisticsSplit", "UpdateServer", "flatten_messages", "with_aggregator", "with_attack"]
