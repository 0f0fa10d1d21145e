"""Client populations larger than the device: the clients' persistent state lives in host memory
(:class:`HostPopulation`, copy-on-write from one initial row), and :func:`run_rounds` brings only
the rows a chunk of rounds needs to the device (double-buffered); :func:`evaluate_clients`
evaluates any set of clients' personal models. Numbers equal the all-resident engine's (float32
storage bit for bit). Design and measurements: docs/scaling.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.data.federated import FederatedData
from fedjax_sparse.core.engine import Engine, EngineState, metrics_to_host
from fedjax_sparse.errors import RunError, arg
from fedjax_sparse.core.evaluation import Evaluator, hits_and_losses, personal_summary


class HostPopulation:
    """Persistent state rows of ``num_clients`` clients in host memory, copy-on-write.

    ``initial_row``: one client's state (a pytree of arrays without the client axis), the row
    every client starts from. ``storage_dtype`` (e.g. ``jnp.bfloat16``): float32 leaves are kept
    in this type and handed back as float32 (lossy; integer leaves are kept as they are)."""

    def __init__(self, initial_row: Any, num_clients: int, storage_dtype=None, capacity: int = 64):
        leaves, self.treedef = jax.tree_util.tree_flatten(jax.device_get(initial_row))
        self.dtypes = [np.asarray(leaf).dtype for leaf in leaves]
        self.stored_dtypes = [np.dtype(storage_dtype) if storage_dtype is not None and d == np.float32 else d
                              for d in self.dtypes]
        self.initial = [np.asarray(leaf, dtype=d) for leaf, d in zip(leaves, self.stored_dtypes)]
        self.num_clients = int(num_clients)
        self.slot = np.full(self.num_clients, -1, np.int64)   # -1: still the initial row
        self.used = 0
        self.buffers = [np.empty((capacity, *leaf.shape), leaf.dtype) for leaf in self.initial]

    @property
    def touched(self) -> int:
        """Clients whose row differs from the initial one (ever written back)."""
        return self.used

    @property
    def row_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.initial)

    @property
    def nbytes(self) -> int:
        """Host bytes held: the stored rows (with the buffers' spare capacity) and the slot table."""
        return sum(b.nbytes for b in self.buffers) + self.slot.nbytes

    def gather(self, ids: np.ndarray) -> Any:
        """The rows of ``ids`` [M] (ids >= num_clients give the initial row: padding), stacked [M, ...]."""
        ids = np.asarray(ids)
        slots = np.where(ids < self.num_clients, self.slot[np.minimum(ids, self.num_clients - 1)], -1)
        out = []
        for initial, buffer, dtype in zip(self.initial, self.buffers, self.dtypes):
            rows = np.broadcast_to(initial, (len(ids), *initial.shape)).copy()
            have = slots >= 0
            rows[have] = buffer[slots[have]]
            out.append(rows.astype(dtype, copy=False))
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def scatter(self, ids: np.ndarray, rows: Any) -> None:
        """Writes the stacked ``rows`` [M, ...] back for ``ids`` [M] (ids >= num_clients are skipped)."""
        ids = np.asarray(ids)
        keep = ids < self.num_clients
        ids = ids[keep]
        new = ids[self.slot[ids] < 0]
        if len(new):
            self._grow(self.used + len(new))
            self.slot[new] = np.arange(self.used, self.used + len(new))
            self.used += len(new)
        slots = self.slot[ids]
        for buffer, leaf in zip(self.buffers, jax.tree_util.tree_leaves(rows)):
            buffer[slots] = np.asarray(leaf)[keep].astype(buffer.dtype, copy=False)

    def state_dict(self) -> dict:
        """The population as a pytree of host arrays, for a checkpoint: the slot table [N], the
        number of stored rows, and the stored rows themselves (at least one: orbax cannot save
        empty arrays; rows past ``used`` are unused)."""
        kept = max(self.used, 1)
        return {"slot": self.slot.copy(), "used": np.int64(self.used),
                "rows": {str(i): buffer[:kept].copy() for i, buffer in enumerate(self.buffers)}}

    def load_state_dict(self, saved: dict) -> None:
        """Replaces the stored rows by a :meth:`state_dict` (ValueError when it is another
        configuration's: other client count, row shapes or storage type)."""
        slot = np.asarray(saved["slot"])
        used = int(saved["used"])
        rows = [np.asarray(saved["rows"][str(i)]) for i in range(len(self.buffers))] \
            if len(saved["rows"]) == len(self.buffers) else None
        if (slot.shape != self.slot.shape or rows is None or used > len(rows[0]) or
                any(r.shape[1:] != b.shape[1:] or r.dtype != b.dtype for r, b in zip(rows, self.buffers))):
            raise ValueError("the saved client population is from another configuration (client count, model or "
                             f"{arg('client_storage')} differ)")
        self.slot = slot.astype(np.int64)
        self.used = 0
        self._grow(used)
        for buffer, r in zip(self.buffers, rows):
            buffer[:used] = r[:used]
        self.used = used

    def _grow(self, needed: int) -> None:
        if not self.buffers or needed <= len(self.buffers[0]):  # no buffers: the algorithm keeps no client state
            return
        capacity = max(needed, 2 * len(self.buffers[0]))
        grown = []
        for buffer in self.buffers:
            bigger = np.empty((capacity, *buffer.shape[1:]), buffer.dtype)
            bigger[:self.used] = buffer[:self.used]
            grown.append(bigger)
        self.buffers = grown


def init(engine: Engine, key: jax.Array, storage_dtype=None) -> tuple[EngineState, HostPopulation]:
    """The engine's initial state with the clients' rows in a :class:`HostPopulation` (the
    returned state's ``clients`` is None). Draws exactly what :meth:`Engine.init` draws; the
    [N, ...] client state is never built (rows 0 and N-1 are sliced out inside one jit)."""
    key_init, key_run = jax.random.split(key)
    n = engine.num_clients

    def first_and_last(k):
        server, clients = engine.algorithm.init(k)
        row = lambda i: jax.tree_util.tree_map(lambda x: x[i], clients)  # noqa: E731
        return server, row(0), row(n - 1)

    server, first, last = jax.jit(first_and_last)(key_init)
    if not all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(first)),
                                                   jax.tree_util.tree_leaves(jax.device_get(last)))):
        raise ValueError(f"{engine.algorithm.name} starts its clients from different rows; a host population "
                         "stores one initial row for all of them: keep the state on the device")
    state = EngineState(server, None, key_run, jnp.zeros((), jnp.int32))
    return state, HostPopulation(first, n, storage_dtype=storage_dtype)


