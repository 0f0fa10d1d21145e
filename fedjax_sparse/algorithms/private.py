"""Client-level differential privacy: DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning
Differentially Private Recurrent Language Models", ICLR 2018) as a wrapper around any algorithm
whose clients send float updates.

    alg = with_dp(make_algorithm("fedavg", task), clip_norm=1.0, noise_multiplier=1.0,
                  clients_per_round=task.clients_per_round)

Clip each update to C, sum, add N(0, (z C)^2) per coordinate, divide by the fixed K. What an update
is, what is refused, exactness, what the guarantee covers, the server metrics: docs/privacy.md,
"How the wrapper works".
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedjax_sparse.errors import arg
from fedjax_sparse.core.algorithm import Algorithm, ServerContext
from fedjax_sparse.algorithms.baselines import CaldasServerState, ScaffoldServerState
from fedjax_sparse.algorithms.compose import StatisticsSplit, UpdateServer, flatten_messages
from fedjax_sparse.algorithms.feddrop_family import FedDropServerState
from fedjax_sparse.algorithms.registry import algorithm_entry, algorithm_names, resolve_options, wrapper_refusal
from fedjax_sparse.algorithms.spafl_family import SpaflServerState

# Folded into the round's server key for the noise: an algorithm whose server draws from ``ctx.key``
# itself then never sees the same numbers as the noise.
DP_NOISE_STREAM = 0x44504E   # "DPN"
DP_REFUSAL = ("DP-FedAvg clips and noises float updates, and no DP mechanism for rankings, masks, signs or "
              "widths is implemented")
DROPOUT_REFUSAL = ("with optimize=true its server re-optimises each sampled client's keep probabilities from that "
                   "client's own returned model (trajectory similarity), a per-client use of the messages that the "
                   "private mean does not cover")


# ---------------------------------------------------------------------------- the mechanism
def clip_rows(flat: jax.Array, clip_norm: float) -> tuple[jax.Array, jax.Array]:
    """[K, P] updates -> (each row scaled to L2 norm at most ``clip_norm`` [K, P], their norms before
    clipping [K]); a row within the bound is returned bit for bit (``inf``: the identity)."""
    flat = flat.astype(jnp.float32)
    norms = jnp.sqrt(jnp.sum(jnp.square(flat), axis=1))
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norms, jnp.finfo(jnp.float32).tiny))
    return flat * scale[:, None], norms


def noisy_sum(clipped: jax.Array, stddev: float, key: jax.Array) -> jax.Array:
    """[K, P] clipped updates -> their sum [P] plus N(0, stddev^2) per coordinate (exact for ``stddev == 0``)."""
    total = jnp.sum(clipped, axis=0)
    if stddev == 0:
        return total
    return total + stddev * jax.random.normal(key, total.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class DpMechanism:
    """DP-FedAvg's Gaussian mechanism on K flattened updates [K, P]: clip to ``clip_norm`` C, sum, add
    N(0, (z C)^2) (z = ``noise_multiplier``), divide by ``clients_per_round`` K. docs/privacy.md."""
    clip_norm: float
    noise_multiplier: float
    clients_per_round: int

    def __post_init__(self):
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 (inf: no clipping), got {self.clip_norm}")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier}")
        if self.noise_multiplier > 0 and math.isinf(self.clip_norm):
            raise ValueError("noise_multiplier > 0 needs a finite clip_norm (the noise is noise_multiplier * "
                             "clip_norm; without clipping an update's influence is unbounded)")
        if self.clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {self.clients_per_round}")

    @property
    def noise_stddev(self) -> float:
        """Standard deviation of the noise added to the sum: z C (0 when z = 0, whatever C)."""
        return self.noise_multiplier * self.clip_norm if self.noise_multiplier else 0.0

    def __call__(self, updates: jax.Array, key: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """[K, P] updates -> (private mean [P] float32, server metrics). ``mask`` [capacity]: a Poisson
        cohort's real slots (padded rows are zeroed; the sum is still divided by K, the expected size)."""
        k = updates.shape[0]
        if mask is None and k != self.clients_per_round:
            # The accountant and the 1/K denominator assume exactly K sampled clients per round.
            raise ValueError(f"with_dp(clients_per_round={self.clients_per_round}) received {k} client updates; "
                             "pass the engine's clients_per_round")
        clipped, norms = clip_rows(updates, self.clip_norm)
        real = jnp.ones((k,), jnp.float32) if mask is None else mask.astype(jnp.float32)
        mean = noisy_sum(clipped * real[:, None], self.noise_stddev, key) / self.clients_per_round
        count = jnp.maximum(real.sum(), 1.0)
        metrics = {"dp_clipped_fraction": jnp.sum((norms > self.clip_norm).astype(jnp.float32) * real) / count,
                   "dp_update_norm": jnp.sum(norms * real) / count}
        return mean, metrics


