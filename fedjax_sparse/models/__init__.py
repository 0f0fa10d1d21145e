"""Models: pure layers, the Model/Hooks abstraction and a name registry."""
from fedjax_sparse.models.base import (Conv, Dense, Flatten, GlobalAvgPool, Hooks, LayerInfo,
                                       MaxPool, Model, NO_HOOKS, sequential)
from fedjax_sparse.models.registry import make_model, model_names, register_model
# Importing a module registers its models; each paper's models live in their own module.
from fedjax_sparse.models import zoo  # noqa: F401
from fedjax_sparse.models import spafl_models  # noqa: F401
from fedjax_sparse.models import feddrop_models  # noqa: F401
from fedjax_sparse.models import fsl_models  # noqa: F401

__all__ = ["Conv", "Dense", "Flatten", "GlobalAvgPool", "Hooks", "LayerInfo", "MaxPool", "Model",
           "NO_HOOKS", "make_model", "model_names", "register_model", "sequential"]
