"""Every exception fedjax_sparse raises on purpose, in one place.

Each message is one line naming the problem and the fix; the CLI prints it after ``error:`` and exits
with status 2 (``RunStopped``: 128 + the signal's number). All but ``RunStopped`` are ``ValueError``s,
so ``except ValueError`` catches any user error.

Messages are written once, naming each setting with :func:`arg`, which words it when the message is
made, as its reader sets it: the flag on the command line (``--overwrite``, ``--client-state host``;
also outside any entry point), the argument in Python (``overwrite=True``,
``RunConfig(execution=Execution(client_state='host'))``) within the API's entry points (``fjs.run``,
``fjs.sweep``, ``fjs.build``, ``fjs.data.load``, ``fjs.models.make_model``: :func:`in_callers_words`)
unless the CLI called them (:func:`cli_caller`). Nothing is rewritten afterwards.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import signal
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["DataError", "DataWarning", "PinningError", "RunError", "RunInterrupted", "RunStopped", "arg", "cli_caller",
           "declare_execution_fields",
           "in_callers_words", "in_cli", "in_python", "resume_command"]


class RunError(ValueError):
    """A user error in a run's configuration or output directory."""


class DataError(ValueError):
    """User-facing data problem; the message names the file/problem and the fix (one line)."""


class PinningError(ValueError):
    """A pinned-draw file that cannot be used; the message names the file and the fix."""


class DataWarning(UserWarning):
    """Data that trains but not as the user may think (a class with no training example); the
    message names it and how to silence it (``warnings.filterwarnings("ignore", category=DataWarning)``)."""


class ModelWarning(UserWarning):
    """A model that trains but whose evaluation may mislead (BatchNorm running statistics that cannot follow
    the rounds); the message names it and the fix."""


class RunStopped(Exception):
    """A run stopped by SIGTERM or SIGINT after checkpointing (``round``: the rounds it completed).
    The CLI prints the message and exits with ``exit_code`` (128 + the signal's number)."""

    def __init__(self, signum: int, round_: int, out: Path | None, *, several: bool = False):
        """``several``: the stop of several runs (``--seeds``, ``--sweep``) in ``out``, each checkpointed;
        the same command (call) with resume continues every one of them."""
        self.signal, self.round = signum, round_
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if out is None:
            what = f"nothing was saved (no {arg('out')})"
        elif round_ == 0:
            what = "no round had finished, nothing to resume: run the same command again"
        elif several:
            what = (f"every run in {out} checkpointed; continue with the same "
                    + ("call and resume=True" if in_python() else "command and --resume"))
        else:
            what = f"continue with: {resume_command(out)}"
        super().__init__(f"{name}: stopped at round {round_}; {what}")


class RunInterrupted(KeyboardInterrupt):
    """A run interrupted at once (a second Ctrl-C), without a stop's checkpoint: still a
    ``KeyboardInterrupt``, whose message says what can be resumed (``checkpoint``: the round of the
    newest checkpoint in ``out``, None: none). The CLI prints it and exits with 130."""

    def __init__(self, round_: int | None, out: Path | None, checkpoint: int | None):
        self.round, self.checkpoint = round_, checkpoint
        self.exit_code = 128 + signal.SIGINT
        at = "" if round_ is None else f" at round {round_}"
        if out is None:
            what = f"nothing was saved (no {arg('out')})"
        elif checkpoint is None:
            what = "no checkpoint was written, nothing to resume: run the same command again"
        else:
            what = f"the newest checkpoint is of round {checkpoint}; continue with: {resume_command(out)}"
        super().__init__(f"interrupted{at} at once, without a checkpoint of its own; {what}")


# ------------------------------------------------------------------ the caller's words
# None: outside any entry point (a module's function called directly: the flags' words); "python": within
# an entry point that Python called; "cli": under the command line.
_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("fedjax_sparse_caller", default=None)
# The running entry point's own keywords ({name: (spelling with VALUE, without a value)}), e.g. data.load's.
_OWN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fedjax_sparse_arguments", default=None)
_NO_VALUE = object()
# Execution's fields (declare_execution_fields): RunConfig(execution=Execution(NAME=VALUE)) in Python.
_EXECUTION: set[str] = set()
# What Python passes for the flags that are no RunConfig field, and for the KEY=VALUE ones: (spelling with
# VALUE, spelling without a value); a field's is RunConfig(NAME=VALUE), an execution field's
# RunConfig(execution=Execution(NAME=VALUE)).
_ARGUMENTS = {
    "resume": ("resume=True",) * 2, "overwrite": ("overwrite=True",) * 2, "quiet": ("progress=False",) * 2,
    "download": ("RunConfig(download=True)",) * 2, "seeds": ("seeds=[VALUE]", "seeds"),
    "sweep_select": ("select=VALUE", "select"), "replica_parallelism": ("parallelism=VALUE", "parallelism"),
    "setting": ("RunConfig.from_setting(VALUE)", "RunConfig.from_setting"), "sweep": ("axes={VALUE}", "axes"),
    "change": ("change={VALUE}", "change"), "compare": ("compare={VALUE}", "compare"),
    "option": ("RunConfig(options={VALUE})", "RunConfig(options=...)"),
    "model_option": ("RunConfig(model_options={VALUE})", "RunConfig(model_options=...)"),
    "dataset_option": ("RunConfig(dataset_options={VALUE})", "RunConfig(dataset_options=...)")}


