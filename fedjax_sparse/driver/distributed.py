"""Multi-process runs on JAX's own runtime (``jax.distributed``): every process runs the same
program (SPMD); :func:`initialize` joins them into one runtime, the engine splits the cohort over one
global ``clients`` mesh, process 0 writes the files (:func:`is_primary`) and every process
checkpoints its own shards. Launch: ``--coordinator HOST:PORT --num-processes N --process-id I``
(or ``ENVIRONMENT``'s variables) on every process; what lives where: docs/scaling.md.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from fedjax_sparse.errors import RunError
from fedjax_sparse.driver.settings import flag_of

ENVIRONMENT = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> int:
    """Joins this process to a multi-process run; returns the process count (1: nothing to do).

    Each argument falls back to its environment variable (:data:`ENVIRONMENT`). All three are
    needed for more than one process; none (or ``num_processes`` 1) means a single process.
    Must run before anything touches a JAX device."""
    given: dict[str, Any] = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for name, variable in ENVIRONMENT.items():
        if given[name] is None and os.environ.get(variable):
            raw = os.environ[variable]
            try:
                given[name] = raw if name == "coordinator" else int(raw)
            except ValueError:
                raise RunError(f"{variable}={raw!r} is not an integer; set it to a number") from None
    if given["num_processes"] in (None, 1) and given["coordinator"] is None:
        return 1
    missing = [f"{flag_of(name)} (or {ENVIRONMENT[name]})" for name, value in given.items()
               if value is None]
    if missing:
        raise RunError(f"a multi-process run needs {', '.join(missing)} as well; give all three of "
                       "--coordinator HOST:PORT, --num-processes N and --process-id I")
    count, index = int(given["num_processes"]), int(given["process_id"])
    if count < 1 or not 0 <= index < count:
        raise RunError(f"--process-id {index} must be between 0 and --num-processes - 1 ({count - 1}); "
                       "number the processes 0, 1, ...")
    if ":" not in str(given["coordinator"]):
        raise RunError(f"--coordinator {given['coordinator']!r} must be HOST:PORT (e.g. localhost:12355), "
                       "the address of process 0")
    if count == 1:
        return 1
    jax.distributed.initialize(str(given["coordinator"]), num_processes=count, process_id=index)
    return jax.process_count()


def multi_process() -> bool:
    return jax.process_count() > 1


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0; always True in a single process)."""
    return jax.process_index() == 0


def replicated_sharding() -> jax.sharding.NamedSharding:
    """A copy on every device of every process."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("clients",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def to_global(tree):
    """``tree``'s arrays as global arrays replicated over all processes' devices (unchanged in a
    single process). Every process must pass the same values: they are built from the same config
    and seed, and a resumed state from the same checkpoint."""
    if not multi_process():
        return tree
    sharding = replicated_sharding()

    def place(leaf):
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        if isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
            return jax.device_put(np.asarray(leaf), sharding)
        return leaf
    return jax.tree_util.tree_map(place, tree)


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier ``name`` (no-op in a single process)."""
    if multi_process():
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def stop_together(step: str, error: Exception | None) -> None:
    """Every process calls this once after ``step``, with the error it hit (or None): if any
    process failed, every process raises (its own error, or one naming the failed process), so no
    process is left waiting in a collective for one that has exited. No-op in a single process
    except re-raising ``error``."""
    if multi_process():
        from jax.experimental import multihost_utils
        failed = np.asarray(multihost_utils.process_allgather(np.array([error is not None])), bool).ravel()
    else:
        failed = np.array([error is not None])
    if error is not None:
        raise error
    if failed.any():
        raise RunError(f"process {int(np.flatnonzero(failed)[0])} stopped while {step} (its own error names the "
                       "problem and the fix); this process stops too")
