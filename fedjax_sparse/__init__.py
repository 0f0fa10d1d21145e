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
  (the built-in data sets, ``npz:PATH``), ``partition_dataset``;
* ``fjs.mechanisms``: the papers' mechanisms as pure array functions (threshold masks, SyncDrop,
  supermasks, robust aggregation, attacks).

Running: ``run``, ``RunConfig``, ``RunResult``, ``build`` (the ``Experiment`` a run would use:
data, task, engine), ``Engine`` (the round engine, for your own loops), ``with_aggregator`` and
``with_attack`` (robust aggregation and poisoning around any algorithm). Reading results:
``format_summary``, ``plot_runs``, ``report_table``.
"""
from fedjax_sparse import algorithms, data, mechanisms, models
from fedjax_sparse.algorithms import Algorithm, ClientContext, ServerContext, Task, client_metrics
from fedjax_sparse.algorithms.compose import with_aggregator, with_attack
from fedjax_sparse.config import RunConfig, RunError
from fedjax_sparse.engine import Engine, EngineState
from fedjax_sparse.models import Hooks, Model
from fedjax_sparse.reporting import plot_runs, report_table
from fedjax_sparse.runner import Experiment, RunResult, build, format_summary, run

__version__ = "0.1.0"

__all__ = ["Algorithm", "ClientContext", "Engine", "EngineState", "Experiment", "Hooks", "Model", "RunConfig",
           "RunError", "RunResult", "ServerContext", "Task", "algorithms", "build", "client_metrics", "data",
           "format_summary", "mechanisms", "models", "plot_runs", "report_table", "run", "with_aggregator",
           "with_attack"]
