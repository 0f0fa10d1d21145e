"""Memory known before compiling: a run's peak memory on one device and on the host, estimated from
shapes alone (``jax.eval_shape``, ``jax.make_jaxpr``: nothing compiled or run), and a one-line refusal
naming the flag that makes it fit (:func:`check_fits`). What each part of :class:`MemoryEstimate` counts
and against which capacity: docs/design.md, "The memory estimate: what is counted".
``check_weights_fit`` lets ``from_flax`` refuse, from the shapes, a model it could not even build.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from fedjax_sparse.core.algorithm import ClientContext
from fedjax_sparse.errors import RunError, arg
from fedjax_sparse.data.federated import ClientData
from fedjax_sparse.models import layers as L

LIMIT_ENV = "FEDJAX_SPARSE_MEMORY_LIMIT_BYTES"
# population.evaluate: personal models evaluated this many at a time, never-trained clients in one
# pass of this batch (fedjax_sparse.driver.population's defaults).
HOST_EVAL_CLIENTS = 256
HOST_EVAL_BATCH = 512
# Two batch sizes the evaluation forward pass is traced at (bytes = intercept + slope x examples).
_PROBE_BATCHES = (8, 64)


# ---------------------------------------------------------------- bytes of shapes and programs
def _itemsize(dtype) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # extended dtypes (typed PRNG keys): their raw data
        impl = getattr(dtype, "_impl", None)
        shape = getattr(impl, "key_shape", (2,))
        return 4 * int(math.prod(shape))


def aval_bytes(aval: Any) -> int:
    """Bytes of one array shape (a ShapedArray, ShapeDtypeStruct or array; 0 for tokens)."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return int(math.prod(shape)) * _itemsize(dtype)


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a pytree (arrays or shapes)."""
    return sum(aval_bytes(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def _float_bytes(tree: Any) -> int:
    """Bytes of the float32 leaves (the ones bfloat16 storage halves)."""
    return sum(aval_bytes(leaf) for leaf in jax.tree_util.tree_leaves(tree)
               if np.dtype(getattr(leaf, "dtype", np.int8)) == np.float32)


def peak_live_bytes(jaxpr: Any, _cache: dict | None = None) -> int:
    """The largest total of bytes of values that ``jaxpr`` (a Jaxpr or ClosedJaxpr) creates and holds
    live at the same time, its equations run in program order: a value lives from the equation
    that makes it to its last use (the outputs to the end); its inputs and constants are not
    counted (they exist before it runs). A nested program (jit, while and scan bodies, cond
    branches, custom derivative rules) adds its own peak, less its outputs (counted outside),
    while its equation runs; a loop body counts once (its carry is reused each iteration).
    Before fusion: XLA fuses element-wise chains and reuses dead buffers (less memory), but may
    schedule differently (more)."""
    cache = {} if _cache is None else _cache
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    held = cache.get(id(jaxpr))
    if held is not None and held[0] is jaxpr:
        return held[1]
    eqns = jaxpr.eqns
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                last_use[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Var):
            last_use[v] = len(eqns)
    live = peak = 0
    frees: dict[int, int] = {}
    for i, eqn in enumerate(eqns):
        out_bytes = sum(aval_bytes(v.aval) for v in eqn.outvars)
        inner = max((peak_live_bytes(sub, cache) for sub in jcore.jaxprs_in_params(eqn.params)), default=0)
        peak = max(peak, live + out_bytes + max(inner - out_bytes, 0))
        for v in eqn.outvars:
            end = last_use.get(v)
            if end is not None:  # never read (a dropped output): freed at once
                size = aval_bytes(v.aval)
                live += size
                frees[end] = frees.get(end, 0) + size
        live -= frees.pop(i, 0)
    cache[id(jaxpr)] = (jaxpr, peak)
    return peak


def _shape(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


# ---------------------------------------------------------------- capacities
def mem_available_bytes(path: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to new allocations (MemAvailable), or, without
    /proc/meminfo, the free physical pages; None when neither is known."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _device_capacity(data_bytes: int) -> tuple[int | None, str]:
    """(bytes one device can hold, where the number comes from)."""
    limit = os.environ.get(LIMIT_ENV)
    if limit:
        try:
            return int(float(limit)), LIMIT_ENV
        except ValueError:
            raise RunError(f"{LIMIT_ENV} must be a number of bytes, got {limit!r}") from None
    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without allocator statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "bytes_limit"
    available = mem_available_bytes()
    if available is None:
        return None, "unknown"
    # On CPU the device is this process's RAM; the data it already holds is counted in the estimate.
    return available + (data_bytes if device.platform == "cpu" else 0), "MemAvailable"


def device_peak_memory_mib(devices=None) -> float | None:
    """The largest ``peak_bytes_in_use`` over ``devices`` (default: this process's local devices),
    in MiB; None where the backend keeps no allocator statistics (XLA:CPU's ``memory_stats()`` is
    None). The peak is the process's since it started: read it once per process for one figure."""
    stats = [device.memory_stats() or {} for device in (jax.local_devices() if devices is None else devices)]
    peaks = [int(s["peak_bytes_in_use"]) for s in stats if "peak_bytes_in_use" in s]
    return max(peaks) / 2 ** 20 if peaks else None


# ---------------------------------------------------------------- a model's weights alone
# ``from_flax``'s peak, in copies of the weights: it initialises them once, eagerly (as ``Model.init``
# does), and each random initialiser's op-by-op intermediates (bits, floats, their transforms) live at the
# same time (measured: docs/design.md, "Constants and the measurements behind them").
BUILD_COPIES = 4


def check_weights_fit(model_name: str, variables: Any, *, capacity_bytes: int | None = None) -> None:
    """Refuses (:class:`RunError`, one line) a model whose weights (``variables``: shapes, e.g. from
    ``jax.eval_shape`` of its init) cannot even be built here: ``BUILD_COPIES`` times their bytes
    exceed the device's capacity (``_device_capacity``). ``from_flax`` calls it before it makes any real
    weight, so a model too large is refused from its shapes, not by the allocator; the run's own
    estimate (:func:`estimate`) then checks everything else."""
    weights = tree_bytes(variables)
    capacity = int(capacity_bytes) if capacity_bytes is not None else _device_capacity(0)[0]
    if capacity is None or BUILD_COPIES * weights <= capacity:
        return
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(variables.get("params", {})))
    raise RunError(f"from_flax: {model_name}'s weights take {_size(weights)} ({count:,} parameters); building "
                   f"and checking them holds up to {BUILD_COPIES} times that ({_size(BUILD_COPIES * weights)}), "
                   f"which exceeds the device's {_size(capacity)}: use a smaller model or a device with more memory")


