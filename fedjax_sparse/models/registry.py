"""Name -> model builder. A builder takes (input_shape, num_classes, **options)."""
from __future__ import annotations

from typing import Callable

from fedjax_sparse.models.base import Model

_BUILDERS: dict[str, Callable[..., Model]] = {}


def register_model(name: str):
    def wrap(builder):
        if name in _BUILDERS:
            raise ValueError(f"model {name!r} registered twice")
        _BUILDERS[name] = builder
        return builder
    return wrap


def model_names() -> list[str]:
    return sorted(_BUILDERS)


def make_model(name: str, input_shape, num_classes: int, **options) -> Model:
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(model_names())}")
    return _BUILDERS[name](tuple(input_shape), int(num_classes), **options)