def init_for_run(engine: Engine, seed: int, client_storage: str, algorithm: str) -> tuple[EngineState, HostPopulation]:
    """:func:`init` as ``--client-state host`` starts a run (``--client-storage``), a refusal in one line."""
    if engine.algorithm.extra_clients is not None:
        raise RunError(f"{algorithm} trains extra clients chosen inside each round, whose rows cannot be "
                       f"brought to the device ahead: use {arg('client_state', 'device')}")
    storage = jnp.bfloat16 if client_storage == "bfloat16" else None
    try:
        return init(engine, jax.random.PRNGKey(seed), storage_dtype=storage)
    except ValueError as e:
        raise RunError(f"{e} ({arg('client_state', 'device')})") from None


def _resident(engine: Engine, state: EngineState, num_rounds: int) -> np.ndarray:
    """Sorted union of the next ``num_rounds`` cohorts, padded with N to num_rounds x K ids."""
    ids = np.unique(engine.cohorts(state.key, int(state.round), num_rounds))
    ids = ids[ids < engine.num_clients]   # a Poisson cohort's padded slots hold N
    padded = np.full(num_rounds * engine.cohort_capacity, engine.num_clients, np.int32)
    padded[:len(ids)] = ids
    return padded


def run_rounds(engine: Engine, state: EngineState, population: HostPopulation, data: FederatedData,
               num_rounds: int, chunk_rounds: int) -> tuple[EngineState, list[dict]]:
    """``num_rounds`` rounds, ``chunk_rounds`` per device program. Returns (state with
    ``clients`` None, host metrics of every chunk: :func:`metrics_to_host` dicts)."""
    if engine.algorithm.extra_clients is not None:
        raise ValueError(f"{engine.algorithm.name} trains extra clients chosen inside the round; a host "
                         "population cannot bring their rows ahead: keep the state on the device")
    chunks = [min(chunk_rounds, num_rounds - start) for start in range(0, num_rounds, chunk_rounds)]
    metrics: list[dict] = []
    if not chunks:
        return state, metrics
    resident = _resident(engine, state, chunks[0])
    rows = population.gather(resident)
    for i, n in enumerate(chunks):
        upcoming = None
        if i + 1 < len(chunks):  # the next chunk's clients (computed before the state is donated)
            upcoming = _resident(engine, state._replace(round=state.round + n), chunks[i + 1])
        device_state = EngineState(state.server, rows, state.key, state.round)
        device_state, chunk_metrics = engine.run_rounds_resident(device_state, data, jnp.asarray(resident), n)
        if upcoming is not None:
            # The device is busy with this chunk (asynchronous dispatch): gather the next chunk's rows now.
            next_rows = population.gather(upcoming)
        population.scatter(resident, jax.device_get(device_state.clients))
        metrics.append(metrics_to_host(chunk_metrics))
        state = EngineState(device_state.server, None, device_state.key, device_state.round)
        if upcoming is not None:
            # Rows this chunk just changed are stale in the prefetch: take them again.
            stale = np.isin(upcoming, resident) & (upcoming < population.num_clients)
            if stale.any():
                fresh = population.gather(upcoming[stale])
                for leaf, fresh_leaf in zip(jax.tree_util.tree_leaves(next_rows), jax.tree_util.tree_leaves(fresh)):
                    leaf[stale] = fresh_leaf
            resident, rows = upcoming, next_rows
    return state, metrics