@contextlib.contextmanager
def cli_caller() -> Iterator[None]:
    """Within it messages name flags, entry points included (the command line sets it around a command)."""
    token = _CALLER.set("cli")
    try:
        yield
    finally:
        _CALLER.reset(token)


def declare_execution_fields(names) -> None:
    """Names ``Execution``'s fields, which Python sets as ``RunConfig(execution=Execution(NAME=...))``
    (:mod:`fedjax_sparse.driver.settings` declares them when it is imported: this module imports no layer)."""
    _EXECUTION.update(names)


def _literal(value: Any) -> str:
    """A value as Python writes it; text in capitals is a placeholder (``VALUE``, ``C``) and stays bare, other
    text is read as a command line's value is (numbers, true/false, none)."""
    if not isinstance(value, str):
        return repr(value)
    if value.replace("_", "").isupper():
        return value
    from fedjax_sparse.schema import from_text
    return repr(from_text(value))


def arg(name: str, value: Any = _NO_VALUE, *, quote: bool = False) -> str:
    """Setting ``name`` (a RunConfig or Execution field, or one of ``_ARGUMENTS``) as its reader sets it:
    ``--client-state host`` on the command line, ``RunConfig(execution=Execution(client_state='host'))`` in
    Python; ``value``, if given, shown with it (``quote``: as its repr on the command line too; a value in
    capitals is a placeholder: ``--dp-clip C``, ``RunConfig(dp_clip=C)``). The KEY=VALUE ones take
    ``"KEY=VALUE"`` (``sweep``: ``"KEY=V1,V2"``), ``seeds`` a list."""
    if not in_python():
        flag = "--" + name.replace("_", "-")
        if value is _NO_VALUE:
            return flag
        return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else repr(value) if quote else value}"
    own = _OWN.get() or {}
    if name not in _ARGUMENTS and name not in own:
        text = f"{name}={'...' if value is _NO_VALUE else _literal(value)}"
        return f"RunConfig(execution=Execution({text}))" if name in _EXECUTION else f"RunConfig({text})"
    spelled, bare = {**_ARGUMENTS, **own}[name]
    if value is _NO_VALUE:
        return bare
    if isinstance(value, list):
        text = ", ".join(map(_literal, value))
    elif name in ("sweep", "change") or name.endswith("option"):   # KEY=VALUE: a dict's entry (a keyword)
        key, _, values = str(value).partition("=")
        shown = [_literal(v) for v in values.split(",")] if name == "sweep" else [_literal(values)]
        if spelled == "KEYWORD":
            return f"{key}={shown[0]}"
        text = f"{_literal(key)}: {'[' + ', '.join(shown) + ']' if name == 'sweep' else shown[0]}"
    else:
        text = _literal(value)
    return spelled.replace("VALUE", text)


def resume_command(out) -> str:
    """How to continue the run in ``out``, as its reader does: the command, or ``fjs.run``."""
    if in_python():
        return f"fjs.run(config, resume=True) with config.out={str(out)!r}"
    return f"python -m fedjax_sparse run --out {out} --resume"


def in_python() -> bool:
    """Whether the message being made is read in Python (within an entry point that Python called)."""
    return _CALLER.get() == "python"


def in_cli(text: str) -> str:
    """``text`` for a reader of the command line (flags and commands), nothing for Python's."""
    return "" if in_python() else text


F = TypeVar("F", bound=Callable)


def in_callers_words(function: F | None = None, *, arguments: dict[str, tuple[str, str]] | None = None):
    """Marks an API entry point: the messages made inside it name Python arguments (:func:`arg`), unless
    the command line or another entry point called it. ``arguments``: its own keywords' spellings, used
    first (``{"download": ("download=True", "download=True")}``)."""
    def wrap(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if _CALLER.get() is not None:   # the command line's, or an outer entry point's words
                return function(*args, **kwargs)
            tokens = _CALLER.set("python"), _OWN.set(arguments or {})
            try:
                return function(*args, **kwargs)
            finally:
                _OWN.reset(tokens[1])
                _CALLER.reset(tokens[0])
        return wrapper  # type: ignore[return-value]
    return wrap if function is None else wrap(function)
