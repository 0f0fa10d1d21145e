"""Name -> algorithm builder, with typed options.

Every algorithm registers once (:func:`register_algorithm`: its options, whether the composition
wrappers apply, what ``list`` shows), so a new algorithm is one file. ``resolve_options`` turns user
input (CLI strings from ``--option KEY=VALUE``, or JSON values from a config file) into an instance of
its options dataclass, with a one-line error that names the flag.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fedjax_sparse.core.algorithm import Algorithm, Task


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    name: str
    builder: Callable[..., Algorithm]
    options: type   # a frozen dataclass
    # Why --aggregator / --attack cannot wrap it ("its clients send ..."), as a function of its
    # options instance (None: they can); None: its clients always send float updates.
    unwrappable: Callable[[Any], str | None] | None = None
    description: str | None = None   # what it is, one line (``list``); None: "(your algorithm)"
    paper: str | None = None         # where it comes from ("McMahan et al., AISTATS 2017"), or None
    lr: float | None = None          # the client lr when none is given; None: catalog.DEFAULT_LR

    @property
    def defaults(self) -> dict:
        return {f.name: f.default for f in dataclasses.fields(self.options)}


_REGISTRY: dict[str, AlgorithmEntry] = {}


def options_class(name: str, defaults: dict) -> type:
    """A frozen dataclass ``<Name>Options`` with one field per default, typed by the default."""
    class_name = "".join(part.capitalize() for part in name.split("_")) + "Options"
    fields = [(key, type(value), dataclasses.field(default=value)) for key, value in defaults.items()]
    cls = dataclasses.make_dataclass(class_name, fields, frozen=True)
    cls.__doc__ = f"Options of algorithm {name!r} (--option KEY=VALUE)."
    return cls


def register_algorithm(name: str, options: type | dict | None = None, *,
                       unwrappable: str | Callable[[Any], str | None] | None = None,
                       description: str | None = None, paper: str | None = None, lr: float | None = None):
    """Registers ``builder(task, **options)`` under ``name``. ``options``: a frozen
    dataclass type, or a dict of defaults (a dataclass is made from it).

    ``description`` (one line), ``paper`` and ``lr`` (the client learning rate a run takes when none
    is given; None: ``catalog.DEFAULT_LR``) are what ``list`` shows and ``--lr`` defaults to.
    ``unwrappable``: None when the clients send float pytrees the server averages (the wrappers of
    ``compose`` apply); else the reason they cannot ("its clients send rankings (integers), not float
    updates"), or a function of the options instance returning it or None."""
    if options is None or isinstance(options, dict):
        options = options_class(name, dict(options or {}))
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"options of {name!r} must be a dataclass type or a dict of defaults")
    if lr is not None and not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0):
        raise ValueError(f"lr={lr!r} of algorithm {name!r} must be a positive number (or None: the default)")

    def wrap(builder):
        old = _REGISTRY.get(name)
        if old is not None and (old.builder.__module__, old.builder.__qualname__) != (builder.__module__,
                                                                                      builder.__qualname__):
            # The same definition again (a re-run notebook cell) replaces the entry; another one is refused.
            raise ValueError(f"algorithm {name!r} is already registered by {old.builder.__module__}."
                             f"{old.builder.__qualname__}; choose another name")
        refusal = (lambda _options: unwrappable) if isinstance(unwrappable, str) else unwrappable
        _REGISTRY[name] = AlgorithmEntry(name, builder, options, refusal, description, paper,
                                         None if lr is None else float(lr))
        return builder
    return wrap


def algorithm_names() -> list[str]:
    return sorted(_REGISTRY)


def algorithm_options(name: str) -> type:
    """The options dataclass of an algorithm."""
    return algorithm_entry(name).options


def algorithm_defaults(name: str) -> dict:
    return dict(algorithm_entry(name).defaults)


def algorithm_entry(name: str) -> AlgorithmEntry:
    """The registered builder and options of ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; valid algorithms: {', '.join(algorithm_names())}")
    return _REGISTRY[name]


def wrapper_refusal(name: str, options: Any = None) -> str | None:
    """Why ``--aggregator`` / ``--attack`` cannot wrap algorithm ``name`` with these options
    ("its clients send ..."), or None when they can (see ``register_algorithm``)."""
    entry = algorithm_entry(name)
    return None if entry.unwrappable is None else entry.unwrappable(resolve_options(name, options))


def _type_name(kind: type) -> str:
    """``kind`` with its article, for errors."""
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
        kind, f"a {kind.__name__}")


# What a CLI string means as a boolean option.
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def coerce_option(name: str, key: str, value: Any, kind: type) -> Any:
    """``value`` (a CLI string or a JSON value) as a ``kind``; a one-line ValueError otherwise."""
    bad = ValueError(f"--option {key}={value!r} of algorithm {name}: expected {_type_name(kind)}")
    if isinstance(value, str) and kind in (bool, int, float):
        text = value.strip().lower()
        try:
            return _BOOLEANS[text] if kind is bool else kind(text)
        except (KeyError, ValueError):
            raise bad from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise bad
    return value


def resolve_options(name: str, options: Any = None):
    """User options (dict, or already an options instance) -> the algorithm's options dataclass instance."""
    entry = algorithm_entry(name)
    if isinstance(options, entry.options):
        return options
    options = dict(options or {})
    known = {f.name: f for f in dataclasses.fields(entry.options)}
    unknown = sorted(set(options) - set(known))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in sorted(entry.defaults.items())) or "(none)"
        raise ValueError(f"unknown option(s) {unknown} for algorithm {name!r} (--option KEY=VALUE); "
                         f"valid options: {valid}")
    typed = {key: coerce_option(name, key, value, type(known[key].default)) for key, value in options.items()}
    return entry.options(**typed)


def algorithm_builder(name: str) -> Callable[..., Algorithm]:
    """The registered ``builder(task, **options)`` (no option checks: a sweep calls it with traced
    option values after checking the concrete ones with :func:`resolve_options`)."""
    return algorithm_entry(name).builder


def make_algorithm(name: str, task: Task, options: Any = None) -> Algorithm:
    resolved = dataclasses.asdict(resolve_options(name, options))
    algorithm = algorithm_entry(name).builder(task, **resolved)
    return dataclasses.replace(algorithm, hparams={**resolved, **algorithm.hparams})
