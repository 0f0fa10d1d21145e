"""A run's files on disk: the output directory, its lock (``OUT/.lock``), ``metrics.jsonl`` and
orbax checkpoints (``OUT/checkpoints/<round>/``, the previous generation kept as a fallback; arrays
restored by key). Each checkpoint also keeps the metrics rows up to its round, so a resume restores
a damaged ``metrics.jsonl``. The first format (``OUT/checkpoint.npz``) is refused in one line.
docs/outputs.md says what a run guarantees.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.errors import RunError, arg
from fedjax_sparse.core.engine import EngineState

LEGACY_CHECKPOINT = "checkpoint.npz"
CHECKPOINT_DIR = "checkpoints"
LOCK = ".lock"
# Generations kept: the newest plus the one before (the fallback when the newest is damaged).
KEEP_CHECKPOINTS = 2
OUTPUT_FILES = ("config.json", "metrics.jsonl", "summary.json", LEGACY_CHECKPOINT)


# ---------------------------------------------------------------- lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class OutputLock:
    """Exclusive use of an output folder by one run (a context manager; released on exit)."""

    def __init__(self, out: Path, remove_if_empty: bool = False):
        self.path = Path(out) / LOCK
        self.held = False
        # The run created the folder: a run refused before writing anything leaves no empty folder behind.
        self.remove_if_empty = remove_if_empty

    def acquire(self) -> "OutputLock":
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):
                    raise RunError(
                        f"{arg('out', self.path.parent)} is in use by another run (pid {holder.get('pid')} on "
                        f"{holder.get('host')}, started {holder.get('started')}); wait for it, stop it, or "
                        f"choose another {arg('out')}") from None
                what = "unreadable" if holder is None else f"left by pid {holder.get('pid')}, which is gone"
                print(f"notice: taking over the stale lock of {self.path.parent} ({what})", file=sys.stderr)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
            self.held = True
            return self
        raise RunError(f"could not lock {arg('out', self.path.parent)}: another run keeps taking it; choose another "
                       f"{arg('out')}")

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else None
        except (OSError, ValueError):
            return None

    @staticmethod
    def _stale(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return False  # another machine's process cannot be checked: assume it is alive
        pid = holder.get("pid")
        return not isinstance(pid, int) or (pid != os.getpid() and not _pid_alive(pid))

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
            if self.remove_if_empty:
                try:
                    self.path.parent.rmdir()  # only when empty
                except OSError:
                    pass

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def locked_out_dir(out: Path) -> OutputLock:
    """Checks that ``out`` can be a run's folder, creates it and returns its lock, taken on entering
    (``with locked_out_dir(out): ...``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunError(f"{arg('out', out)} exists and is not a directory; choose another {arg('out')}")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create {arg('out', out)} ({e.strerror}); choose a writable {arg('out')}") from None
    return OutputLock(out, remove_if_empty=created)


# ---------------------------------------------------------------- metrics
def _parse_metrics(path: Path) -> tuple[list[dict], str | None, int | None]:
    """The rows of a metrics file as far as they can be read: (rows, problem, damaged line).
    ``problem``: None, "is missing", "is empty", "had a torn last line" or "has a damaged line N"
    (then ``rows`` stops before that line, whose 1-based number is the third value)."""
    if not path.exists():
        return [], "is missing", None
    # Bytes that are not UTF-8 (a disk's garbage) make their line unreadable, not the file.
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if not lines:
        return [], "is empty", None
    rows: list[dict] = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "round" not in row:
                raise ValueError("not a metrics row")
        except ValueError:
            if i == len(lines) - 1:
                return rows, "had a torn last line", None
            return rows, f"has a damaged line {i + 1}", i + 1
        rows.append(row)
    return rows, None, None


def read_metrics(out: str | Path, repair: bool = False) -> list[dict]:
    """The rows of ``OUT/metrics.jsonl`` (one per evaluated round); [] when there is none yet.

    A torn last line (the run was killed while writing it) is skipped, and with ``repair``
    removed from the file; a damaged line before the last is an error naming the line."""
    path = Path(out) / "metrics.jsonl"
    rows, problem, damaged = _parse_metrics(path)
    if damaged is not None:
        raise RunError(f"{path} line {damaged} is damaged (not a JSON metrics row); restore the file or "
                       f"start a fresh run in a new {arg('out')}")
    if problem == "had a torn last line" and repair:
        print(f"notice: dropped the torn last line of {path}", file=sys.stderr)
        write_metrics(out, rows)
    return rows


def _spans(rows: list[dict], picked: list[int]) -> str:
    """The rounds of ``rows[i]`` for ``i`` in ``picked`` (ascending), runs of consecutive rows as spans:
    "4-6 (3 rows)", "10, 30-50 (4 rows)"."""
    spans: list[list[int]] = []
    for i in picked:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    text = ", ".join(str(rows[a]["round"]) if a == b else f"{rows[a]['round']}-{rows[b]['round']}" for a, b in spans)
    return f"{text} ({len(picked)} row{'s' if len(picked) != 1 else ''})"


def encode_rows(rows: list[dict]) -> dict:
    """The checkpoint's copy of the metrics rows: the file's very lines, compressed (a JSON item)."""
    text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows).encode()
    return {"format": "jsonl+zlib+base64", "rows": len(rows),
            "last_round": int(rows[-1]["round"]) if rows else None,
            "data": base64.b64encode(zlib.compress(text, 6)).decode("ascii")}


