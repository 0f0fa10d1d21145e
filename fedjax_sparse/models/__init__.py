"""Models: the Model/Hooks abstraction, ``from_flax`` (any Flax module as a Model), pure layers and the
zoo (a name registry of the papers' models)."""
from fedjax_sparse.models.base import (Conv, Dense, Flatten, GlobalAvgPool, Hooks, LayerInfo,
                                       MaxPool, Model, NO_HOOKS, sequential)
from fedjax_sparse.models.flax.adapter import from_flax
from fedjax_sparse.models.registry import make_model, model_names, register_model
# Importing the zoo registers its models; each paper's models live in their own module (models/zoo/).
from fedjax_sparse.models import zoo  # noqa: F401

__all__ = ["Conv", "Dense", "Flatten", "GlobalAvgPool", "Hooks", "LayerInfo", "MaxPool", "Model",
           "NO_HOOKS", "from_flax", "make_model", "model_names", "register_model", "sequential"]