_EVALUATORS: dict = {}


def _chunk_evaluator(engine: Engine, size: int) -> Evaluator:
    """One Evaluator (so one compiled program) per algorithm and chunk size, reused across calls."""
    key = (id(engine.algorithm), size, engine.eval_batch_size, engine.personal_eval)
    held = _EVALUATORS.get(key)
    if held is None or held[0] is not engine.algorithm:
        if len(_EVALUATORS) > 16:
            _EVALUATORS.clear()
        evaluator = Evaluator(engine.algorithm, size, eval_batch_size=engine.eval_batch_size,
                              personal_eval=engine.personal_eval)
        held = _EVALUATORS[key] = (engine.algorithm, evaluator)
    return held[1]


def _client_stats(engine: Engine, state: EngineState, population: HostPopulation, data: FederatedData,
                  client_ids: np.ndarray, chunk_clients: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-client (hits, loss sums, test counts) [len(client_ids)] of each client's own model on its
    own test set, ``chunk_clients`` personal models on the device at a time (the last chunk padded)."""
    size = chunk_clients  # every chunk padded to it: one compiled program whatever the number of clients
    evaluator = _chunk_evaluator(engine, size)
    correct, loss_sum, count = [np.zeros(0)], [np.zeros(0)], [np.zeros(0)]
    for start in range(0, len(client_ids), size):
        ids = client_ids[start:start + size]
        padded = np.concatenate([ids, np.repeat(ids[-1:], size - len(ids))])  # one compiled shape
        view = dataclasses.replace(data, train_idx=data.train_idx[padded], train_count=data.train_count[padded],
                                   test_idx=data.test_idx[padded], test_count=data.test_count[padded])
        rows = jax.tree_util.tree_map(jnp.asarray, population.gather(padded))
        stats = evaluator.personal_stats(EngineState(state.server, rows, state.key, state.round), view)
        correct.append(np.asarray(stats.correct, np.float64)[:len(ids)])
        loss_sum.append(np.asarray(stats.loss_sum, np.float64)[:len(ids)])
        count.append(np.asarray(stats.count, np.float64)[:len(ids)])
    return np.concatenate(correct), np.concatenate(loss_sum), np.concatenate(count)


def evaluate_clients(engine: Engine, state: EngineState, population: HostPopulation, data: FederatedData,
                     client_ids: np.ndarray, chunk_clients: int = 256) -> dict:
    """Personalised accuracy of ``client_ids`` (each client's own model on its own test set;
    clients without test data skipped), ``chunk_clients`` at a time (the last chunk padded): accuracy mean/std/min/max,
    test_loss and the per-client accuracies, as :meth:`Evaluator.evaluate` reports them."""
    correct, loss_sum, count = _client_stats(engine, state, population, data, np.asarray(client_ids), chunk_clients)
    return {**personal_summary(correct, loss_sum, count), "clients_evaluated": int((count > 0).sum())}


def ignores_client_id(algorithm, server: Any, row: Any, x: jax.Array) -> bool:
    """Whether ``algorithm.personal_predict(server, row, client_id, x)`` does not read its client id
    (read off the traced program: the id's variable feeds no operation), so every client holding
    ``row`` has the same model."""
    closed = jax.make_jaxpr(lambda cid: algorithm.personal_predict(server, row, cid, x))(jnp.int32(0))
    cid = closed.jaxpr.invars[0]
    used = [v for eqn in closed.jaxpr.eqns for v in eqn.invars] + list(closed.jaxpr.outvars)
    return not any(v is cid for v in used)


def _initial_row_stats(engine: Engine, state: EngineState, initial: Any, data: FederatedData,
                       client_ids: np.ndarray, batch: int = 512) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_client_stats` for clients that all hold the row ``initial`` (device arrays), when the
    personal model does not depend on the client id: one model, so one pass over the union of their
    test sets in batches of ``batch`` examples (per-example results summed back per client)."""
    counts = np.asarray(data.test_count)[client_ids].astype(np.int64)
    test_idx = np.asarray(data.test_idx)
    rows = np.concatenate([test_idx[c, :n] for c, n in zip(client_ids, counts)] or [np.zeros(0, np.int32)])
    fn = _initial_batch_fn(engine.algorithm.personal_predict)
    padded = np.zeros(-(-len(rows) // batch) * batch, np.int32)
    padded[:len(rows)] = rows
    fetched = jax.device_get([fn(state.server, initial, data, jnp.asarray(padded[s:s + batch]))
                              for s in range(0, len(padded), batch)])
    hits = np.concatenate([h for h, _ in fetched] or [np.zeros(0)])[:len(rows)].astype(np.float64)
    losses = np.concatenate([v for _, v in fetched] or [np.zeros(0)])[:len(rows)].astype(np.float64)
    owner = np.repeat(np.arange(len(client_ids)), counts)
    correct = np.bincount(owner, weights=hits, minlength=len(client_ids))
    loss_sum = np.bincount(owner, weights=losses, minlength=len(client_ids))
    return correct, loss_sum, counts.astype(np.float64)


@functools.lru_cache(maxsize=8)
def _initial_batch_fn(personal_predict):
    """jitted (server, row, data, rows [B]) -> ([B] hits, [B] losses) of the model ``row`` holds,
    traced outside any loop (native convolutions)."""
    from fedjax_sparse.models import layers

    def batch(server, row, data: FederatedData, rows):
        x = data.preprocess(data.test_x[rows])
        y = data.test_y[rows]
        with layers.outside_loops():
            logits = personal_predict(server, row, jnp.int32(0), x)
        return hits_and_losses(logits, y)
    return jax.jit(batch)


def advance(engine: Engine, state: EngineState, population: HostPopulation, data: FederatedData,
            num_rounds: int, chunk_rounds: int) -> tuple[EngineState, dict]:
    """:func:`run_rounds` with the chunks' host metrics joined: one entry per round, as
    :meth:`Engine.advance` returns them."""
    state, chunks = run_rounds(engine, state, population, data, num_rounds, chunk_rounds)
    return state, {key: np.concatenate([c[key] for c in chunks]) for key in chunks[0]}


def evaluate(engine: Engine, state: EngineState, population: HostPopulation, data: FederatedData,
             chunk_clients: int = 256) -> dict:
    """What :meth:`Engine.evaluate` reports for the all-resident state, for a host population:
    personalised accuracy over every client (``chunk_clients`` personal models on the device at a
    time), global accuracy, and ``density_all_clients`` (the stored rows, plus the initial row
    once for all clients never trained)."""
    alg = engine.algorithm
    evaluator = engine.evaluator
    if alg.personal_predict is None:
        # No personal models: one pass of the global model over the union of the test sets.
        return evaluator.evaluate(state, data)
    n = population.num_clients
    trained = np.flatnonzero(population.slot >= 0)
    never_trained = np.flatnonzero(population.slot < 0)
    correct, loss_sum, count = (np.zeros(n) for _ in range(3))
    initial = jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf[0]), population.gather(np.array([n])))
    if len(never_trained) and ignores_client_id(alg, state.server, initial, data.preprocess(data.test_x[:1])):
        # Every never-trained client holds the same model: one pass over their test sets.
        shared = never_trained
        correct[shared], loss_sum[shared], count[shared] = _initial_row_stats(engine, state, initial, data, shared)
    else:
        trained = np.arange(n)
    size = min(chunk_clients, n)
    correct[trained], loss_sum[trained], count[trained] = _client_stats(engine, state, population, data, trained, size)
    out = personal_summary(correct, loss_sum, count)
    out["global_accuracy"] = None
    if alg.global_predict is not None:
        g = evaluator.global_stats(state, data)
        out["global_accuracy"] = float(g.correct / max(int(g.count), 1))
        out["global_test_loss"] = float(g.loss_sum / max(int(g.count), 1))
    if alg.personal_density is not None:
        density = _density_fn(alg.personal_density)
        total = 0.0
        untouched = population.num_clients - population.used
        if untouched:
            total += untouched * float(density(state.server, jax.tree_util.tree_map(lambda x: x[None], initial))[0])
        stored = np.flatnonzero(population.slot >= 0)
        for start in range(0, len(stored), chunk_clients):
            ids = stored[start:start + chunk_clients]
            padded = np.full(chunk_clients, population.num_clients)  # one compiled shape
            padded[:len(ids)] = ids
            rows = jax.tree_util.tree_map(jnp.asarray, population.gather(padded))
            total += float(np.sum(np.asarray(density(state.server, rows), np.float64)[:len(ids)]))
        out["density_all_clients"] = total / population.num_clients
    return out


@functools.lru_cache(maxsize=8)
def _density_fn(personal_density):
    """jitted (server, rows [M, ...]) -> [M] densities of the models the rows hold."""
    return jax.jit(lambda server, rows: jax.lax.map(lambda c: personal_density(server, c), rows))