def decode_rows(item: dict) -> list[dict]:
    """The rows :func:`encode_rows` stored (ValueError when they are not what it wrote)."""
    if not isinstance(item, dict) or item.get("format") != "jsonl+zlib+base64":
        raise ValueError("not a metrics item of this version")
    try:
        text = zlib.decompress(base64.b64decode(item["data"])).decode()
    except (KeyError, zlib.error, ValueError) as e:
        raise ValueError(f"damaged metrics item ({type(e).__name__})") from None
    rows = [json.loads(line) for line in text.splitlines()]
    if len(rows) != item.get("rows"):
        raise ValueError(f"damaged metrics item ({len(rows)} rows, {item.get('rows')} recorded)")
    return rows


def recover_metrics(out: str | Path, round_: int, saved: list[dict] | None, repair: bool = True,
                    last_evaluation: int | None = None) -> list[dict]:
    """The metrics rows a resume from the checkpoint of round ``round_`` continues: ``saved``, the rows the
    checkpoint holds, with one notice naming whatever the file lacked or had damaged (docs/outputs.md);
    None (a checkpoint of an earlier version): the file's rows up to ``round_``, with a notice naming the
    rounds lost before ``last_evaluation`` (if known). ``repair``: print the notices (the writing process)."""
    path = Path(out) / "metrics.jsonl"
    if saved is None:
        rows = [r for r in read_metrics(out, repair=repair) if r["round"] <= round_]
        last = int(rows[-1]["round"]) if rows else 0
        if repair and last_evaluation is not None and last < last_evaluation:
            print(f"notice: {path} has no rows after round {last}, and the checkpoint (round {round_}, written "
                  f"by a version that did not keep them) cannot restore them: the rows of rounds {last + 1}-"
                  f"{last_evaluation} stay missing", file=sys.stderr)
        return rows
    found, problem, _ = _parse_metrics(path)
    kept = [r for r in found if r["round"] <= round_]
    if not repair or (kept == saved and problem in (None, "is missing", "is empty")):
        return saved
    if kept == saved:   # the damage lies past the checkpoint: dropped with the rows the resume recomputes
        print(f"notice: dropped the torn last line of {path}" if problem == "had a torn last line" else
              f"notice: {path} {problem}, past the checkpoint of round {round_}: dropped it and the rows after "
              "it (the resume recomputes them)", file=sys.stderr)
        return saved
    have = {int(r["round"]): r for r in kept}
    lost = [i for i, r in enumerate(saved) if have.get(int(r["round"])) != r]
    if problem is None:   # every line reads: the file was cut at a row's end, or its rows differ
        ends = int(found[-1]["round"]) if found else 0
        problem = (f"ended at round {ends}" if saved and ends < int(saved[-1]["round"]) else
                   "differed from the checkpoint's rows")
    what = f"the rows of rounds {_spans(saved, lost)}" if lost else f"its rows up to round {round_}"
    print(f"notice: {path} {problem}; restored {what} from the checkpoint of round {round_}", file=sys.stderr)
    return saved


