"""What an algorithm is: data plus pure functions the round engine calls.

State is explicit. ``server_state`` is everything global (held once);
``client_states`` is everything personal, a pytree whose leaves carry a
leading client axis ``[N, ...]`` (use ``()`` when clients keep nothing between
rounds). One round of the engine is::

    payload = broadcast(server_state, round)                  # once per round
    for each sampled client k (vmap / lax.map, in parallel):
        client_state_k, message_k, metrics_k = client_update(
            payload, client_state_k, train_data_k, ClientContext)
    server_state, server_metrics = server_update(server_state, messages, ServerContext)

``messages`` and the returned client states are stacked over the K sampled
clients. ``client_update``'s metrics hold at least :data:`REQUIRED_CLIENT_METRICS`
(build them with :func:`client_metrics`); the costs (:data:`ACCOUNTING_METRICS`)
are optional, exact :class:`fedjax_sparse.core.accounting.Cost` values, ``null``
in ``metrics.jsonl`` when not counted. Details: docs/design.md, "An algorithm is
data plus pure functions".
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sparse.core.accounting import as_cost
from fedjax_sparse.data.federated import ClientData
from fedjax_sparse.models.base import Model

REQUIRED_CLIENT_METRICS = ("loss", "num_examples")
# Optional: cost accounting and the kept fraction of the model (``null`` when not reported).
ACCOUNTING_METRICS = ("flops", "uplink_bits", "downlink_bits", "density")
# Exact costs (Cost values), summed over clients and rounds on the host.
COST_METRICS = ("flops", "uplink_bits", "downlink_bits")


class ClientContext(NamedTuple):
    """What ``client_update`` knows about its round besides its data."""
    round: jax.Array       # [] int32, same for every client of the round
    client_id: jax.Array   # [] int32, this client's index in [0, N)
    key: jax.Array         # this client's private key for the round
    shared_key: jax.Array  # one key for all clients of the round (synchronised randomness)


class ServerContext(NamedTuple):
    """What ``server_update`` knows about its round besides the messages."""
    round: jax.Array       # [] int32
    client_ids: jax.Array  # [K] int32, the sampled clients (order of ``messages``)
    weights: jax.Array     # [K] float32, the sampled clients' training-set sizes
    key: jax.Array
    # Messages of the round's extra (never aggregated) client updates, stacked [M, ...], and their
    # ids [M]; None unless the algorithm asks for them (``Algorithm.extra_clients``).
    extra_ids: Any = None
    extra_messages: Any = None
    # [K] bool, the real slots of a varying (Poisson) cohort: padded slots (id N, weight 0, zero
    # messages) must contribute nothing (see ``cohort_mean``); None: every slot is real (fixed sampling).
    mask: Any = None


@dataclasses.dataclass(frozen=True)
class Task:
    """Everything an algorithm needs to know about the experiment at build time."""
    model: Model
    num_clients: int
    clients_per_round: int
    local_epochs: int
    batch_size: int
    lr: float
    rounds: int
    preprocess: Callable[[jax.Array], jax.Array]
    # The rest of the command-line/config options an algorithm may read.
    seed: int = 0
    # Pinned initial variables (``--init-params``), or None; ``model.init`` already
    # returns them, this tells algorithms that re-initialise (FSL) to use them.
    initial_variables: Any = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An algorithm as data plus pure functions (see the module docstring for the round they make):
    ``init(key) -> (server_state, client_states [N, ...])``, ``broadcast(server_state, round) ->
    payload``, ``client_update(payload, client_state, data, ClientContext) -> (client_state, message,
    metrics)``, ``server_update(server_state, messages [K, ...], ServerContext) -> (server_state,
    metrics)``, and optional predictions for evaluation. Pass one to ``fedjax_sparse.run(...,
    algorithm=...)``, or register a builder ``task -> Algorithm`` under a name for the CLI."""
    name: str
    init: Callable[[jax.Array], tuple[Any, Any]]
    broadcast: Callable[[Any, jax.Array], Any]
    client_update: Callable[[Any, Any, ClientData, ClientContext], tuple[Any, Any, dict]]
    server_update: Callable[[Any, Any, ServerContext], tuple[Any, dict]]
    personal_predict: Callable[[Any, Any, jax.Array, jax.Array], jax.Array] | None = None
    global_predict: Callable[[Any, jax.Array], jax.Array] | None = None
    # Human-readable hyper-parameters, recorded in config.json / summary.json.
    hparams: dict = dataclasses.field(default_factory=dict)
    # Optional: (server_state, client_state) -> [] kept fraction of the model the
    # client holds now (evaluated over all clients: ``density_all_clients``).
    personal_density: Callable[[Any, Any], jax.Array] | None = None
    # Optional: (server_state, key, round, sampled_ids [K]) -> (ids [M], active []) of clients that also
    # run ``client_update`` this round, unaggregated, their messages in ``ctx.extra_messages`` (zeros
    # when not ``active``); FSL's attackers use it (docs/design.md, "Extra client updates").
    extra_clients: Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None
    # Whether ``server_update`` honours ``ServerContext.mask`` (a cohort of varying size, padded;
    # possibly empty): the engine's Poisson client sampling refuses algorithms that do not declare it.
    varying_cohort: bool = False


def client_metrics(*, loss, num_examples, flops=None, uplink_bits=None, downlink_bits=None, density=None,
                   **extra) -> dict:
    """Builds the metrics dict ``client_update`` returns.

    ``flops``, ``uplink_bits``, ``downlink_bits``: a :class:`Cost`, a static
    Python number, or a traced int count (all kept exact), or None when the
    algorithm does not count them; ``num_examples``: an int count; the rest
    become float32 scalars."""
    floats = dict(loss=loss, **({} if density is None else {"density": density}), **extra)
    out: dict[str, Any] = {k: jnp.asarray(v, jnp.float32) for k, v in floats.items()}
    costs = dict(flops=flops, uplink_bits=uplink_bits, downlink_bits=downlink_bits)
    out.update({k: as_cost(v) for k, v in costs.items() if v is not None})
    out["num_examples"] = jnp.asarray(num_examples, jnp.int32)
    return out


def replicate(tree, n: int):
    """Stacks ``n`` copies of a pytree along a new leading client axis."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


def mean_weights(ctx: ServerContext, weighted: bool) -> jax.Array:
    """[K] weights of the clients' mean: their training-set sizes (``weighted``) or all 1 (uniform)."""
    return ctx.weights if weighted else jnp.ones_like(ctx.weights)


def cohort_mean(stacked, weights: jax.Array, mask: jax.Array, empty):
    """Weighted mean over the real slots (``mask`` [K]) of a varying cohort: padded slots weigh 0;
    ``empty`` (a pytree like one row, e.g. the current model) when no slot is real or the real
    weights sum to 0, so an empty round changes nothing."""
    w = weights * mask.astype(weights.dtype)
    total = w.sum()
    mean = tree_weighted_mean(stacked, w)
    return jax.tree_util.tree_map(lambda m, e: jnp.where(total > 0, m, e).astype(m.dtype), mean, empty)


def tree_weighted_mean(stacked, weights: jax.Array):
    """Weighted mean over the leading axis: stacked leaves [K, ...], weights [K]."""
    w = weights / jnp.maximum(weights.sum(), 1e-12)
    return jax.tree_util.tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1), stacked)
