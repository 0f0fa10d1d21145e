"""Name -> model builder. A builder takes (input_shape, num_classes, **options)."""
from __future__ import annotations

import inspect
from typing import Callable

from fedjax_sparse.errors import arg, in_callers_words
from fedjax_sparse.models.base import Model, sequential
from fedjax_sparse.schema import Option, resolve

_BUILDERS: dict[str, Callable[..., Model]] = {}


def register_model(name: str):
    def wrap(builder):
        old = _BUILDERS.get(name)
        # A re-run notebook cell (or a reloaded module) defines the same function again: it replaces the old one.
        if old is not None and (old.__module__, old.__qualname__) != (builder.__module__, builder.__qualname__):
            raise ValueError(f"model {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
                             "choose another name")
        _BUILDERS[name] = builder
        return builder
    return wrap


def model_names() -> list[str]:
    return sorted(_BUILDERS)


def model_options(name: str) -> dict[str, object]:
    """The options (``--model-option KEY=VALUE``) model ``name`` accepts, with their defaults.
    A builder's ``**options`` are passed on to ``sequential`` (every builder here does that)."""
    parameters = list(inspect.signature(_BUILDERS[name]).parameters.values())[2:]
    accepted = {p.name: p.default for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        accepted.update({p.name: p.default for p in inspect.signature(sequential).parameters.values()
                         if p.kind == p.KEYWORD_ONLY})
    return accepted


def resolve_model_options(name: str, options: dict) -> dict:
    """``options`` of the registered model ``name`` (texts or values) typed as their defaults are (a
    ``--model-option hidden=100`` is 100, ``init=3`` the string '3'); a one-line ValueError for an
    unknown model, an unknown key (listing the accepted ones) or a value of another type."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(model_names())}")
    accepted = model_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "none"
        raise ValueError(f"unknown {arg('model_option')} {', '.join(unknown)} for model {name}; accepted: {valid}")
    # A default of None declares no type: its value is read as JSON spells it.
    schema = {key: Option(None if default is None else type(default), default) for key, default in accepted.items()}
    return resolve(schema, options, arg("model_option"), f"model {name}")


def is_model_reference(name: str) -> bool:
    """Whether ``name`` has the form ``package.module:Name`` (a user's Flax module)."""
    module, sep, attribute = name.partition(":")
    return bool(sep and module and attribute.isidentifier())


def load_model_reference(name: str, **options):
    """``package.module:Name`` -> the object it names, built: a Module class or a zero-argument
    factory is called (with ``options`` as keyword arguments), an instance is returned as is. The
    working directory is on ``sys.path`` so a file next to the command is found."""
    import importlib
    import os
    import sys
    module_name, _, attribute = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{arg('model', name)}: cannot import {module_name} ({e}); run from the folder that holds it "
                         "or install it") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{arg('model', name)}: {module_name} has no attribute {attribute!r}")
    target = getattr(module, attribute)
    what = "a Flax module (flax.linen / flax.nnx), a Model, or a factory building one without arguments"
    if isinstance(target, type) and not issubclass(target, _model_types()):
        raise ValueError(f"{arg('model', name)}: {module_name}.{attribute} is the class {target.__name__}, not {what}")
    if isinstance(target, _model_types()):
        if options:
            raise ValueError(f"{arg('model', name)} is an instance; {arg('model_option')} needs a class or factory")
        return target
    if not callable(target):
        raise ValueError(f"{arg('model', name)}: {module_name}.{attribute} is a {type(target).__name__}, not {what}")
    if not isinstance(target, type) and _needs_arguments(target, options):
        raise ValueError(f"{arg('model', name)}: {module_name}.{attribute} is a function that needs argument(s) "
                         f"{', '.join(_needs_arguments(target, options))}, not {what}")
    try:
        built = target(**options)
    except TypeError as e:
        raise ValueError(f"{arg('model', name)}: building it failed ({e}); a Module class must build without "
                         f"arguments (or with {arg('model_option', 'KEY=VALUE')} ones)") from None
    if not isinstance(built, _model_types()):
        raise ValueError(f"{arg('model', name)}: {module_name}.{attribute}() returned a {type(built).__name__}, "
                         f"not {what}")
    return built


def _model_types() -> tuple:
    """What ``--model package.module:Name`` may name: a Flax module (linen or nnx) or a :class:`Model`."""
    import flax.linen as nn
    from flax import nnx
    return (nn.Module, nnx.Module, Model)


def _needs_arguments(function, options: dict) -> list[str]:
    """The required parameters of ``function`` that ``options`` do not give ([] when unknown)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is p.empty and p.name not in options
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


@in_callers_words
def make_model(name: str, input_shape, num_classes: int, **options) -> Model:
    if is_model_reference(name):
        from fedjax_sparse.models.flax.adapter import from_flax
        target = load_model_reference(name, **options)
        if isinstance(target, Model):
            return target
        return from_flax(target, input_shape, num_classes=num_classes, name=name)
    return _BUILDERS[name](tuple(input_shape), int(num_classes), **resolve_model_options(name, options))
