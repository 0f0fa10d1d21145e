"""Name -> model builder. A builder takes (input_shape, num_classes, **options)."""
from __future__ import annotations

import inspect
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


def model_options(name: str) -> dict[str, object]:
    """The options (``--model-option KEY=VALUE``) model ``name`` accepts, with their defaults.
    A builder's ``**options`` are passed on to ``sequential`` (every builder here does that)."""
    from fedjax_sparse.models.base import sequential
    parameters = list(inspect.signature(_BUILDERS[name]).parameters.values())[2:]
    accepted = {p.name: p.default for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        accepted.update({p.name: p.default for p in inspect.signature(sequential).parameters.values()
                         if p.kind == p.KEYWORD_ONLY})
    return accepted


def make_model(name: str, input_shape, num_classes: int, **options) -> Model:
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(model_names())}")
    accepted = model_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "none"
        raise ValueError(f"unknown --model-option {', '.join(unknown)} for model {name}; accepted: {valid}")
    return _BUILDERS[name](tuple(input_shape), int(num_classes), **options)
