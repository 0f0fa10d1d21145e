"""Every exception fedjax_sparse raises on purpose, in one place.

Each message is one line naming the problem and the fix; the CLI prints it after ``error:`` and exits
with status 2 (``RunStopped``: 128 + the signal's number). All but ``RunStopped`` are ``ValueError``s,
so ``except ValueError`` catches any user error.

Messages are written once, in the CLI's words (``--overwrite``, ``--model-option KEY=VALUE``). One
place translates them for Python callers: the API's entry points (``fjs.run``, ``fjs.sweep``,
``fjs.build``, ``fjs.data.load``, ``fjs.models.make_model``) are wrapped by :func:`in_callers_words`,
which rewrites a message's flags into the arguments that set them (``overwrite=True``,
``RunConfig(model_options={'KEY': VALUE})``) unless the CLI is the caller (:func:`cli_caller`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import signal
from pathlib import Path
from typing import Callable, Iterator, TypeVar

__all__ = ["DataError", "DataWarning", "PinningError", "RunError", "RunInterrupted", "RunStopped", "callers_words",
           "cli_caller",
           "in_callers_words", "python_words"]


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

    def __init__(self, signum: int, round_: int, out: Path | None):
        self.signal, self.round = signum, round_
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if out is None:
            what = "nothing was saved (no --out)"
        elif round_ == 0:
            what = "no round had finished, nothing to resume: run the same command again"
        else:
            what = f"continue with: python -m fedjax_sparse run --out {out} --resume"
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
            what = "nothing was saved (no --out)"
        elif checkpoint is None:
            what = "no checkpoint was written, nothing to resume: run the same command again"
        else:
            what = f"the newest checkpoint is of round {checkpoint}; continue with: python -m fedjax_sparse run " \
                   f"--out {out} --resume"
        super().__init__(f"interrupted{at} at once, without a checkpoint of its own; {what}")


# ------------------------------------------------------------------ the caller's words
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("fedjax_sparse_caller", default="python")


@contextlib.contextmanager
def cli_caller() -> Iterator[None]:
    """Within it errors keep the CLI's words (the command line sets it around a command)."""
    token = _CALLER.set("cli")
    try:
        yield
    finally:
        _CALLER.reset(token)


# Flags that are not RunConfig fields: their Python spelling (VALUE: the flag's value, if it has one).
_ARGUMENTS = {
    "--resume": "resume=True", "--overwrite": "overwrite=True", "--quiet": "progress=False",
    "--download": "RunConfig(download=True)", "--seeds": "seeds=[VALUE]", "--sweep-select": "select=VALUE",
    "--replica-parallelism": "parallelism=VALUE", "--setting": "RunConfig.from_setting(VALUE)",
}
# Words that follow a flag without being its value ("--lr must be ...").
_NOT_VALUES = frozenset(
    "a an and are as at by cannot continues differ directory does exists expects fixes for from gives has have "
    "in instead is it keeps lists lower must names need needs of on or per pins pointing reads sets splits "
    "stacks such takes that the times to was which with accounts ones".split())
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")
_VALUE = re.compile(r" ('[^']*'|\"[^\"]*\"|\{[^}]*\}|\[[^\]]*\]|[^\s;,)(]*[^\s;,)(.:])")
_KEY_VALUE_FLAGS = ("--option", "--model-option", "--dataset-option", "--sweep", "--change")
_KEY_VALUES = re.compile(r" ([A-Za-z_.][A-Za-z0-9_.]*=[^\s;)(]*[^\s;)(.:,])")   # --option k=v1,v2


def _python_value(text: str) -> str:
    """A flag's value as Python writes it: numbers, quoted strings and placeholders as they are, a
    bare word quoted."""
    if text[:1] in "'\"{[" or re.fullmatch(r"-?[0-9][0-9.e+-]*|[A-Z][A-Z0-9_]*|true|false|none|null", text):
        return {"true": "True", "false": "False", "none": "None", "null": "None"}.get(text, text)
    return repr(text)


def _key_value(text: str) -> str:
    """``KEY=VALUE`` as a dict entry (``KEY`` placeholders stay bare)."""
    key, _, value = text.partition("=")
    key = key if re.fullmatch(r"[A-Z][A-Z0-9_]*", key) or key[:1] in "'\"" else repr(key)
    return f"{key}: {_python_value(value) if value else 'VALUE'}"