def noise_key(ctx: ServerContext) -> jax.Array:
    """The noise's key: the round's server key folded with ``DP_NOISE_STREAM``."""
    return jax.random.fold_in(ctx.key, DP_NOISE_STREAM)


# ---------------------------------------------------------------------------- what an update is relative to
def same_structure(a, b) -> bool:
    """Whether pytrees ``a`` and ``b`` have one tree structure (then they ravel in the same order)."""
    return bool(jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b))  # type: ignore[operator]


def update_reference(payload, row):
    """What one client's message ``row`` is relative to, a pytree shaped like ``row``, or None (zero:
    the message is an update already). docs/privacy.md lists what an update is."""
    if same_structure(payload, row):
        return payload
    if isinstance(payload, SpaflServerState):
        return payload.tau
    if isinstance(payload, CaldasServerState):
        return payload.variables
    if isinstance(payload, ScaffoldServerState):
        return {**jax.tree_util.tree_map(jnp.zeros_like, row), "variables": payload.variables}
    if isinstance(payload, FedDropServerState):
        return {"variables": payload.variables}
    return None


# Top-level message keys, by the broadcast payload's type, of cost bookkeeping that passes through unclipped
# (clipped with the model, a count would dominate the norm; it reaches no server state). docs/privacy.md.
ACCOUNTING_KEYS: dict[type, tuple[str, ...]] = {FedDropServerState: ("sampled_flops",)}


def accounting_keys(payload, messages) -> tuple[str, ...]:
    """The top-level keys of ``messages`` (a dict, one row or stacked) that ``with_dp`` passes to the
    inner server unchanged, outside the mechanism: ``ACCOUNTING_KEYS`` of the payload's type."""
    if not isinstance(messages, dict):
        return ()
    keys = next((keys for kind, keys in ACCOUNTING_KEYS.items() if isinstance(payload, kind)), ())
    return tuple(key for key in keys if key in messages)


def _check_float_messages(name: str, messages) -> None:
    """One-line TypeError for empty or non-float messages (the mechanism clips float vectors)."""
    leaves = jax.tree_util.tree_leaves(messages)
    if not leaves:
        raise TypeError(f"with_dp cannot wrap {name}: its clients send nothing; {DP_REFUSAL}")
    bad = sorted({str(leaf.dtype) for leaf in leaves if not jnp.issubdtype(leaf.dtype, jnp.floating)})
    if bad:
        raise TypeError(f"with_dp cannot wrap {name}: its clients send {', '.join(bad)} values, not float updates; "
                        f"{DP_REFUSAL}")