# ---------------------------------------------------------------- the estimate
@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """A run's estimated peak memory in bytes (what each counts: docs/design.md, "The memory estimate").
    Made by :func:`estimate`; :meth:`with_settings` recomputes it for other settings from the same
    per-client numbers; :meth:`as_dict` is JSON-ready."""
    # The settings it was computed for.
    backend: str
    num_clients: int
    clients_per_round: int
    client_parallelism: str          # the schedule the round runs: map | vmap
    device_count: int                # devices of the run (all processes')
    shard_clients: bool              # the engine splits a vmap cohort over the devices when K divides evenly
    population_devices: int          # devices the population's rows are split over (1: each holds all)
    client_state: str                # device | host
    client_storage: str              # float32 | bfloat16 (host rows)
    chunk_rounds: int                # rounds per device program (host: R, the device holds R x K rows)
    rounds: int
    # Per-client and fixed numbers (shapes and traced programs).
    per_client_row_bytes: int
    per_client_row_float_bytes: int  # of which float32 leaves
    message_bytes: int               # one client's message to the server
    step_bytes: int                  # one client's working memory while it trains
    server_state_bytes: int
    data_bytes: int
    evaluation_bytes: int
    host_evaluation_bytes: int       # evaluation with --client-state host (rows 256 at a time)
    # Derived (set by with_settings / estimate).
    client_state_bytes: int = 0      # all N rows
    device_client_state_bytes: int = 0
    client_devices: int = 1          # devices the cohort is split over
    lockstep_clients: int = 1
    cohort_bytes: int = 0
    activation_bytes: int = 0
    device_total_bytes: int = 0
    host_total_bytes: int = 0
    device_capacity_bytes: int | None = None
    device_capacity_source: str = "unknown"
    host_capacity_bytes: int | None = None
    shared_memory: bool = False      # the device is host memory (CPU): device + host must fit
    seconds: float = 0.0             # time the estimate took

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_settings(self, **changes) -> "MemoryEstimate":
        """The estimate under other settings (``clients_per_round``, ``client_parallelism``,
        ``client_state``, ``client_storage``, ``chunk_rounds``, capacities...),
        assuming one client's numbers do not depend on them."""
        return _derive(dataclasses.replace(self, **changes))

    def fits(self) -> bool:
        return not _shortfalls(self)

    @property
    def run_evaluation_bytes(self) -> int:
        """The evaluation this run makes: the host population's with ``--client-state host``."""
        return self.host_evaluation_bytes if self.client_state == "host" else self.evaluation_bytes