def python_words(message: str, arguments: dict[str, str] | None = None) -> str:
    """``message`` (written in the CLI's words) with every flag of a run replaced by the Python
    argument that sets it: ``--overwrite`` -> ``overwrite=True``, ``--lr 0.01`` ->
    ``RunConfig(lr=0.01)``, ``--client-state host`` -> ``RunConfig(execution=Execution(client_state='host'))``,
    ``--option k=v`` -> ``RunConfig(options={'k': 'v'})``, ``--sweep lr=0.1,1`` -> ``axes={'lr': [0.1, 1]}``.
    Flags of other commands are left as they are. ``arguments``: spellings of the entry point's own
    keywords (``{"--download": "download=True", "--data-dir": "data_dir=VALUE"}``), used first."""
    from fedjax_sparse.settings import EXECUTION_FIELDS, RUN_FLAGS
    own = {**_ARGUMENTS, **(arguments or {})}
    fields = {flag: field for flag, field, *_ in RUN_FLAGS if flag not in own}
    message = re.sub(r"python -m fedjax_sparse run --out (\S+) --resume",
                     lambda m: f"fjs.run(config, resume=True) with config.out={m.group(1)!r}", message)
    message = re.sub(r" \(flag --[a-z0-9-]+\)", "", message)

    def value_after(end: int, flag: str) -> tuple[str | None, int]:
        match = (flag in _KEY_VALUE_FLAGS and _KEY_VALUES.match(message, end)) \
            or _VALUE.match(message, end)
        if match is None or match.group(1) in _NOT_VALUES or match.group(1).startswith("--"):
            return None, end
        return match.group(1), match.end()

    out, position = [], 0
    for match in _FLAG.finditer(message):
        if match.start() < position:
            continue
        flag = match.group(0)
        if flag not in fields and flag not in own and flag not in _KEY_VALUE_FLAGS:
            continue
        value, end = value_after(match.end(), flag)
        if flag in ("--option", "--model-option", "--dataset-option", "--change"):
            name = {"--option": "options", "--model-option": "model_options",
                    "--dataset-option": "dataset_options"}.get(flag)
            entry = _key_value(value) if value and "=" in value else None
            if name is None:   # --change: run(..., change={...})
                text = f"change={{{entry}}}" if entry else "change"
            else:
                text = f"RunConfig({name}={{{entry}}})" if entry else f"RunConfig({name}=...)"
            end = end if entry else match.end()
        elif flag == "--sweep":
            if value and "=" in value:
                key, _, values = value.partition("=")
                text = f"axes={{{_key_value(key)[:-7]}: [{', '.join(_python_value(v) for v in values.split(','))}]}}"
            elif value:
                text = f"axes[{_python_value(value)}]"
            else:
                text = "axes"
        elif flag in own:
            spelled = own[flag]
            if "VALUE" in spelled:
                if flag == "--seeds" and value is not None:   # --seeds 0 1 2
                    more = re.match(r"(?: [0-9]+)*", message[end:])
                    numbers = (value + (more.group(0) if more else "")).split()
                    end += len(more.group(0)) if more else 0
                    text = spelled.replace("VALUE", ", ".join(numbers))
                else:
                    text = spelled.replace("VALUE", _python_value(value)) if value else spelled.split("=")[0]
            else:
                text, end = spelled, match.end()
        else:
            field = fields[flag]
            shown = f"{field}={_python_value(value) if value else '...'}"
            text = f"RunConfig(execution=Execution({shown}))" if field in EXECUTION_FIELDS else f"RunConfig({shown})"
        out.append(message[position:match.start()] + text)
        position = end
    return "".join(out) + message[position:]


def callers_words(message: str) -> str:
    """``message`` (in the CLI's words) as its reader calls things: as it is under the command line,
    in Python arguments elsewhere (:func:`python_words`). For warnings, which no wrapper rewrites."""
    return message if _CALLER.get() == "cli" else python_words(message)


F = TypeVar("F", bound=Callable)


def in_callers_words(function: F | None = None, *, arguments: dict[str, str] | None = None):
    """Wraps an API entry point: a user error raised inside names Python arguments
    (:func:`python_words`; ``arguments``: the entry point's own keywords) unless the CLI called it
    (:func:`cli_caller`). The exception is the same object, re-raised with its message rewritten."""
    def wrap(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except (ValueError, FileExistsError, FileNotFoundError, RunStopped, RunInterrupted) as e:
                if _CALLER.get() != "cli" and len(e.args) == 1 and isinstance(e.args[0], str):
                    e.args = (python_words(e.args[0], arguments),)
                raise
        return wrapper  # type: ignore[return-value]
    return wrap if function is None else wrap(function)
