"""Federated algorithms. Every module of this package is imported here, which
registers its algorithms: adding an algorithm is one new file (plus its tests).

Each registered algorithm is also a plain builder function of this package,
``fedjax_sparse.algorithms.spafl(task, alpha=0.002) -> Algorithm``, with its options
as typed keyword arguments (defaults as in ``--option``). A module is named for the
family it holds, never as one of its algorithms (the builder would take the module's
place as the package's attribute): ``from fedjax_sparse.algorithms.spafl_family import ...``.
"""
import dataclasses
import importlib
import inspect
import pkgutil

from fedjax_sparse.core.algorithm import (Algorithm, ClientContext, ServerContext, Task, client_metrics,
                                           replicate, tree_weighted_mean)
from fedjax_sparse.algorithms.supervised import local_train, predict_fn, sgd
from fedjax_sparse.algorithms.registry import (algorithm_defaults, algorithm_entry, algorithm_names, algorithm_options,
                                               make_algorithm, register_algorithm, resolve_options)

# Building blocks for your own algorithms: local_train (local SGD epochs over a client's data),
# sgd (PyTorch-style SGD as an optax chain), predict_fn, tree_weighted_mean, client_metrics.
_INFRASTRUCTURE = {"registry", "supervised"}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _INFRASTRUCTURE and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")


def builder(name: str):
    """``name``'s builder as a function ``(task, **options) -> Algorithm`` whose signature lists the
    options with their types and defaults (what ``help()`` and notebooks' completion show)."""
    options = algorithm_options(name)

    def build(task: Task, **options) -> Algorithm:
        return make_algorithm(name, task, options)
    parameters = [inspect.Parameter("task", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Task)]
    parameters += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                     annotation=type(f.default)) for f in dataclasses.fields(options)]
    build.__signature__ = inspect.Signature(parameters, return_annotation=Algorithm)  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = name
    registered = algorithm_entry(name).builder
    build.__doc__ = (inspect.getdoc(registered) or f"The {name} algorithm.") + (
        "\n\nOptions (keyword arguments, also ``--option KEY=VALUE``): "
        + ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(options)) + ".")
    return build


_MODULES = {m.name for m in pkgutil.iter_modules(__path__)}
for _name in algorithm_names():
    if _name in _MODULES:
        raise ImportError(f"algorithm {_name!r} is registered by a module of the same name, whose place its builder "
                          f"would take: rename algorithms/{_name}.py for its family ({_name}_family.py)")
    globals()[_name] = builder(_name)

__all__ = ["Algorithm", "ClientContext", "ServerContext", "Task", "algorithm_defaults", "algorithm_names",
           "algorithm_options", "builder", "client_metrics", "local_train", "make_algorithm", "predict_fn",
           "register_algorithm", "replicate", "resolve_options", "sgd", "tree_weighted_mean", *algorithm_names()]
