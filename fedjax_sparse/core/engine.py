"""The round engine: runs any :class:`Algorithm` the same way (docs/design.md, "The round engine").

One round (``round_step``: pure, jittable) samples K of N clients without replacement (a new cohort
every ``resample_every`` rounds, drawn from the key of its first round; or each client with probability
q = K / N under ``client_sampling="poisson"``, padded to ``cohort_capacity`` slots: docs/privacy.md,
"Poisson client sampling"), gathers their states and data rows, maps ``client_update`` over them by the
``client_parallelism`` schedule (docs/design.md, "Client schedules"), calls ``server_update`` on the
stacked messages and scatters the new client states back. ``run_rounds`` composes rounds with
``lax.scan``; ``round_fn`` is the same round jitted alone. With several devices and ``vmap`` the
sampled clients are sharded over a 1-D ``clients`` mesh; a multi-process run splits the population's
state along N (``population_sharding``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.errors import arg
from fedjax_sparse.core.accounting import Cost, cost_per_round
from fedjax_sparse.core.algorithm import (COST_METRICS, REQUIRED_CLIENT_METRICS, Algorithm, ClientContext,
                                          ServerContext)
from fedjax_sparse.data.federated import ClientData, FederatedData
from fedjax_sparse.core.evaluation import Evaluator

CLIENT_PARALLELISM = ("auto", "vmap", "map", "packed")
# "packed": the executed / useful client-steps ratio its group width is chosen to stay under.
PACKED_PADDING_TARGET = 1.2
# Per-round integer counts of local steps (see the module docstring).
STEP_METRICS = ("client_steps", "client_steps_executed")
# How a round's cohort is drawn: exactly K of N without replacement, or every client independently
# with probability q = K / N (a cohort of varying size, padded to ``poisson_capacity``).
CLIENT_SAMPLINGS = ("fixed", "poisson")
# Per-round integer counts of a varying (Poisson) cohort: its real size, and the members beyond the
# capacity that were left out (never silently: the runner warns and totals them).
COHORT_METRICS = ("clients", "cohort_overflow")
# The capacity of a Poisson cohort holds it with probability at least 1 - this, every round.
POISSON_OVERFLOW_PROBABILITY = 1e-9


class EngineState(NamedTuple):
    server: Any
    clients: Any       # leaves [N, ...]
    key: jax.Array
    round: jax.Array   # [] int32: rounds completed


def resolve_parallelism(mode: str) -> str:
    if mode not in CLIENT_PARALLELISM:
        raise ValueError(f"unknown client parallelism {mode!r}; valid: {CLIENT_PARALLELISM}")
    if mode == "auto":
        # The faster schedules measured (docs/design.md, "Execution modes"); only vmap shares the cohort.
        if jax.default_backend() == "cpu":
            return "vmap" if jax.process_count() > 1 else "map"
        return "vmap" if jax.process_count() > 1 or jax.local_device_count() > 1 else "packed"
    return mode


def sample_clients(key: jax.Array, num_clients: int, clients_per_round: int) -> jax.Array:
    """[K] distinct client ids, uniformly without replacement."""
    if clients_per_round == num_clients:
        return jnp.arange(num_clients, dtype=jnp.int32)
    return jax.random.choice(key, num_clients, (clients_per_round,), replace=False).astype(jnp.int32)


def poisson_capacity(num_clients: int, rate: float, tail: float = POISSON_OVERFLOW_PROBABILITY) -> int:
    """The smallest k with P(Binomial(N, q) > k) <= ``tail``: the padded cohort size of Poisson
    sampling (the log-space binomial pmf summed from the top; no scipy). N when q = 1."""
    if not 0 < rate <= 1:
        raise ValueError(f"the client sampling rate must be in (0, 1], got {rate}")
    if rate == 1:
        return num_clients
    k = np.arange(num_clients, dtype=np.float64)
    # log pmf(k + 1) - log pmf(k) = log((N - k) / (k + 1)) + log(q / (1 - q))
    steps = np.log(num_clients - k) - np.log(k + 1) + math.log(rate) - math.log1p(-rate)
    log_pmf = np.concatenate([[num_clients * math.log1p(-rate)], num_clients * math.log1p(-rate) + np.cumsum(steps)])
    # log P(X > k) for k = 0..N (the last is P(X > N) = 0: -inf)
    rev = np.logaddexp.accumulate(log_pmf[::-1])[::-1]
    log_tail = np.concatenate([rev[1:], [-np.inf]])
    return int(np.argmax(log_tail <= math.log(tail)))


def sample_poisson_clients(key: jax.Array, num_clients: int, rate: float, capacity: int):
    """Every client joins independently with probability ``rate`` (one uniform draw per client from
    ``key``). Returns (ids [capacity] int32: the members in increasing id order, padded with N;
    mask [capacity] bool: the real slots; overflow [] int32: members beyond the capacity, left
    out, the highest ids first: deterministic given the key)."""
    member = jax.random.uniform(key, (num_clients,)) < rate
    ids = jnp.nonzero(member, size=capacity, fill_value=num_clients)[0].astype(jnp.int32)
    size = member.sum(dtype=jnp.int32)
    mask = jnp.arange(capacity) < size
    return ids, mask, jnp.maximum(size - capacity, 0).astype(jnp.int32)


def _map_clients(fn, mode: str, *args, sizes: jax.Array | None = None, pack_width: int = 1):
    """fn(*per-client args) over the leading axis of every arg (results in the args' order).
    ``"packed"``: the clients sorted by ``sizes`` [K] (their training-set sizes, so their local step
    counts), then ``pack_width`` at a time in lockstep (vmap), the groups one after another (lax.map):
    each group runs its own longest client's steps, not the cohort's."""
    if mode == "vmap":
        return jax.vmap(fn)(*args)
    if mode == "packed" and pack_width > 1:
        assert sizes is not None, "packed clients are grouped by their sizes"
        order = jnp.argsort(sizes, stable=True)
        ordered = jax.tree_util.tree_map(lambda x: x[order], args)
        out = jax.lax.map(lambda a: fn(*a), ordered, batch_size=pack_width)
        back = jnp.argsort(order)
        return jax.tree_util.tree_map(lambda x: x[back], out)
    return jax.lax.map(lambda a: fn(*a), args)


def executed_client_steps(steps: jax.Array, mode: str, pack_width: int = 1) -> jax.Array:
    """[] int32 local steps a schedule executes for clients needing ``steps`` [K]: ``vmap``
    runs the longest client's count for every member, ``map`` each client's own (no padding),
    ``packed`` each group of ``pack_width`` clients (sorted by steps) its longest member's count."""
    if mode == "vmap":
        return steps.shape[0] * steps.max()
    if mode == "packed" and pack_width > 1:
        groups = jnp.sort(steps).reshape(-1, pack_width)
        return pack_width * groups.max(axis=1).sum()
    return steps.sum()


def choose_pack_width(steps: np.ndarray, clients_per_round: int, target: float = PACKED_PADDING_TARGET,
                      cohorts: np.ndarray | None = None, draws: int = 256, seed: int = 0) -> tuple[int, float]:
    """The widest lockstep group (a divisor of K) whose mean executed / useful client-steps ratio
    stays at most ``target`` over ``cohorts`` ([R, K] client ids: the pinned schedule) or ``draws``
    uniform cohorts (a fixed host-side draw) of K of the N clients whose step counts are ``steps`` [N].
    Returns (width, its mean ratio); (1, 1.0) (one client after another) when no wider group meets it."""
    steps = np.asarray(steps, np.int64)
    if cohorts is None:
        rng = np.random.default_rng(seed)
        cohorts = np.stack([rng.choice(steps.shape[0], clients_per_round, replace=False) for _ in range(draws)])
    drawn = np.sort(steps[np.asarray(cohorts)], axis=1)
    useful = np.maximum(drawn.sum(axis=1), 1)
    for width in sorted((w for w in range(2, clients_per_round + 1) if clients_per_round % w == 0), reverse=True):
        executed = width * drawn.reshape(drawn.shape[0], -1, width).max(axis=2).sum(axis=1)
        ratio = float(np.mean(executed / useful))
        if ratio <= target:
            return width, ratio
    return 1, 1.0


@dataclasses.dataclass(frozen=True)
class Engine:
    algorithm: Algorithm
    num_clients: int
    clients_per_round: int
    client_parallelism: str = "auto"
    eval_batch_size: int = 500
    # Without a personal model: one pass of the global model over the union of the test sets, the
    # per-client accuracies gathered from it; False: every client separately (same numbers, tested).
    eval_shared_global_pass: bool = True
    # Personalised evaluation (fedjax_sparse.core.evaluation): "auto" = "per_client".
    personal_eval: str = "auto"
    # Shard the sampled clients over all local devices (vmap mode only).
    shard_clients: bool = True
    # The local loop's shape (``training.run_local_epochs``: epochs x ceil(count / batch_size)
    # steps), for the client-step metrics; None: not reported.
    local_epochs: int | None = None
    batch_size: int | None = None
    # Keep each sampled cohort for this many consecutive rounds (FedDrop's fractional participation
    # re-samples every 2); 1 = a new cohort every round.
    resample_every: int = 1
    # Pinned cohorts (``--cohort-schedule``): row r = the client ids of round r; replaces sampling.
    cohort_schedule: tuple[tuple[int, ...], ...] | None = None
    # CLIENT_SAMPLINGS; "poisson": each client with probability ``client_rate`` (None: K / N).
    client_sampling: str = "fixed"
    client_rate: float | None = None
    # ``"packed"``: clients per lockstep group (a divisor of the cohort's slots); the builder chooses it
    # from the clients' step counts (``choose_pack_width``). 1: one client after another, as ``map``.
    pack_width: int = 1

    def __post_init__(self):
        if not 1 <= self.clients_per_round <= self.num_clients:
            raise ValueError(f"clients per round ({self.clients_per_round}) must be between 1 and the "
                             f"number of clients ({self.num_clients}); lower {arg('clients_per_round')}")
        if self.resample_every < 1:
            raise ValueError(f"resample_every must be >= 1 round, got {self.resample_every}")
        if self.cohort_schedule is not None:
            widths = {len(row) for row in self.cohort_schedule}
            if widths != {self.clients_per_round}:
                raise ValueError(f"cohort schedule rows must hold {self.clients_per_round} client ids, got "
                                 f"widths {sorted(widths)}")
        if self.client_sampling not in CLIENT_SAMPLINGS:
            raise ValueError(f"unknown client sampling {self.client_sampling!r}; valid: {', '.join(CLIENT_SAMPLINGS)}")
        if self.client_sampling == "poisson":
            if self.cohort_schedule is not None or self.resample_every != 1:
                raise ValueError("poisson client sampling draws a fresh cohort every round; drop the cohort schedule "
                                 "/ resample_every")
            if not self.algorithm.varying_cohort:
                raise ValueError(f"{self.algorithm.name} cannot take poisson client sampling: its server assumes a "
                                 "fixed cohort of K clients (it does not declare varying_cohort); use fixed sampling")
        if self.pack_width < 1 or self.cohort_capacity % self.pack_width:
            raise ValueError(f"pack_width {self.pack_width} must divide the cohort's {self.cohort_capacity} client "
                             "slots")

    @property
    def poisson(self) -> bool:
        return self.client_sampling == "poisson"

    @property
    def sampling_rate(self) -> float:
        """q: a client's probability of joining a round (K / N for fixed sampling)."""
        if self.client_rate is not None:
            return float(self.client_rate)
        return self.clients_per_round / self.num_clients

    @functools.cached_property
    def cohort_capacity(self) -> int:
        """Client slots of a round: K (fixed), or ``poisson_capacity(N, q)`` (at least K: poisson)."""
        if not self.poisson:
            return self.clients_per_round
        return max(poisson_capacity(self.num_clients, self.sampling_rate), self.clients_per_round)

    @property
    def mode(self) -> str:
        return resolve_parallelism(self.client_parallelism)

    @functools.cached_property
    def client_sharding(self):
        """NamedSharding of the client axis over all devices (every process's, in a multi-process
        run), or None (one device, or a cohort that does not divide evenly)."""
        n = jax.device_count()
        if not self.shard_clients or self.mode != "vmap" or n < 2 or self.cohort_capacity % n:
            return None
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("clients",))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))

    @functools.cached_property
    def population_sharding(self):
        """Multi-process: the population's state [N, ...] split along N over all devices (each
        process holds N / processes clients' rows), or None (one process, or N not divisible by
        the device count: then every process holds all rows)."""
        if jax.process_count() == 1 or self.client_sharding is None or self.num_clients % jax.device_count():
            return None
        return self.client_sharding

    @functools.cached_property
    def state_shardings(self):
        """Multi-process: the EngineState's shardings (a pytree prefix): server, key and round
        replicated, clients by :attr:`population_sharding` (replicated when None). None in one process."""
        if jax.process_count() == 1:
            return None
        # (distributed.replicated_sharding's value; not imported: config imports the engine)
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("clients",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return EngineState(replicated, self.population_sharding or replicated, replicated, replicated)

    def _finish_round(self, state: EngineState, metrics: dict):
        """Multi-process: the round's results placed where every process can read them (metrics,
        server state replicated; client rows back in their shards), so the next round and the
        host see the same state everywhere."""
        shardings = self.state_shardings
        if shardings is None:
            return state, metrics
        constrain = jax.lax.with_sharding_constraint   # a pytree, one sharding for all its leaves
        return EngineState(*map(constrain, state, shardings)), constrain(metrics, shardings.server)

    def _shard(self, tree):
        sharding = self.client_sharding
        return tree if sharding is None else jax.lax.with_sharding_constraint(tree, sharding)

    # ------------------------------------------------------------------ state
    def init(self, key: jax.Array) -> EngineState:
        key_init, key_run = jax.random.split(key)
        server, clients = self.algorithm.init(key_init)
        for leaf in jax.tree_util.tree_leaves(clients):
            if leaf.shape[:1] != (self.num_clients,):
                raise ValueError(f"{self.algorithm.name}: client state leaves need a leading axis of "
                                 f"{self.num_clients} clients, got shape {leaf.shape}")
        return EngineState(server, clients, key_run, jnp.zeros((), jnp.int32))

    # ------------------------------------------------------------------ one round
    def cohort(self, run_key: jax.Array, round_: jax.Array) -> jax.Array:
        """[K] client ids of round ``round_``: drawn from the key of the cohort's first round
        (with ``resample_every == 1`` that is the round's own key), or row ``round_`` of the
        pinned ``cohort_schedule``."""
        if self.cohort_schedule is not None:
            return jnp.asarray(self.cohort_schedule, jnp.int32)[round_]
        first_round = round_ // self.resample_every * self.resample_every
        key_sample = jax.random.split(jax.random.fold_in(run_key, first_round), 4)[0]
        if self.poisson:
            return sample_poisson_clients(key_sample, self.num_clients, self.sampling_rate, self.cohort_capacity)[0]
        return sample_clients(key_sample, self.num_clients, self.clients_per_round)

    def poisson_cohort(self, run_key: jax.Array, round_: jax.Array):
        """Poisson sampling's (ids [capacity] padded with N, mask [capacity], overflow []) of round
        ``round_``, from the same key as :meth:`cohort`."""
        key_sample = jax.random.split(jax.random.fold_in(run_key, round_), 4)[0]
        return sample_poisson_clients(key_sample, self.num_clients, self.sampling_rate, self.cohort_capacity)

    def round_step(self, state: EngineState, data: FederatedData, resident: jax.Array | None = None):
        """One federated round. Returns (new state, round metrics dict of scalars).

        ``resident`` [U] (sorted client ids): ``state.clients`` holds only these clients' rows
        (leaves [U, ...]), a superset of this round's cohort (a host-resident population brings
        just the rows a chunk of rounds needs; :mod:`fedjax_sparse.driver.population`). None: all N."""
        alg = self.algorithm
        round_key = jax.random.fold_in(state.key, state.round)
        _, key_clients, key_shared, key_server = jax.random.split(round_key, 4)  # first: cohort()'s
        if resident is not None and alg.extra_clients is not None:
            raise ValueError(f"{alg.name} trains extra clients chosen inside the round; it needs every client's "
                             "state resident")
        mask = overflow = None
        if self.poisson:
            # Padded slots hold id N: they read a clamped row (count 0: no data, no local step), are
            # masked, and write nothing back (``mode="drop"``).
            ids, mask, overflow = self.poisson_cohort(state.key, state.round)
            gather_ids = jnp.minimum(ids, self.num_clients - 1)
        else:
            ids = gather_ids = self.cohort(state.key, state.round)
        rows_of = gather_ids if resident is None else jnp.searchsorted(resident, gather_ids)
        client_states = jax.tree_util.tree_map(lambda x: x[rows_of], state.clients)
        chex.assert_tree_shape_prefix(client_states, (self.cohort_capacity,))
        idx_rows, counts = data.train_idx[gather_ids], data.train_count[gather_ids]
        if mask is not None:
            counts = jnp.where(mask, counts, 0)
        payload = alg.broadcast(state.server, state.round)
        client_keys = jax.random.split(key_clients, self.cohort_capacity)

        def one_client(client_state, rows, count, cid, key):
            ctx = ClientContext(state.round, cid, key, key_shared)
            return alg.client_update(payload, client_state,
                                     ClientData(data.train_x, data.train_y, rows, count), ctx)

        per_client = self._shard((client_states, idx_rows, counts, ids, client_keys))
        new_states, messages, metrics = _map_clients(one_client, self.mode, *per_client, sizes=counts,
                                                      pack_width=self.pack_width)
        if mask is not None:
            # Padded slots trained on nothing (size 0: zero local steps); their messages and metrics are
            # zeroed (costs, examples, floats), and their states are not written back (below). No lax.cond
            # around the client: XLA on CPU copies a conditional's operands (the whole training set) per call.
            def real_only(x):
                return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))
            messages = jax.tree_util.tree_map(real_only, messages)
            metrics = jax.tree_util.tree_map(real_only, metrics)
        missing = [k for k in REQUIRED_CLIENT_METRICS if k not in metrics]
        if missing:
            raise ValueError(f"{alg.name}.client_update must report metrics {missing}")
        server_ctx = ServerContext(state.round, ids, counts.astype(jnp.float32), key_server, mask=mask)
        if alg.extra_clients is not None:
            server_ctx = self._extra_updates(state, data, payload, key_shared, server_ctx, one_client)
        server, server_metrics = alg.server_update(state.server, messages, server_ctx)
        # A client_update must return its state with the shapes it received (scatter writes rows back).
        chex.assert_trees_all_equal_shapes_and_dtypes(new_states, client_states)
        if mask is None:
            clients = jax.tree_util.tree_map(lambda all_, new: all_.at[rows_of].set(new), state.clients, new_states)
        else:
            leaves = jax.tree_util.tree_leaves(state.clients)
            scatter_rows = jnp.where(mask, rows_of, leaves[0].shape[0] if leaves else 0)   # padded slots: out of bounds
            clients = jax.tree_util.tree_map(lambda all_, new: all_.at[scatter_rows].set(new, mode="drop"),
                                             state.clients, new_states)
        round_metrics = reduce_client_metrics(metrics, mask)
        if self.local_epochs is not None and self.batch_size is not None:
            steps = self.local_epochs * ((counts + self.batch_size - 1) // self.batch_size)
            round_metrics["client_steps"] = steps.sum()
            round_metrics["client_steps_executed"] = executed_client_steps(steps, self.mode, self.pack_width)
        if mask is not None:
            round_metrics["clients"] = mask.sum(dtype=jnp.int32)
            round_metrics["cohort_overflow"] = overflow
        round_metrics.update({f"server_{k}": jnp.asarray(v, jnp.float32) for k, v in server_metrics.items()})
        return self._finish_round(EngineState(server, clients, state.key, state.round + 1), round_metrics)

    def _extra_updates(self, state: EngineState, data: FederatedData, payload, key_shared, server_ctx, one_client):
        """Runs ``client_update`` for the algorithm's extra clients of this round (only when it
        says they are active) and returns ``server_ctx`` carrying their ids and messages; their
        states and costs are dropped. Their key is apart from the round's four keys."""
        key_extra = jax.random.fold_in(jax.random.fold_in(state.key, state.round), 0x5EED)
        key_pick, key_train = jax.random.split(key_extra)
        extra_clients = self.algorithm.extra_clients
        assert extra_clients is not None, "only for algorithms with extra_clients"
        extra_ids, active = extra_clients(state.server, key_pick, state.round, server_ctx.client_ids)

        def train(_):
            rows = jax.tree_util.tree_map(lambda x: x[extra_ids], state.clients)
            keys = jax.random.split(key_train, extra_ids.shape[0])
            extra_counts = data.train_count[extra_ids]
            _, extra_messages, _ = _map_clients(one_client, "map" if self.mode == "packed" else self.mode, rows,
                                                data.train_idx[extra_ids], extra_counts, extra_ids, keys)
            return extra_messages

        shapes = jax.eval_shape(train, None)
        extra_messages = jax.lax.cond(active, train,
                                      lambda _: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                                      None)
        return server_ctx._replace(extra_ids=extra_ids, extra_messages=extra_messages)

    @functools.cached_property
    def round_fn(self):
        """The per-round jit: state, data -> (state, metrics)."""
        return jax.jit(self.round_step, donate_argnums=0)

    @functools.cached_property
    def _scan_fn(self):
        """(state, data, resident or None, num_rounds) -> the rounds' lax.scan, jitted."""
        def run(state, data, resident, num_rounds):
            return jax.lax.scan(lambda s, _: self.round_step(s, data, resident), state, None, length=num_rounds)
        return jax.jit(run, static_argnums=3, donate_argnums=0)

    def run_rounds(self, state: EngineState, data: FederatedData, num_rounds: int):
        """``num_rounds`` rounds in one jitted scan. Returns (state, host metrics:
        see :func:`metrics_to_host`, one entry per round)."""
        state, metrics = self._scan_fn(state, data, None, int(num_rounds))
        return state, metrics_to_host(metrics)

    def run_rounds_resident(self, state: EngineState, data: FederatedData, resident: jax.Array, num_rounds: int):
        """As :meth:`run_rounds`, with ``state.clients`` holding only the rows of the sorted client
        ids ``resident`` [U] (every client the ``num_rounds`` cohorts sample: see
        :meth:`cohorts`). Returns (state, device metrics: :func:`metrics_to_host` them)."""
        return self._scan_fn(state, data, resident, int(num_rounds))

    def cohorts(self, run_key: jax.Array, first_round: int, num_rounds: int) -> np.ndarray:
        """[num_rounds, K] client ids of rounds ``first_round ...`` (what the rounds will sample),
        computed ahead on the host."""
        rounds = jnp.arange(first_round, first_round + num_rounds, dtype=jnp.int32)
        return np.asarray(self._cohorts_fn(run_key, rounds))

    @functools.cached_property
    def _cohorts_fn(self):
        return jax.jit(jax.vmap(self.cohort, in_axes=(None, 0)))

    @functools.cached_property
    def _replica_scan_fn(self):
        def run(states, data, num_rounds):
            def one_replica(state, train_idx, train_count):
                replica_data = data.replace(train_idx=train_idx, train_count=train_count)
                return jax.lax.scan(lambda s, _: self.round_step(s, replica_data), state, None, length=num_rounds)
            return jax.vmap(one_replica)(states, data.train_idx, data.train_count)
        return jax.jit(run, static_argnums=2, donate_argnums=0)

    def run_replica_rounds(self, states: EngineState, data: FederatedData, num_rounds: int):
        """``num_rounds`` rounds of R independent replicas (seeds) in one program: ``states``
        stacked with a leading [R] axis, ``data`` with ``train_idx`` [R, N, W] and
        ``train_count`` [R, N] (each replica's partition of the shared pool). Returns (states,
        device metrics with leading [R, num_rounds] axes: :func:`metrics_to_host` per replica)."""
        return self._replica_scan_fn(states, data, int(num_rounds))

    def advance(self, state: EngineState, data: FederatedData, num_rounds: int, round_mode: str = "scan"):
        """``num_rounds`` rounds by ``"scan"`` (one jitted lax.scan) or ``"per_round"`` (the
        per-round jit from Python: the scan's reference, not a run mode). Returns (state, host
        metrics with one entry per round, see :func:`metrics_to_host`)."""
        if round_mode == "scan":
            return self.run_rounds(state, data, num_rounds)
        if round_mode != "per_round":
            raise ValueError(f"unknown round mode {round_mode!r}; valid: scan, per_round")
        per_round = []
        for _ in range(num_rounds):
            state, metrics = self.round_fn(state, data)
            per_round.append(metrics)
        return state, metrics_to_host(jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per_round))

    # ------------------------------------------------------------------ evaluation
    @functools.cached_property
    def evaluator(self) -> Evaluator:
        """Evaluation lives in fedjax_sparse.core.evaluation; the engine's eval_* fields configure it."""
        return Evaluator(self.algorithm, self.num_clients, eval_batch_size=self.eval_batch_size,
                         eval_shared_global_pass=self.eval_shared_global_pass, personal_eval=self.personal_eval)

    def evaluate(self, state: EngineState, data: FederatedData) -> dict:
        """See :meth:`fedjax_sparse.core.evaluation.Evaluator.evaluate`."""
        return self.evaluator.evaluate(state, data)