@dataclasses.dataclass(frozen=True)
class PrivateServer:
    """``server_update`` of an algorithm behind DP-FedAvg's ``mechanism`` (docs/privacy.md, "How the
    wrapper works"). ``broadcast``: the algorithm's; ``reference``: ``update_reference``'s signature;
    ``name``: for errors; ``accounting``: ``accounting_keys``'s signature."""
    server_update: Callable[[Any, Any, ServerContext], tuple[Any, dict]]
    mechanism: DpMechanism
    broadcast: Callable[[Any, jax.Array], Any]
    reference: Callable[[Any, Any], Any] = update_reference
    name: str = "the algorithm"
    accounting: Callable[[Any, Any], tuple[str, ...]] = accounting_keys
    # Filled while the round is traced: "statistics", how many running-statistics values a client's
    # message holds (released without noise; ``released_statistics``).
    seen: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __call__(self, server_state, messages, ctx: ServerContext):
        _check_float_messages(self.name, messages)
        inner = self.server_update
        mask = getattr(ctx, "mask", None)
        if mask is not None:
            # Poisson: the mechanism masks the padded rows; the inner server sees copies of the private mean,
            # also in an empty round (what is released must not depend on the cohort's size).
            ctx = ctx._replace(mask=None, weights=jnp.ones_like(ctx.weights))
        if isinstance(inner, UpdateServer) and inner.aggregator is None:
            # The updates themselves; the private mean replaces the server's own (weighted or uniform) one.
            aggregate, metrics = self.mechanism(messages, noise_key(ctx), mask)
            return inner.apply(server_state, aggregate), metrics
        payload = self.broadcast(server_state, ctx.round)
        passed = self.accounting(payload, messages)
        updates = {k: v for k, v in messages.items() if k not in passed} if passed else messages
        row = jax.tree_util.tree_map(lambda x: x[0], updates)
        ref_tree = self.reference(payload, row)
        if ref_tree is not None and not same_structure(ref_tree, row):
            raise TypeError(f"with_dp: the reference of {self.name}'s messages must have their structure "
                            f"{jax.tree_util.tree_structure(row)}, got {jax.tree_util.tree_structure(ref_tree)}")
        # BatchNorm running statistics stay out of the mechanism (docs/privacy.md): their plain mean.
        split = StatisticsSplit.of(updates)
        others, statistics = split.split(updates)
        if statistics and "statistics" not in self.seen:
            self.seen["statistics"] = sum(math.prod(leaf.shape[1:]) for leaf in statistics)
            warnings.warn(f"with_dp: {self.name}'s clients send {self.seen['statistics']} BatchNorm running "
                          "statistics; they are averaged without noise (noise drives running variances negative), "
                          "so dp_epsilon covers the parameters, not them; for a guarantee over the whole model use "
                          "GroupNorm or LayerNorm", stacklevel=2)
        flat, unravel = flatten_messages(others)
        ref_others, ref_stats = split.split(ref_tree) if ref_tree is not None else (None, None)
        if ref_others is None:
            reference = jnp.zeros(flat.shape[1], jnp.float32)
        else:
            reference = ravel_pytree(ref_others)[0].astype(jnp.float32)
        aggregate, metrics = self.mechanism(flat - reference[None], noise_key(ctx), mask)
        private_row = split.join(unravel(reference + aggregate), statistics_mean(statistics, mask, ref_stats))
        private = jax.tree_util.tree_map(lambda leaf, m: jnp.broadcast_to(leaf, m.shape).astype(m.dtype),
                                         private_row, updates)
        if passed:   # the accounting leaves as the clients sent them, in the messages' key order
            private = {k: messages[k] if k in passed else private[k] for k in messages}
        new_state, inner_metrics = inner(server_state, private, ctx)
        return new_state, {**inner_metrics, **metrics}


def statistics_mean(statistics: list, mask: jax.Array | None, reference: list | None) -> list:
    """The clients' running statistics (leaves [K, ...]) -> their uniform mean over the real clients
    (``mask``: a Poisson cohort's real slots), without clipping or noise; an empty round keeps
    ``reference`` (the broadcast model's; zeros without one). A mean of running variances is >= 0."""
    if mask is None:
        return [leaf.astype(jnp.float32).mean(0) for leaf in statistics]
    real = mask.astype(jnp.float32)
    count = real.sum()
    out = []
    for i, leaf in enumerate(statistics):
        total = jnp.tensordot(real, leaf.astype(jnp.float32), axes=1)
        kept = reference[i].astype(jnp.float32) if reference is not None else jnp.zeros(leaf.shape[1:], jnp.float32)
        out.append(jnp.where(count > 0, total / jnp.maximum(count, 1.0), kept))
    return out


