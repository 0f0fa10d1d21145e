"""Name -> algorithm builder, with declared options and their defaults.

A builder is ``make(task, **options) -> Algorithm``; registering it with its
option defaults lets the CLI and config files validate ``--option k=v``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fedjax_sparse.algorithms.base import Algorithm, Task


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    name: str
    builder: Callable[..., Algorithm]
    defaults: dict


_REGISTRY: dict[str, AlgorithmEntry] = {}


def register_algorithm(name: str, defaults: dict | None = None):
    def wrap(builder):
        if name in _REGISTRY:
            raise ValueError(f"algorithm {name!r} registered twice")
        _REGISTRY[name] = AlgorithmEntry(name, builder, dict(defaults or {}))
        return builder
    return wrap


def algorithm_names() -> list[str]:
    return sorted(_REGISTRY)


def algorithm_defaults(name: str) -> dict:
    return dict(_entry(name).defaults)


def _entry(name: str) -> AlgorithmEntry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; valid algorithms: {', '.join(algorithm_names())}")
    return _REGISTRY[name]


def coerce_option(name: str, key: str, value: Any, default: Any) -> Any:
    """Converts a CLI string to the default's type; explains a bad value."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise ValueError(f"option {key}={value!r} of {name}: expected a {type(default).__name__} "
                         f"(default {default!r})") from None
    return value


def resolve_options(name: str, options: dict | None) -> dict:
    entry = _entry(name)
    options = dict(options or {})
    unknown = sorted(set(options) - set(entry.defaults))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in sorted(entry.defaults.items())) or "(none)"
        raise ValueError(f"unknown option(s) {unknown} for algorithm {name!r}; valid options: {valid}")
    resolved = dict(entry.defaults)
    for key, value in options.items():
        resolved[key] = coerce_option(name, key, value, entry.defaults[key])
    return resolved


def make_algorithm(name: str, task: Task, options: dict | None = None) -> Algorithm:
    resolved = resolve_options(name, options)
    algorithm = _entry(name).builder(task, **resolved)
    return dataclasses.replace(algorithm, hparams={**resolved, **algorithm.hparams})
