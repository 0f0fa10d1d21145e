"""fedjax_sparse: communication- and computation-efficient federated learning in JAX.

The library's front door; a notebook needs nothing else::

    import fedjax_sparse as fjs

    data = fjs.data.from_arrays(x_train, y_train, x_test, y_test, train_client_ids, test_client_ids)
    model = fjs.models.from_flax(MyCNN(), input_shape=(28, 28, 1))
    result = fjs.run(fjs.RunConfig(algorithm="spafl", rounds=20, clients_per_round=10), model=model, data=data)
    result.summary["final_accuracy"], result.state.server

Namespaces:

* ``fjs.algorithms``: one builder per algorithm, ``fjs.algorithms.spafl(task, alpha=0.002)``, plus
  ``Algorithm``, ``Task``, ``client_metrics`` to write your own (an algorithm is data plus pure
  functions: init, broadcast, client update, server update);
* ``fjs.models``: ``from_flax`` (any ``flax.linen`` / ``flax.nnx`` module), the zoo
  (``make_model``, ``model_names``), ``Model`` and ``Hooks``;
* ``fjs.data``: ``from_arrays`` (your arrays and client ids, or a partition spec), ``load``
  (the built-in data sets, ``npz:PATH``), ``partition``;
* ``fjs.mechanisms``: the papers' mechanisms as pure array functions (threshold masks, SyncDrop,
  supermasks, robust aggregation, attacks).

Running: ``run``, ``RunConfig``, ``RunResult``, ``build`` (the ``Experiment`` a run would use:
data, task, engine), ``Engine`` (the round engine, for your own loops), ``with_aggregator`` and
``with_attack`` (robust aggregation and poisoning around any algorithm), ``with_dp`` (client-level
differential privacy, DP-FedAvg; ``RunConfig(dp_clip=..., dp_target_epsilon=...)`` wraps and accounts
for a run), ``sweep`` (a grid of
hyper-parameters x seeds in one process: ``fjs.sweep(config, {"lr": [0.01, 0.1]}, seeds=[0, 1, 2])``
returns a ``SweepResult`` with the mean +- std table). Reading results:
``format_summary``, ``plot_runs``, ``report_table``.

Names are imported on first use, so ``import fedjax_sparse.mechanisms`` alone still loads no engine,
data or algorithm module.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

try:   # the installed distribution's version (pyproject.toml's; the CHANGELOG's top section names it)
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version
    __version__ = _version("fedjax_sparse")
except PackageNotFoundError:   # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

# name -> the module that defines it (loaded on first access: PEP 562).
_EXPORTS = {
    "Algorithm": "fedjax_sparse.core.algorithm", "ClientContext": "fedjax_sparse.core.algorithm",
    "ServerContext": "fedjax_sparse.core.algorithm", "Task": "fedjax_sparse.core.algorithm",
    "client_metrics": "fedjax_sparse.core.algorithm",
    "with_aggregator": "fedjax_sparse.algorithms.compose", "with_attack": "fedjax_sparse.algorithms.compose",
    "with_dp": "fedjax_sparse.algorithms.private",
    "RunConfig": "fedjax_sparse.driver.config", "RunError": "fedjax_sparse.errors",
    "Engine": "fedjax_sparse.core.engine", "EngineState": "fedjax_sparse.core.engine",
    "Hooks": "fedjax_sparse.models.base", "Model": "fedjax_sparse.models.base",
    "plot_runs": "fedjax_sparse.tools.reporting", "report_table": "fedjax_sparse.tools.reporting",
    "Experiment": "fedjax_sparse.driver.experiment", "RunResult": "fedjax_sparse.driver.runner",
    "RunStopped": "fedjax_sparse.errors",
    "sweep": "fedjax_sparse.driver.sweeps", "SweepResult": "fedjax_sparse.driver.sweeps",
    "build": "fedjax_sparse.driver.experiment", "format_summary": "fedjax_sparse.driver.progress",
    "run": "fedjax_sparse.driver.runner",
}
_NAMESPACES = ("algorithms", "data", "mechanisms", "models")

__all__ = sorted([*_EXPORTS, *_NAMESPACES])


def __getattr__(name: str):
    if name in _NAMESPACES:
        # The whole package is registered (algorithms, models) once a namespace is used.
        return importlib.import_module(f"{__name__}.{name}")
    if name in _EXPORTS:
        importlib.import_module(f"{__name__}.algorithms")   # registers every algorithm for run/build
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and the API reference see
    from fedjax_sparse import algorithms, data, mechanisms, models  # noqa: F401
    from fedjax_sparse.core.algorithm import Algorithm, ClientContext, ServerContext, Task, client_metrics  # noqa: F401
    from fedjax_sparse.algorithms.compose import with_aggregator, with_attack  # noqa: F401
    from fedjax_sparse.algorithms.private import with_dp  # noqa: F401
    from fedjax_sparse.driver.sweeps import SweepResult, sweep  # noqa: F401
    from fedjax_sparse.driver.config import RunConfig  # noqa: F401
    from fedjax_sparse.core.engine import Engine, EngineState  # noqa: F401
    from fedjax_sparse.models.base import Hooks, Model  # noqa: F401
    from fedjax_sparse.tools.reporting import plot_runs, report_table  # noqa: F401
    from fedjax_sparse.errors import RunError, RunStopped  # noqa: F401
    from fedjax_sparse.driver.experiment import Experiment, build  # noqa: F401
    from fedjax_sparse.driver.progress import format_summary  # noqa: F401
    from fedjax_sparse.driver.runner import RunResult, run  # noqa: F401