def released_statistics(alg: Algorithm) -> int:
    """How many BatchNorm running-statistics values a client of ``alg`` (wrapped by ``with_dp``, possibly
    inside ``with_attack``) sends that DP-FedAvg averages without noise: known once the round has been
    traced (0 before, and for messages without statistics)."""
    server: Any = alg.server_update
    while server is not None and not isinstance(server, PrivateServer):
        server = getattr(server, "inner", None)   # with_attack's server keeps the one it wraps there
    return int(server.seen.get("statistics", 0)) if server is not None else 0


# ---------------------------------------------------------------------------- the wrapper
def dp_refusal(name: str, options: Any = None) -> str | None:
    """Why ``with_dp`` cannot wrap registered algorithm ``name`` with these options (one line), or
    None when it can: the algorithms whose clients send something other than float updates (the
    registry's ``unwrappable=``), and FedDrop with ``optimize=True`` (its default; ``DROPOUT_REFUSAL``).
    ``options``: a dict (CLI strings are coerced) or the options instance; a ValueError for invalid ones."""
    if name == "feddrop" and resolve_options(name, options).optimize:
        return f"with_dp cannot wrap {name}: {DROPOUT_REFUSAL}; use {arg('option', 'optimize=false')} or " \
               f"{arg('algorithm', 'unidrop')}"
    reason = wrapper_refusal(name, options)
    return None if reason is None else f"with_dp cannot wrap {name}: {reason}; {DP_REFUSAL}"


def _registered_options(alg: Algorithm) -> tuple[str, dict] | None:
    """(registered name, its options from ``alg.hparams``) of an algorithm built by the registry, or None."""
    name = alg.name.split("+")[0]
    if name not in algorithm_names():
        return None
    fields = {f.name for f in dataclasses.fields(algorithm_entry(name).options)}
    return name, {k: v for k, v in alg.hparams.items() if k in fields}


def with_dp(alg: Algorithm, *, clip_norm: float, noise_multiplier: float, clients_per_round: int,
            reference: Callable[[Any], Any] | None = None) -> Algorithm:
    """``alg`` whose server sees DP-FedAvg's private mean of its clients' updates (docs/privacy.md).

    ``clip_norm`` C (``inf``: no clipping), ``noise_multiplier`` z (noise z C on the sum),
    ``clients_per_round`` K: the fixed denominator, the engine's cohort size (clients' weights ignored).
    ``reference(payload)``: what a message is relative to, shaped like one client's message; None:
    ``update_reference``. Wrap it outermost among the aggregator wrappers; an attack may wrap it.
    Raises TypeError in one line for a registered algorithm ``dp_refusal`` refuses (``alg.hparams``)."""
    registered = _registered_options(alg)
    if registered is not None:
        refusal = dp_refusal(*registered)
        if refusal is not None:
            raise TypeError(refusal)
    mechanism = DpMechanism(float(clip_norm), float(noise_multiplier), int(clients_per_round))
    resolve = update_reference if reference is None else (lambda payload, row: reference(payload))
    server = PrivateServer(alg.server_update, mechanism, alg.broadcast, resolve, alg.name)
    hparams = {**alg.hparams, "dp_clip_norm": mechanism.clip_norm, "dp_noise_multiplier": mechanism.noise_multiplier,
               "dp_clients_per_round": mechanism.clients_per_round}
    return dataclasses.replace(alg, name=f"{alg.name}+dp", server_update=server, hparams=hparams)


__all__ = ["ACCOUNTING_KEYS", "DP_NOISE_STREAM", "DP_REFUSAL", "DROPOUT_REFUSAL", "DpMechanism", "PrivateServer",
           "accounting_keys", "clip_rows", "dp_refusal", "noise_key", "noisy_sum", "released_statistics",
           "same_structure", "statistics_mean", "update_reference", "with_dp"]