def write_metrics(out: str | Path, rows: list[dict]) -> None:
    """Replaces ``OUT/metrics.jsonl`` by ``rows`` atomically."""
    path = Path(out) / "metrics.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk must not leave the half-written copy behind


# ---------------------------------------------------------------- checkpoints
def has_checkpoint(out: str | Path) -> bool:
    """Whether ``out`` holds a checkpoint to resume from (a first-format ``checkpoint.npz`` counts, so
    that ``--resume`` reaches the line refusing it)."""
    return (Path(out) / LEGACY_CHECKPOINT).exists() or latest_checkpoint(out) is not None


def latest_checkpoint(out: str | Path) -> int | None:
    """The round of the newest complete checkpoint generation in ``out`` (None: none). orbax writes a
    generation under a temporary name and renames it to its round once complete."""
    directory = Path(out) / CHECKPOINT_DIR
    if not directory.is_dir():
        return None
    return max((int(p.name) for p in directory.iterdir() if p.name.isdigit()), default=None)


def _manager(out: Path, asynchronous: bool = False):
    import orbax.checkpoint as ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=KEEP_CHECKPOINTS, create=True,
                                           enable_async_checkpointing=asynchronous)
    return ocp.CheckpointManager((out / CHECKPOINT_DIR).absolute(), options=options)


class Checkpointer:
    """One run's checkpoints. Each save takes a host copy of the state (the device buffers go on to
    the next chunk) and, with ``asynchronous``, orbax writes it while the next chunk runs; the next
    save and :meth:`close` wait for the write. Synchronous with several processes and
    with a host population (whose rows the next chunk updates in place)."""

    def __init__(self, out: Path, asynchronous: bool = True):
        self.out = Path(out)
        self.asynchronous = asynchronous and jax.process_count() == 1
        self._manager: Any = None   # an orbax CheckpointManager, opened by the first save

    def save(self, state: EngineState, totals: dict, population=None, rows: list[dict] | None = None) -> None:
        """A new generation for round ``totals["round"]`` (atomic; the previous one is kept). ``rows``: the
        metrics rows up to that round, kept with it (what a resume restores a damaged metrics.jsonl from)."""
        import orbax.checkpoint as ocp
        asynchronous = self.asynchronous and population is None
        if self._manager is None:
            self._manager = _manager(self.out, asynchronous=self.asynchronous)
        manager = self._manager
        manager.wait_until_finished()
        step = int(totals["round"])
        if step in manager.all_steps():  # the same round again (a resumed run re-saving): replace it
            manager.delete(step)
        # Several processes: orbax writes the global arrays, each process its own shards.
        saved = state if jax.process_count() > 1 else jax.device_get(state)
        items = dict(state=ocp.args.StandardSave(saved), totals=ocp.args.JsonSave(dict(totals)))
        if population is not None:
            items["population"] = ocp.args.StandardSave(population.state_dict())
        if rows is not None:
            # Encoded now: the caller goes on appending rows while the write runs.
            # Not "metrics": orbax's manager reads an item of that name as its own (best-checkpoint metrics).
            items["rows"] = ocp.args.JsonSave(encode_rows(rows))
        manager.save(step, args=ocp.args.Composite(**items))
        if not asynchronous:
            manager.wait_until_finished()
        # A legacy checkpoint is superseded by the new format (it would otherwise be resumed from).
        (self.out / LEGACY_CHECKPOINT).unlink(missing_ok=True)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None


def save_checkpoint(out: Path, state: EngineState, totals: dict, population=None,
                    rows: list[dict] | None = None) -> None:
    """A new checkpoint generation for round ``totals["round"]`` (atomic; the previous one is kept),
    written before it returns. ``population``: a host population
    (:class:`fedjax_sparse.driver.population.HostPopulation`), saved in the same generation (its slot table
    and the rows of the clients trained so far); ``rows``: the metrics rows up to that round."""
    checkpointer = Checkpointer(out, asynchronous=False)
    try:
        checkpointer.save(state, totals, population, rows=rows)
    finally:
        checkpointer.close()


class Restored(NamedTuple):
    """What :func:`restore_checkpoint` reads: the state, the totals (``totals["round"]``: its round) and
    the metrics rows up to that round (None: a checkpoint of a version that did not keep them)."""
    state: EngineState
    totals: dict
    rows: list[dict] | None