def reduce_client_metrics(metrics: dict, mask: jax.Array | None = None) -> dict:
    """Stacked per-client metrics [K] -> round metrics: loss weighted by
    examples, other floats averaged; the exact counts (FLOPs, bits: ``Cost``
    with [K] factors; ``num_examples`` [K] int32) stay per client, for the
    host to sum exactly (:func:`metrics_to_host`). ``mask`` [K] (a Poisson cohort's real
    slots): the floats are averaged over the real clients only, and are NaN in an empty round
    (written as null, not taken for divergence: docs/privacy.md); padded slots report zero costs
    and examples already."""
    examples = metrics["num_examples"].astype(jnp.float32)
    empty = None if mask is None else ~mask.any()
    out = {}
    for key, value in metrics.items():
        if key in COST_METRICS or key == "num_examples":
            out[key] = value
        elif key == "loss":
            out[key] = (value * examples).sum() / jnp.maximum(examples.sum(), 1.0)
        elif mask is None:
            out[key] = value.mean()
        else:
            real = mask.astype(value.dtype).reshape(mask.shape + (1,) * (value.ndim - 1))
            out[key] = (value * real).sum(0).mean() / jnp.maximum(mask.sum().astype(value.dtype), 1)
        if empty is not None and key not in COST_METRICS and key != "num_examples":
            out[key] = jnp.where(empty, jnp.nan, out[key])
    return out


def metrics_to_host(metrics: dict) -> dict:
    """Round metrics with a leading [R] round axis, fetched to the host.

    Costs become [R] exact int64 arrays (float64 for expectations such as
    FedDrop's FLOPs; Python-int object arrays in the unlikely case a round
    exceeds int64); ``num_examples`` an [R] int64 sum over the clients;
    everything else [R] float64. ``.tolist()`` gives Python numbers for totals."""
    metrics = jax.device_get(metrics)
    out = {}
    for key, value in metrics.items():
        if isinstance(value, Cost):
            values = cost_per_round(value)
            if all(isinstance(v, int) for v in values):
                fits = all(-2 ** 63 < v < 2 ** 63 for v in values)
                out[key] = np.array(values, dtype=np.int64 if fits else object)
            else:
                out[key] = np.array(values, dtype=np.float64)
        elif key == "num_examples":
            out[key] = np.asarray(value, np.int64).reshape(np.shape(value)[0], -1).sum(1)
        elif key in STEP_METRICS or key in COHORT_METRICS:
            out[key] = np.asarray(value, np.int64)
        else:
            out[key] = np.asarray(value, np.float64)
    return out
