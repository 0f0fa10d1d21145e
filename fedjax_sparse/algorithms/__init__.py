"""Federated algorithms. Importing a module registers its algorithms."""
from fedjax_sparse.algorithms.base import (Algorithm, ClientContext, ServerContext, Task, client_metrics,
                                           replicate, tree_weighted_mean)
from fedjax_sparse.algorithms.registry import (algorithm_defaults, algorithm_names, algorithm_options,
                                               make_algorithm, register_algorithm, resolve_options)
from fedjax_sparse.algorithms import fedavg  # noqa: F401
from fedjax_sparse.algorithms import baselines, feddrop  # noqa: F401
from fedjax_sparse.algorithms import spafl  # noqa: F401
from fedjax_sparse.algorithms import fsl, robust  # noqa: F401

__all__ = ["Algorithm", "ClientContext", "ServerContext", "Task", "algorithm_defaults", "algorithm_names",
           "algorithm_options", "client_metrics", "make_algorithm", "register_algorithm", "replicate",
           "resolve_options", "tree_weighted_mean"]
