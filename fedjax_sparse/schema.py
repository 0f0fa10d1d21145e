"""Declared types, and the one reading of a flag's text as one.

A run's fields (``RunConfig``, ``Execution``), a model's and a data set's options declare their types; a
value given as text (``--lr 0.1``, ``--option alpha=0.01``, ``--sweep lr=0.01,0.1``, ``--compare``,
``--change``, a config file's ``"false"``) is read here as that type, and a JSON value is checked
against it (algorithm options too: ``config.algorithm_option_values``). A leaf module (stdlib only): the
configuration, the data sets, the models and the errors read it."""
from __future__ import annotations

import types
import typing
from typing import Any, NamedTuple

TRUE, FALSE, NONE = ("true", "yes", "on", "1"), ("false", "no", "off", "0"), ("none", "null")


class Option(NamedTuple):
    """One option of a data set or a model: its type, default and what it does."""
    kind: type | None   # None: no declared type (read as JSON spells it)
    default: Any
    help: str = ""


def kinds(hint) -> tuple:
    """The types an annotation allows: ``float | None`` -> ``(float, NoneType)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def fits(value, hint) -> bool:
    """Whether a JSON value fits a declared type (an integer fits a number; a boolean is no number)."""
    for kind in kinds(hint):
        if kind is type(None):
            ok = value is None
        elif kind in (int, float):
            ok = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, typing.get_origin(kind) or kind)
        if ok:
            return True
    return False


def describe(hint) -> str:
    """``float | None`` -> ``a number or null``."""
    names = {type(None): "null", bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string",
             dict: "an object"}
    return " or ".join(names.get(typing.get_origin(k) or k, str(k)) for k in kinds(hint))


def from_text(text: str, hint=None) -> Any:
    """``text`` (a flag's value) as a value of the declared type ``hint``; ValueError("expected ...") when it
    is not one. ``true/yes/on/1`` and ``false/no/off/0`` are booleans, ``none``/``null`` is None where
    None is allowed, a whole number stays an integer where a number is expected, as a config file holds
    it (``1`` and ``1.0`` name different sweep folders). ``hint`` None (an option without a schema, e.g.
    of your own Flax module's factory): read as JSON spells it (true/false, none/null, numbers, else text)."""
    text = text.strip()
    word = text.lower()
    allowed = kinds(hint) if hint is not None else (type(None), int, float, str)
    if type(None) in allowed and word in NONE:
        return None
    if hint is None and word in ("true", "false"):
        return word == "true"
    for kind in allowed:
        if kind is bool and word in TRUE + FALSE:
            return word in TRUE
        if kind in (int, float):
            for number in (int, float) if kind is float else (int,):
                try:
                    return number(text)
                except ValueError:
                    pass
        if kind is str:
            return text
    raise ValueError(f"expected {describe(hint)}")


def resolve(schema: dict[str, Option], options: dict, flag: str, owner: str) -> dict:
    """``options`` (texts or JSON values) typed by ``schema``; a one-line ValueError naming ``flag KEY=VALUE``
    of ``owner`` for a value of another type (unknown keys are the caller's to refuse, in its own words;
    a ``kind`` of None declares no type)."""
    typed = {}
    for key, value in options.items():
        kind = schema[key].kind
        try:
            typed[key] = from_text(value, kind) if isinstance(value, str) else value
        except ValueError as e:
            raise ValueError(f"{flag} {key}={value!r} of {owner}: {e}") from None
        if kind is not None and not fits(typed[key], kind):
            raise ValueError(f"{flag} {key}={value!r} of {owner}: expected {describe(kind)}")
    return typed


def listing(schema: dict[str, Option]) -> str:
    """``test_fraction=0.2, split_seed=0`` (``none`` for no option)."""
    return ", ".join(f"{key}={option.default!r}" for key, option in schema.items()) or "none"
