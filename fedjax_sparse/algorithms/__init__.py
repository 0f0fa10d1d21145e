"""Federated algorithms. Every module of this package is imported here, which
registers its algorithms: adding an algorithm is one new file (plus its tests)."""
import importlib
import pkgutil

from fedjax_sparse.algorithms.base import (Algorithm, ClientContext, ServerContext, Task, client_metrics,
                                           replicate, tree_weighted_mean)
from fedjax_sparse.algorithms.registry import (algorithm_defaults, algorithm_names, algorithm_options,
                                               make_algorithm, register_algorithm, resolve_options)

_INFRASTRUCTURE = {"base", "registry", "supervised"}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _INFRASTRUCTURE and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["Algorithm", "ClientContext", "ServerContext", "Task", "algorithm_defaults", "algorithm_names",
           "algorithm_options", "client_metrics", "make_algorithm", "register_algorithm", "replicate",
           "resolve_options", "tree_weighted_mean"]