def _host_capacity_rows(touched_per_chunk: int, chunks: int, num_clients: int, start: int = 64) -> int:
    """Rows HostPopulation's buffers end up holding (capacity doubling, population._grow) when
    every chunk brings ``touched_per_chunk`` clients never trained before (an upper bound)."""
    capacity = start
    if touched_per_chunk <= 0:
        return capacity
    final = min(num_clients, chunks * touched_per_chunk)
    while final > capacity:
        # The first chunk that overflows the buffers grows them to max(rows used, twice their size).
        used = min(num_clients, (capacity // touched_per_chunk + 1) * touched_per_chunk)
        capacity = max(used, 2 * capacity)
    return capacity


def _derive(e: MemoryEstimate) -> MemoryEstimate:
    n, k, row = e.num_clients, e.clients_per_round, e.per_client_row_bytes
    sharded = (e.shard_clients and e.client_parallelism == "vmap" and e.device_count > 1
               and k % e.device_count == 0)
    client_devices = e.device_count if sharded else 1
    lockstep = -(-(k if e.client_parallelism == "vmap" else 1) // client_devices)
    cohort = -(-k * (2 * row + e.message_bytes) // client_devices)
    activation = lockstep * e.step_bytes + cohort + e.server_state_bytes
    client_total = n * row
    if e.client_state == "host":
        resident = e.chunk_rounds * k  # padded to this many rows (population._resident)
        device_clients = resident * row
        stored_row = row - (e.per_client_row_float_bytes // 2 if e.client_storage == "bfloat16" else 0)
        chunks = -(-e.rounds // e.chunk_rounds)
        capacity = _host_capacity_rows(min(resident, n), chunks, n) if row else 0
        # Stored rows, slot table, and per chunk: the rows gathered, the next chunk's prefetch, the rows fetched back.
        host = capacity * stored_row + 8 * n + 3 * resident * row
    else:
        device_clients = -(-client_total // e.population_devices)
        host = 0
    device_total = e.server_state_bytes + device_clients + e.data_bytes + max(activation, e.run_evaluation_bytes)
    return dataclasses.replace(e, client_state_bytes=client_total, device_client_state_bytes=device_clients,
                               client_devices=client_devices, lockstep_clients=lockstep, cohort_bytes=cohort,
                               activation_bytes=activation, device_total_bytes=device_total,
                               host_total_bytes=host)


def _trace_client(engine, state, row, data) -> tuple[int, int]:
    """(step_bytes, message_bytes) of one client's client_update, traced for one client (``row``: its
    state's shapes)."""
    alg = engine.algorithm
    payload = jax.eval_shape(alg.broadcast, state.server, state.round)
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    client = (_shape(data.train_x), _shape(data.train_y),
              jax.ShapeDtypeStruct(tuple(data.train_idx.shape[1:]), data.train_idx.dtype), i32)
    closed, out = jax.make_jaxpr(lambda payload, row, client, context: alg.client_update(
        payload, row, ClientData(*client), ClientContext(*context)), return_shape=True)(
        payload, row, client, (i32, i32, state.key, state.key))
    return peak_live_bytes(closed), tree_bytes(out[1])


def _forward_line(predict, server, row, data) -> tuple[float, float]:
    """(intercept, slope per example) of the peak bytes of ``predict(server, row, cid, x)`` on a
    batch gathered from the test pool and preprocessed (traced at two batch sizes, outside any loop
    as the evaluator calls it)."""
    def batch(server, row, test_x, rows):
        return predict(server, row, jnp.int32(0), data.preprocess(test_x[rows]))

    peaks = []
    for b in _PROBE_BATCHES:
        with L.outside_loops():
            closed = jax.make_jaxpr(batch)(server, row, _shape(data.test_x), jax.ShapeDtypeStruct((b,), jnp.int32))
        peaks.append(peak_live_bytes(closed))
    (b1, b2), (p1, p2) = _PROBE_BATCHES, peaks
    slope = max((p2 - p1) / (b2 - b1), 0.0)
    return max(p1 - slope * b1, 0.0), slope


def _evaluation_bytes(engine, state, row, data, row_bytes: int) -> tuple[int, int]:
    """(device-state evaluation, host-population evaluation) peak bytes (docs/design.md)."""
    alg = engine.algorithm
    evaluator = engine.evaluator
    counts = np.asarray(jax.device_get(data.test_count))
    has = counts[counts > 0]
    largest = int(has.max()) if has.size else 1
    global_predict, personal_predict = alg.global_predict, alg.personal_predict
    assert global_predict is not None or personal_predict is not None, \
        "an algorithm predicts with a personal or a global model"
    global_pass = 0
    if global_predict is not None:
        a, b = _forward_line(lambda server, row, cid, x: global_predict(server, x), state.server, row, data)
        global_pass = int(a + b * evaluator.global_eval_batch_size)
    # The personal models' path (per_client): one client at a time, its test set padded to the granularity;
    # without personal models, each client's is the global model's (a, b as traced above).
    if personal_predict is not None:
        a, b = _forward_line(personal_predict, state.server, row, data)
    elif evaluator.eval_shared_global_pass:
        return global_pass, global_pass  # population.evaluate makes the same pass
    else:
        row_bytes = 0  # every client uses the server's model: no rows gathered
    g = evaluator.per_client_granularity
    personal = int(row_bytes + a + b * (-(-largest // g) * g))
    device = max(personal, global_pass)
    # population.evaluate: the rows of up to 256 clients brought to the device and the same path on
    # them (the clients with the largest test sets, to be safe), and the never-trained clients' one
    # model over batches of 512.
    chunk = min(HOST_EVAL_CLIENTS, engine.num_clients)
    host = max(chunk * row_bytes + personal, int(row_bytes + a + b * HOST_EVAL_BATCH), global_pass)
    return device, host


def estimate(experiment, *, capacity_bytes: int | None = None) -> MemoryEstimate:
    """The run's estimated peak memory (docs/design.md), from shapes and traced programs only:
    nothing is compiled or run. ``experiment``: what ``runner.build`` returns.
    ``capacity_bytes`` replaces the device's capacity (tests)."""
    t0 = time.perf_counter()
    config, engine, data = experiment.config, experiment.engine, experiment.data
    mode = "vmap" if config.execution.client_parallelism == "measure" else engine.mode
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    state = jax.eval_shape(engine.init, key)
    n = engine.num_clients
    row_bytes = tree_bytes(state.clients) // n if n else 0
    row_float = _float_bytes(state.clients) // n if n else 0
    data_bytes = tree_bytes(data)
    row = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), state.clients)
    step_bytes, message_bytes = _trace_client(engine, state, row, data)
    evaluation, host_evaluation = _evaluation_bytes(engine, state, row, data, row_bytes)
    population_devices = 1 if engine.population_sharding is None else jax.device_count()
    capacity, source = ((int(capacity_bytes), "capacity_bytes") if capacity_bytes is not None
                        else _device_capacity(data_bytes))
    backend = jax.default_backend()
    est = MemoryEstimate(
        backend=backend, num_clients=n, clients_per_round=engine.clients_per_round,
        client_parallelism=mode, device_count=jax.device_count(),
        shard_clients=engine.shard_clients, population_devices=population_devices,
        client_state=config.execution.client_state, client_storage=config.execution.client_storage,
        chunk_rounds=max(1, min(config.execution.host_chunk_rounds, config.eval_every, config.rounds)),
        rounds=config.rounds,
        per_client_row_bytes=row_bytes, per_client_row_float_bytes=row_float, message_bytes=message_bytes,
        step_bytes=step_bytes, server_state_bytes=tree_bytes(state.server), data_bytes=data_bytes,
        evaluation_bytes=evaluation, host_evaluation_bytes=host_evaluation,
        device_capacity_bytes=capacity, device_capacity_source=source, host_capacity_bytes=mem_available_bytes(),
        shared_memory=backend == "cpu")
    return dataclasses.replace(_derive(est), seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------- fitting
def _size(n: float) -> str:
    if abs(n) >= 2 ** 30:
        return f"{n / 2 ** 30:.2f} GiB"
    return f"{n / 2 ** 20:.1f} MiB" if abs(n) >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"


def _needed(e: MemoryEstimate) -> int:
    """The bytes the device must hold (on CPU, where device and host share one memory, both)."""
    return e.device_total_bytes + (e.host_total_bytes if e.shared_memory else 0)


def _shortfalls(e: MemoryEstimate) -> list[str]:
    """What does not fit: [] when the run fits (an unknown capacity fits)."""
    limits = [("device", _needed(e), e.device_capacity_bytes)]
    if not e.shared_memory:
        limits.append(("host", e.host_total_bytes, e.host_capacity_bytes))
    return [part for part, needed, capacity in limits if capacity is not None and needed > capacity]


def _largest_cohort(e: MemoryEstimate) -> int | None:
    """The largest --clients-per-round below the current one that fits, or None."""
    for k in range(e.clients_per_round - 1, 0, -1):
        if e.with_settings(clients_per_round=k).fits():
            return k
    return None


def _state_fixes(e: MemoryEstimate) -> list[tuple[str, MemoryEstimate]]:
    """Ways to shrink the client state, most preferred first: (flags, estimate with them)."""
    fixes: list[tuple[str, MemoryEstimate]] = []
    if e.client_state == "device" and e.per_client_row_bytes:
        host = e.with_settings(client_state="host")
        fixes.append((arg("client_state", "host"), host))
        if e.per_client_row_float_bytes:
            fixes.append((f"{arg('client_state', 'host')} {arg('client_storage', 'bfloat16')}",
                          host.with_settings(client_storage="bfloat16")))
    if e.client_state == "host" and e.client_storage == "float32" and e.per_client_row_float_bytes:
        fixes.append((arg("client_storage", "bfloat16"), e.with_settings(client_storage="bfloat16")))
    if e.client_state == "host" and e.chunk_rounds > 1:
        fixes.append((arg("host_chunk_rounds", 1), e.with_settings(chunk_rounds=1)))
    return fixes


def _training_fixes(e: MemoryEstimate) -> list[tuple[str, MemoryEstimate]]:
    """Ways to shrink the round's working memory: map (same results), then the largest cohort that fits."""
    fixes: list[tuple[str, MemoryEstimate]] = []
    if e.client_parallelism == "vmap":
        fixes.append((arg("client_parallelism", "map"), e.with_settings(client_parallelism="map")))
    k = _largest_cohort(e)
    if k is not None:
        fixes.append((arg("clients_per_round", k), e.with_settings(clients_per_round=k)))
    return fixes


def _fixes(e: MemoryEstimate, largest: str) -> list[tuple[str, MemoryEstimate]]:
    """Candidate (flags, estimate with them), the fixes of the largest part first, then pairs of a
    client-state fix and a training fix."""
    state, training = _state_fixes(e), _training_fixes(e)
    singles = state + training if largest == "client state" else training + state
    pairs = [(f"{flags} {more}", fix) for flags, fixed in state for more, fix in _training_fixes(fixed)]
    return singles + pairs


def _part_sizes(e: MemoryEstimate) -> dict[str, int]:
    return {"client state": e.device_client_state_bytes + (e.host_total_bytes if e.shared_memory else 0),
            "training": e.activation_bytes, "evaluation": e.run_evaluation_bytes, "data": e.data_bytes}


def check_fits(estimate: MemoryEstimate, config=None, *, capacity_bytes: int | None = None) -> None:
    """Raises :class:`RunError` in one line when the run does not fit: the estimate and the capacity,
    the largest part, and the flags that make it fit, the largest part's first (which flags: docs/design.md,
    "A run's files and their safety"), or that no flag does. ``config`` plays no part (the estimate carries
    its settings; accepted for the callers' convenience). ``capacity_bytes`` replaces the device's capacity."""
    e = estimate if capacity_bytes is None else estimate.with_settings(device_capacity_bytes=int(capacity_bytes))
    short = _shortfalls(e)
    if not short:
        return
    parts = _part_sizes(e)
    if short == ["host"]:
        trained = min(e.num_clients, e.rounds * e.clients_per_round)
        where = (f"estimated host memory {_size(e.host_total_bytes)} (the rows of up to {trained} trained clients) "
                 f"exceeds the {_size(e.host_capacity_bytes or 0)} available")
        largest = "client state"
    else:
        what = "device + host memory (one memory on CPU)" if e.shared_memory and e.host_total_bytes else "device memory"
        where = f"estimated {what} {_size(_needed(e))} exceeds the device's {_size(e.device_capacity_bytes or 0)}"
        largest = max(parts, key=parts.__getitem__)
        labels = {"client state": f"the client state ({e.num_clients} clients x {_size(e.per_client_row_bytes)}"
                                  f"{', rows on the host' if e.client_state == 'host' else ''}) takes "
                                  f"{_size(parts['client state'])}",
                  "training": f"training {e.lockstep_clients} client(s) at once ({e.client_parallelism}, "
                              f"{e.clients_per_round} per round) takes {_size(e.activation_bytes)}",
                  "evaluation": f"evaluation takes {_size(parts['evaluation'])}",
                  "data": f"the data (images and index rows) takes {_size(e.data_bytes)}"}
        where += f": {labels[largest]}, the largest part"
    candidates = _fixes(e, largest)
    fixes = [(flags, fixed) for flags, fixed in candidates if fixed.fits()]
    if fixes:
        advice = " or ".join(f"{flags} (estimated {_size(_needed(fixed))})" for flags, fixed in fixes[:2])
        raise RunError(f"{where}; to fit, use {advice}")
    if largest == "data":
        raise RunError(f"{where}; no flag makes it fit: use fewer clients (shorter index rows) or a smaller data set")
    closest = ""
    if candidates:
        flags, fixed = min(candidates, key=lambda c: _needed(c[1]))
        closest = f"; the closest, {flags}, still needs {_size(_needed(fixed))}"
    raise RunError(f"{where}; no flag here makes it fit{closest}: use a smaller model, {arg('batch_size')} or data "
                   "set, or a device with more memory")


def format_estimate(estimate: MemoryEstimate) -> str:
    """One line for the run to print."""
    e = estimate
    capacity = "unknown capacity" if e.device_capacity_bytes is None else _size(e.device_capacity_bytes)
    state = e.server_state_bytes + e.device_client_state_bytes
    line = (f"memory estimate: device {_size(e.device_total_bytes)} = state {_size(state)} + data "
            f"{_size(e.data_bytes)} + max(training {_size(e.activation_bytes)}, eval {_size(e.run_evaluation_bytes)})"
            f" of {capacity}")
    if e.client_state == "host" or e.host_total_bytes:
        line += f"; host {_size(e.host_total_bytes)}"
        if e.host_capacity_bytes is not None:
            line += f" of {_size(e.host_capacity_bytes)}"
    return line