def load_checkpoint(out: Path, template: EngineState, population=None) -> tuple[EngineState, dict]:
    """The state and totals of the newest readable checkpoint of ``out`` (see :func:`restore_checkpoint`)."""
    return restore_checkpoint(out, template, population)[:2]


def restore_checkpoint(out: Path, template: EngineState, population=None) -> Restored:
    """The newest readable checkpoint of ``out`` (falling back to the previous generation, with
    a notice, when the newest is damaged), matched to ``template`` by key (field names), so a state's
    fields may be reordered between versions. ``population``: the
    host population to load the saved one into (checkpoints of --client-state host runs)."""
    import orbax.checkpoint as ocp
    out = Path(out)
    if not (out / CHECKPOINT_DIR).is_dir():
        if population is not None:
            raise RunError(f"{out} holds no checkpoint of a {arg('client_state', 'host')} run; resume it with "
                           f"{arg('client_state', 'device')}, or start a fresh run in a new {arg('out')}")
        legacy = out / LEGACY_CHECKPOINT
        if legacy.exists():
            # That format stored the leaves by position: it cannot follow a state whose fields moved.
            raise RunError(f"{legacy} is a checkpoint of fedjax_sparse before its orbax checkpoints (leaves by "
                           "position), no longer read; finish that run with the version that started it, or "
                           f"start a fresh run in a new {arg('out')}")
        raise RunError(f"no checkpoint in {out}; start a fresh run (without {arg('resume')})")
    manager = _manager(out)
    steps = sorted(manager.all_steps(), reverse=True)
    problems = []
    if jax.process_count() > 1:  # restored straight into the template's shards
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                          template)
    else:
        abstract = jax.tree_util.tree_map(np.asarray, jax.device_get(template))
    try:
        for step in steps:
            items = dict(state=ocp.args.StandardRestore(abstract), totals=ocp.args.JsonRestore())
            if population is not None:
                items["population"] = ocp.args.StandardRestore()
            # Checkpoints of earlier versions have no metrics item (orbax refuses an item it cannot find).
            with_rows = (out / CHECKPOINT_DIR / str(step) / "rows").is_dir()
            if with_rows:
                items["rows"] = ocp.args.JsonRestore()
            try:
                restored = manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as e:  # orbax raises many types for damaged or foreign files
                problems.append(f"round {step}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
                continue
            _check_structure(out, restored.state, template)
            if population is not None:
                try:
                    population.load_state_dict(restored.population)
                except (ValueError, KeyError, TypeError) as e:
                    raise RunError(f"the checkpoint in {out}: {e}; use a new {arg('out')} directory") from None
            rows = None
            if with_rows:
                try:
                    rows = decode_rows(restored.rows)
                except ValueError as e:
                    problems.append(f"round {step}: {e}")
                    continue
            if problems:
                print(f"notice: checkpoint(s) {', '.join(problems)} unreadable; resuming from round {step}",
                      file=sys.stderr)
            # orbax matched the saved arrays to the template by their keys (NamedTuple and dataclass
            # field names, dict keys), so a state's fields may be reordered between versions.
            return Restored(jax.tree_util.tree_map(jnp.asarray, restored.state), dict(restored.totals), rows)
    finally:
        manager.close()
    raise RunError(f"no readable checkpoint in {out / CHECKPOINT_DIR} ({'; '.join(problems) or 'none found'}); "
                   f"start a fresh run in a new {arg('out')}")


def _check_structure(out: Path, restored: Any, template: EngineState) -> None:
    new_leaves = jax.tree_util.tree_leaves(restored)
    old_leaves = jax.tree_util.tree_leaves(template)
    if len(new_leaves) != len(old_leaves) or any(np.shape(a) != np.shape(b) for a, b in zip(new_leaves, old_leaves)):
        raise RunError(f"the checkpoint in {out} is from another configuration; use a new {arg('out')} directory")


# ---------------------------------------------------------------- the folder
# What a run that stopped before its first checkpoint (diverged at its first evaluation, failed,
# killed) leaves: its config.json, the metrics and logs of that evaluation, an unfinished checkpoint
# folder. Nothing there can be resumed, so a fresh run may take the folder over.
FAILED_START_FILES = ("config.json", "metrics.jsonl", "metrics.jsonl.tmp", "metrics.csv", "metrics.csv.tmp", LOCK)
FAILED_START_DIRS = (CHECKPOINT_DIR, "tensorboard")


def failed_start(out: Path) -> bool:
    """Whether ``out`` holds only what a run that stopped before its first checkpoint leaves: a run's
    config.json, no checkpoint, no summary.json, and nothing but the files in ``FAILED_START_FILES``
    and ``FAILED_START_DIRS``."""
    out = Path(out)
    if not (out / "config.json").is_file() or has_checkpoint(out):
        return False
    for path in out.iterdir():
        if not ((path.name in FAILED_START_FILES and path.is_file())
                or (path.name in FAILED_START_DIRS and path.is_dir())):
            return False
    try:
        recorded = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and isinstance(recorded.get("config"), dict)  # written by a run


def prepare_out_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Checks ``out`` for the requested mode and creates it. Removes nothing of a run that finished or
    can be resumed (see ``clear_outputs``); a run that stopped before its first checkpoint (see
    ``failed_start``) is replaced by a fresh run, with a notice."""
    if out.exists() and not out.is_dir():
        raise RunError(f"{arg('out', out)} exists and is not a directory; choose another {arg('out')}")
    # A finished run whose checkpoints were deleted (the recorded results keep none, to save space): the
    # same one way forward whether the folder is run into again with --resume or without.
    finished = None
    if (out / "summary.json").is_file() and not has_checkpoint(out):
        finished = ("it holds a finished run whose checkpoints were deleted, which can be neither resumed nor "
                    f"extended; start the new run in another {arg('out')}")
    if resume:
        if finished:
            raise RunError(f"nothing to resume in {out}: {finished}")
        if not has_checkpoint(out):
            raise RunError(f"nothing to resume in {out}: no checkpoint there; run without {arg('resume')}")
        return
    if out.exists() and any(p.name != LOCK for p in out.iterdir()) and not overwrite:
        if failed_start(out):
            print(f"notice: {out} held only a failed start (config.json and metrics of a run stopped before its "
                  "first checkpoint: nothing to resume); this run replaces it", file=sys.stderr)
            clear_outputs(out, FAILED_START_FILES, FAILED_START_DIRS)
        elif finished:
            raise RunError(f"output directory {out} is not empty: {finished}")
        else:
            what, fix = _holds(out)
            raise RunError(f"output directory {out} is not empty (it holds {what}); {fix}")
    out.mkdir(parents=True, exist_ok=True)


def _holds(out: Path) -> tuple[str, str]:
    """What a refused --out holds, and the flags that take the folder over (for the message)."""
    if (out / "summary.json").is_file():
        return ("a finished run", f"pass {arg('resume')} with a larger {arg('rounds')} to extend it, "
                f"{arg('overwrite')} to replace it, or choose another {arg('out')}")
    if has_checkpoint(out):
        try:
            rows = read_metrics(out)
        except RunError:
            rows = []
        if rows and rows[-1].get("loss") is None and rows[-1].get("clients") != 0:
            # Diverged (its NaN loss is written as null; an empty Poisson round's null is no loss at all):
            # a resume would repeat the same rounds.
            return (f"a run that diverged at round {rows[-1]['round']}",
                    f"pass {arg('overwrite')} to replace it with this run, or choose another {arg('out')}")
        return ("a run stopped after a checkpoint",
                f"pass {arg('resume')} to continue it, {arg('overwrite')} to replace it, or choose another "
                f"{arg('out')}")
    others = sorted(p.name for p in out.iterdir() if p.name not in FAILED_START_FILES + FAILED_START_DIRS)
    return (f"files no run writes: {', '.join(others[:5])}" if others else "the files of a previous run",
            f"choose another {arg('out')}, or pass {arg('overwrite')} to start a run there (it removes only a run's "
            "files)")


def clear_outputs(out: Path, files: tuple[str, ...] = OUTPUT_FILES, dirs: tuple[str, ...] = (CHECKPOINT_DIR,)) -> None:
    """``--overwrite``: removes the previous run's outputs (called once the new run has built); a failed
    start's (``FAILED_START_FILES``, ``FAILED_START_DIRS``) when a fresh run replaces it. Never the lock."""
    import shutil
    for name in files:
        if name != LOCK:
            (out / name).unlink(missing_ok=True)
    for name in dirs:
        shutil.rmtree(out / name, ignore_errors=True)
