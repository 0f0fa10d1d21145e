"""The experiment driver: config -> data, model, algorithm, engine -> outputs.

``run(RunConfig(...))`` is what the CLI and the experiment scripts call. It runs rounds in jitted
chunks (``lax.scan``), and between chunks evaluates, appends a row to ``OUT/metrics.jsonl``,
checkpoints (so ``resume=True`` continues an interrupted run exactly) and updates the progress bar.
The files it writes (``config.json``, ``metrics.jsonl``, ``summary.json``; keys are only ever added):
docs/outputs.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.driver import distributed
from fedjax_sparse.core import memory
from fedjax_sparse.driver import population as host_population
from fedjax_sparse.driver.checkpoint import (Checkpointer, clear_outputs, latest_checkpoint, locked_out_dir,
                                             prepare_out_dir, recover_metrics, restore_checkpoint,
                                             write_metrics)
from fedjax_sparse.driver.config import (EXECUTION_FIELDS, OPTION_FIELDS, RunConfig, override_key,
                                         resolved_dp_accountant, same_setting, typed_value, with_default_lr,
                                         with_overrides)
from fedjax_sparse.errors import RunError, RunInterrupted, RunStopped, arg, in_callers_words
from fedjax_sparse.data.federated import FederatedData
from fedjax_sparse.core.engine import COHORT_METRICS, STEP_METRICS, Engine, EngineState
from fedjax_sparse.driver.sinks import MetricSinks

from fedjax_sparse.driver.experiment import (Checked, Experiment, build, check, privacy_accountant, privacy_sampling,
                                             with_components)
from fedjax_sparse.driver.progress import COST_KEYS, Progress, exact_number, format_summary, jsonable, summarize


# packed too where its groups are wider than one client (else it is map).
MEASURED_SCHEDULES = ("map", "vmap", "packed")


def measure_client_parallelism(engine: Engine, state: EngineState, data: FederatedData,
                               repeats: int = 2) -> tuple[str, dict]:
    """``--client-parallelism measure``: runs one round of every client schedule on a copy of
    ``state`` (the run's own state is untouched), after one compiling call each, and picks the
    fastest median. Returns (schedule, {schedule: median seconds per round})."""
    seconds = {}
    for mode in MEASURED_SCHEDULES if engine.pack_width > 1 else MEASURED_SCHEDULES[:2]:
        candidate = dataclasses.replace(engine, client_parallelism=mode)
        times = []
        for i in range(repeats + 1):
            copy = jax.tree_util.tree_map(jnp.copy, state)
            t = time.perf_counter()
            jax.block_until_ready(candidate.round_fn(copy, data))
            if i:  # the first call compiles
                times.append(time.perf_counter() - t)
        seconds[mode] = float(np.median(times))
    return min(seconds, key=seconds.__getitem__), seconds


@dataclasses.dataclass(frozen=True, repr=False)
class RunResult:
    """What ``run`` returns.

    ``summary``: the summary dict (also OUT/summary.json: final and best accuracy, totals, speed);
    ``state``: the final :class:`EngineState` (``state.server``: the algorithm's typed server state,
    ``state.clients``: the clients' states stacked ``[N, ...]``; None for a sweep's member unless the
    sweep keeps states); ``population``: with
    ``--client-state host``, the clients' rows (:class:`fedjax_sparse.driver.population.HostPopulation`;
    ``state.clients`` is then None), else None; ``rows``: the per-evaluation rows, in order, the dicts
    ``metrics.jsonl`` gets (also without ``out``; after a resume, the whole run's: the file's earlier
    rows and the new ones); ``config``: the run's resolved configuration.

    ``fjs.plot_runs({"a": result_a, "b": result_b})`` draws results without output folders; ``repr``
    is a few lines (the numbers, never the state's arrays)."""
    summary: dict
    state: EngineState | None
    population: "host_population.HostPopulation | None" = None
    rows: list[dict] = dataclasses.field(default_factory=list)
    config: RunConfig | None = None

    def __repr__(self) -> str:
        # progress's summary table, not reporting's: reporting reads runs and sweeps (an import cycle).
        return f"RunResult ({len(self.rows)} evaluations in .rows; .summary, .state)\n" + format_summary(self.summary)

    __str__ = __repr__


def differing_settings(config: RunConfig, saved: RunConfig, names: Iterable[str],
                       skip: Collection[str] = ()) -> Iterator[tuple[str, str | None, Any, Any]]:
    """``(field, option key or None, value, recorded value)`` for each setting of the fields ``names`` in
    which ``config`` differs from the recorded ``saved``: an option dict's keys that ``config`` holds (but
    ``skip``'s ``prefix.KEY``s), typed as ``saved``'s (a flag's "true" is a recorded True); any other field's value."""
    for name in names:
        mine, recorded = getattr(config, name), getattr(saved, name)
        if isinstance(mine, dict) and isinstance(recorded, dict):
            yield from ((name, k, v, recorded.get(k)) for k, v in mine.items() if f"{OPTION_FIELDS[name]}.{k}" not in
                        skip and not same_setting(saved, f"{OPTION_FIELDS[name]}.{k}", v, recorded.get(k)))
        elif mine != recorded:
            yield name, None, mine, recorded


# Fields a resumed run may change besides ``execution`` (all of which may): they decide how long it
# runs and where it reads its data (checksummed), not what it computes. Every other field is the experiment.
RESUMABLE_CHANGES = ("rounds", "eval_every", "out", "data_dir", "download")


def resumed_config(config: RunConfig, saved: RunConfig, given: set[str] | None) -> tuple[RunConfig, dict]:
    """The configuration a ``--resume`` continues: the recorded one, with the harmless changes the
    user asked for (``RESUMABLE_CHANGES``). ``given``: the fields the user set (CLI flags and config
    file keys); None compares every field (API use: pass the run's own config). Any other
    difference is refused in one line listing them. Returns (config, accepted changes)."""
    fields = [f.name for f in dataclasses.fields(RunConfig) if f.name != "execution"]
    asked = fields if given is None else [f for f in fields if f in given]
    refused: dict[str, list[str]] = {}
    experiment = [f for f in asked if f not in RESUMABLE_CHANGES]
    for name, key, mine, recorded in differing_settings(config, saved, experiment):
        if name == "dp_accountant" and resolved_dp_accountant(mine, config.client_sampling) == \
                resolved_dp_accountant(recorded, saved.client_sampling):
            continue   # "auto" is what it resolves to (runs before it existed recorded "rdp")
        # --option / --model-option / --dataset-option: only the keys given (a resumed run's flags are text).
        refused.setdefault(name, []).append(
            f"{arg(name, mine, quote=True) if key is None else arg(OPTION_FIELDS[name], f'{key}={mine}')} "
            f"(recorded: {recorded!r})")
    if refused:
        hint = "" if not {"lr", "options"} & set(refused) else (
            f"; the learning rate and algorithm options may change from the checkpoint on with "
            f"{arg('change', 'lr=VALUE')} / {arg('change', 'option.NAME=VALUE')}")
        raise RunError(f"{arg('resume')} continues the recorded run, but these would change the experiment: "
                       f"{'; '.join(sum(refused.values(), []))}{hint}; drop them to resume, or start a new run in "
                       f"another {arg('out')}")
    changes = {f: getattr(config, f) for f in asked
               if f in RESUMABLE_CHANGES and f != "out" and getattr(config, f) != getattr(saved, f)}
    execution_asked = EXECUTION_FIELDS if given is None else [f for f in EXECUTION_FIELDS if f in given]
    execution_changes = {f: getattr(config.execution, f) for f in execution_asked
                         if getattr(config.execution, f) != getattr(saved.execution, f)}
    # The checkpoint's layout follows where the clients' state lives: that cannot change mid-run.
    layout = [f"{arg(f, execution_changes[f], quote=True)} (recorded: {getattr(saved.execution, f)!r})"
              for f in ("client_state", "client_storage") if f in execution_changes]
    if layout:
        raise RunError(f"{arg('resume')} reads the recorded run's checkpoint, laid out for its own clients' state: "
                       f"{'; '.join(layout)}; drop them to resume, or start a new run in another {arg('out')}")
    if given is None and config.rounds < saved.rounds:
        changes.pop("rounds", None)  # the API's default: continue to the recorded length
    if "rounds" in changes and changes["rounds"] < saved.rounds:
        raise RunError(f"{arg('rounds', changes['rounds'])} is below the recorded run's {saved.rounds} rounds; "
                       "a resumed run can only be extended")
    merged = dataclasses.replace(saved, **changes, out=config.out,
                                 execution=dataclasses.replace(saved.execution, **execution_changes))
    return merged, {**changes, **execution_changes}


# What --change may set on a resumed run (from its checkpoint on): the learning rate and the algorithm's options.
CHANGEABLE = ("lr", "option.NAME")


def changed_config(config: RunConfig, change: dict[str, Any]) -> tuple[RunConfig, dict]:
    """``config`` with ``change`` applied (``{"lr": 0.01, "option.alpha": "0.01"}``; values as typed or as
    the CLI's text, typed as ``config`` declares them) and what changed, ``{key: {"from": old, "to": new}}``.
    Any other key is refused in one line (what else a resume may change is :data:`RESUMABLE_CHANGES`); the
    resumed run checks the result (``open_run``)."""
    typed = {}
    for key, value in change.items():
        key = override_key(key)
        if key != "lr" and not (key.startswith("option.") and key.partition(".")[2]):
            raise RunError(f"{arg('change')} {key}: a resumed run may change only {', '.join(CHANGEABLE)} (the rest "
                           f"of the experiment is the recorded one); start a new run in another {arg('out')} to "
                           "change it")
        typed[key] = typed_value(config, key, value, "change")
        if typed[key] is None:
            raise RunError(f"{arg('change')} {key}={value!r}: expected a number")
    merged = with_overrides(config, typed)
    old = {"lr": config.lr, **{f"option.{k}": v for k, v in config.options.items()}}
    return merged, {key: {"from": old.get(key), "to": value} for key, value in typed.items()
                    if not same_setting(config, key, value, old.get(key))}


@in_callers_words
def run(config: RunConfig, *, model=None, data=None, algorithm=None, resume: bool = False,
        overwrite: bool = False, progress: bool = True,
        on_eval: Callable[[dict, EngineState, Experiment], None] | None = None,
        experiment: Experiment | None = None, given: set[str] | None = None,
        change: dict[str, Any] | None = None) -> RunResult:
    """Runs an experiment; returns a :class:`RunResult` (the summary is also OUT/summary.json).

    ``model`` (a :class:`Model` or a Flax module), ``data`` (from ``fedjax_sparse.data``) and
    ``algorithm`` (an :class:`Algorithm` or a function ``task -> Algorithm``; also accepted as
    ``RunConfig(algorithm=...)``) replace the config's names; config.json records their names and
    the data's content digest. ``on_eval(row, state, experiment)`` is called after every evaluation
    (e.g. to record masks for plots). ``experiment`` reuses an already built one.
    ``resume`` continues the run recorded in ``config.out`` (see :func:`resumed_config`;
    ``given`` names the fields the user set). ``change`` (with ``resume`` only; ``--change KEY=VALUE``):
    ``{"lr": 0.01, "option.alpha": 0.01}``, the learning rate and algorithm options the resumed rounds use
    from the checkpoint on (see :func:`changed_config`; recorded in config.json's ``resumed`` with the
    round, marked by ``report`` and ``plot``). The output folder is locked for the run.
    In a multi-process run (:mod:`fedjax_sparse.driver.distributed`) every process calls ``run``;
    process 0 locks the folder and writes the files.
    """
    config, parts = with_components(config, model, data, algorithm)
    start: RunConfig | Checked = config
    if experiment is None and (parts.given() or not (resume and config.out)):
        # Checked once, before the folder is locked or anything is loaded (a resumed run's configuration is
        # the recorded one: open_run checks it once merged; objects are built with the configuration given).
        start = check(config, parts)
        if parts.given():
            experiment = build(start)
    out = Path(config.out) if config.out else None
    # Process 0 locks the folder; without one, or in another process of a multi-process run, nothing is
    # written (the others read it to resume).
    lock = None
    if out is not None and distributed.is_primary():
        try:
            lock = locked_out_dir(out).acquire()
        except RunError as e:
            distributed.stop_together("opening --out", e)  # the other processes stop too; raises e
            raise
    try:
        return _run(start, out, resume=resume and out is not None, overwrite=overwrite and lock is not None,
                    progress=progress and distributed.is_primary(), on_eval=on_eval, experiment=experiment,
                    given=given, change=change)
    finally:
        if lock is not None:
            lock.release()


class StopSignals:
    """While active, SIGTERM (what schedulers send before preemption) and SIGINT (Ctrl-C, a notebook's
    interrupt) ask the run to stop at the end of its current chunk, after a checkpoint; a second
    SIGINT interrupts at once. Only in the main thread (where Python delivers signals), and not in
    multi-process runs (the processes would stop at different chunks)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.unsaid: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread() and not distributed.multi_process():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        self.received = signum
        message = (f"\n{signal.Signals(signum).name} received: stopping after the current chunk of rounds, with a "
                   "checkpoint (Ctrl-C again to stop at once)\n")
        # Not print(): the signal may land while the main thread is inside sys.stderr's write (the progress
        # bar), and a buffered stream re-entered from a handler raises RuntimeError where the run was.
        # Straight to the file descriptor; a stream without one (a notebook) gets it from say_unsaid().
        try:
            os.write(sys.stderr.fileno(), message.encode())
        except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is both of the last two
            self.unsaid = message.strip("\n")

    def say_unsaid(self) -> None:
        """Prints the stop's notice the handler could not write itself (called outside the handler)."""
        if self.unsaid is not None:
            print(self.unsaid, file=sys.stderr, flush=True)
            self.unsaid = None

    def stop_runs(self, runs: list["OpenRun"], out: Path | None, several: bool = False) -> None:
        """A received stop: each run checkpoints (``checkpoint_for_stop``), then :class:`RunStopped` at the earliest
        round. Nothing without a signal, or when every run is past its last round (they finish)."""
        if self.received is None:
            return
        self.say_unsaid()
        if all(run.round >= run.config.rounds for run in runs):
            return
        for run in runs:
            run.checkpoint_for_stop()
        raise RunStopped(self.received, min(run.round for run in runs), out, several=several)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class ChunkClock:
    """Sizes the chunks of rounds so that the host regains control after about ``max_seconds`` of
    device work: from the measured seconds per round of the chunks after the first (which compiles),
    as a power of two (few distinct programs); before any measurement, from an estimate of the
    round's FLOPs at a deliberately low speed. ``max_seconds`` 0: no cap. A chunk's rounds give the
    same numbers however the rounds are split (tested), so the cap changes no result."""

    # Below any backend's speed for these models, so that the first chunk is not too long.
    ASSUMED_FLOPS_PER_SECOND = 2e9

    def __init__(self, max_seconds: float, estimated_round_seconds: float | None = None):
        self.max_seconds = float(max_seconds)
        self.cap: int | None = None
        if estimated_round_seconds:
            self.measured(1, estimated_round_seconds)

    def measured(self, rounds: int, seconds: float) -> None:
        if self.max_seconds > 0 and rounds > 0:
            within = max(1, int(self.max_seconds / max(seconds / rounds, 1e-9)))
            self.cap = 1 << (within.bit_length() - 1)   # the largest power of two <= within

    @classmethod
    def for_experiment(cls, max_seconds: float, exp: "Experiment") -> "ChunkClock":
        """The clock with its first cap from the round's training FLOPs (6 x MACs x examples)."""
        counts = np.asarray(exp.data.train_count, np.float64)
        examples = exp.engine.clients_per_round * exp.config.local_epochs * float(counts.mean())
        flops = 6.0 * exp.model.forward_macs * examples
        return cls(max_seconds, flops / cls.ASSUMED_FLOPS_PER_SECOND)


def _run(config: RunConfig | Checked, out: Path | None, *, resume: bool, overwrite: bool, progress: bool, on_eval,
         experiment: Experiment | None, given: set[str] | None, change: dict | None = None) -> RunResult:
    opened: OpenRun | RunResult | None = None
    try:
        with StopSignals() as signals:
            opened = open_run(config, out, resume=resume, overwrite=overwrite, experiment=experiment, given=given,
                              quiet=not progress, change=change)
            if isinstance(opened, RunResult):
                return opened
            return _run_to_end(opened, signals, out, progress, on_eval)
    except KeyboardInterrupt:
        # At once (a second Ctrl-C): the run has closed (its checkpoint writes finished), and the message
        # says what the folder holds now.
        done = opened.round if isinstance(opened, OpenRun) else None
        raise RunInterrupted(done, out, latest_checkpoint(out) if out is not None else None) from None


def _run_to_end(opened: "OpenRun", signals: StopSignals, out: Path | None, progress: bool, on_eval) -> RunResult:
    """Runs the chunks of ``opened`` to its last round, or to a stop ``signals`` received."""
    bar = Progress(opened.config.rounds, opened.round, progress)
    opened.start(bar, on_eval)
    # Several processes must run chunks of the same length: no clock there.
    clock = ChunkClock.for_experiment(0.0 if distributed.multi_process() else opened.execution.max_chunk_seconds,
                                      opened.exp)
    try:
        state = opened.state
        first_chunk = True
        while (n := opened.next_chunk(cap=clock.cap)) > 0:
            if signals.received is not None:
                break
            t_chunk = time.perf_counter()
            if first_chunk:
                bar.note(f"compiling and running rounds {opened.round + 1}-{opened.round + n} ...")
            if opened.population is not None:
                state, metrics = host_population.advance(opened.exp.engine, state, opened.population,
                                                         opened.exp.data, n, opened.execution.host_chunk_rounds)
            else:
                state, metrics = opened.exp.engine.advance(state, opened.exp.data, n)
            t_rounds = time.perf_counter() - t_chunk
            opened.record(state, metrics, n, chunk_started=t_chunk if first_chunk else None)
            signals.say_unsaid()
            if not first_chunk:  # the first chunk's time includes compiling
                clock.measured(n, t_rounds)
            first_chunk = False
        bar.close()
        # Decided after the loop, never from a flag read before a chunk's bookkeeping: the signal may
        # land at any moment of it (evaluation, logging, a checkpoint's write), and the stop checkpoints
        # the rounds booked by now unless a checkpoint of them was already written.
        signals.stop_runs([opened], out)
        return RunResult(opened.finish(), state, opened.population, opened.rows, opened.config)
    finally:
        bar.close()
        opened.close()


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What a resumed run read from its folder: ``record``, its config.json; ``saved``, the recorded
    configuration; ``changes``, the harmless changes accepted (:func:`resumed_config`); ``changed``, what
    ``--change`` changes from the checkpoint on (:func:`changed_config`)."""
    record: dict
    saved: RunConfig
    changes: dict
    changed: dict


def _open_out(config: RunConfig, out: Path, *, resume: bool, overwrite: bool, given: set[str] | None,
              change: dict | None) -> tuple[RunConfig, Recorded | None]:
    """Prepares ``out`` (process 0; every process stops on its problem) and, to resume, reads the recorded
    run: (the configuration the run continues, what was recorded), else (``config``, None)."""
    problem = None
    try:
        if distributed.is_primary():
            prepare_out_dir(out, resume=resume, overwrite=overwrite)
    except RunError as e:
        problem = e
    distributed.stop_together("opening --out", problem)
    if not resume:
        return config, None
    try:
        record = json.loads((out / "config.json").read_text())
        saved = RunConfig.from_json(record["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunError(f"{out / 'config.json'} is missing or damaged ({type(e).__name__}); the run cannot "
                       f"be resumed: start a fresh run in a new {arg('out')}") from None
    config, changes = resumed_config(config, saved, given)
    if config.lr is None:   # recorded by a version whose config.json did not hold the lr used: the default
        config = with_default_lr(config)
    changed: dict = {}
    if change:
        config, changed = changed_config(config, change)
    return config, Recorded(record, saved, changes, changed)


def _start_state(config: RunConfig, exp: Experiment) -> tuple[Experiment, EngineState,
                                                             "host_population.HostPopulation | None"]:
    """(the experiment, its initial state, the clients' rows in host memory with ``--client-state host``
    or None). A multi-process run's state is built in place over the processes' devices, and its
    experiment is a new one with the data laid out over them."""
    engine = exp.engine
    if distributed.multi_process():
        check_multi_process(config, engine)
        # Built in place: the population's rows land in their processes' shards (no full copy anywhere).
        state = jax.jit(engine.init, out_shardings=engine.state_shardings)(jax.random.PRNGKey(config.seed))
        return dataclasses.replace(exp, data=distributed.to_global(exp.data)), state, None
    if config.execution.client_state == "host":
        state, population = host_population.init_for_run(engine, config.seed, config.execution.client_storage,
                                                         config.algorithm)
        return exp, state, population
    return exp, engine.init(jax.random.PRNGKey(config.seed)), None


def _measured(config: RunConfig, exp: Experiment, state: EngineState, record: dict) -> tuple[Experiment, dict | None]:
    """``--client-parallelism measure``: (a new experiment whose engine runs the fastest schedule, what
    was measured); a resumed run keeps the schedule it measured. Otherwise (``exp``, None)."""
    if config.execution.client_parallelism != "measure":
        return exp, None
    if record.get("client_parallelism_measured"):
        # A resumed run keeps the schedule it measured (same program, same numbers).
        measured = record["client_parallelism_measured"]
        mode = record["client_parallelism"]
    else:
        mode, seconds = measure_client_parallelism(exp.engine, state, exp.data)
        measured = {"seconds_per_round": seconds, "backend": jax.default_backend()}
        print(f"client parallelism: measured {', '.join(f'{m} {t:.3f} s' for m, t in seconds.items())} per "
              f"round; using {mode}", file=sys.stderr)
    return dataclasses.replace(exp, engine=dataclasses.replace(exp.engine, client_parallelism=mode)), measured


def _write_config(out: Path, config: RunConfig, exp: Experiment, estimate: "memory.MemoryEstimate",
                  population: "host_population.HostPopulation | None", measured: dict | None,
                  history: list) -> None:
    """OUT/config.json: the resolved configuration, the algorithm's options, the model, the data, the
    memory estimate and the environment (keys are only ever added)."""
    engine = exp.engine
    (out / "config.json").write_text(json.dumps({
        "config": config.to_json(), "algorithm_options": exp.algorithm.hparams,
        "model": exp.model.name, "num_params": exp.model.num_params,
        "forward_macs_per_example": exp.model.forward_macs,
        "memory_estimate": estimate.as_dict(),
        "pinned_draws": exp.pinned, "data": exp.data_record, "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
        "processes": jax.process_count(),
        # Devices each round's cohort is split over (1: not split).
        "client_devices": 1 if engine.client_sharding is None else len(engine.client_sharding.device_set),
        # Multi-process: whether the population's state is split over the processes (else replicated).
        "population_sharded": engine.population_sharding is not None,
        "client_parallelism": engine.mode,
        **({"client_parallelism_measured": measured} if measured else {}),
        # --client-state host: bytes of one client's stored row (clients never trained cost none).
        **({"host_population": {"row_bytes": population.row_bytes, "storage": config.execution.client_storage}}
           if population is not None else {}),
        **({"resumed": history} if history else {})}, indent=2))


def open_run(config: RunConfig | Checked, out: Path | None, *, resume: bool, overwrite: bool,
             experiment: Experiment | None, given: set[str] | None, quiet: bool = False,
             change: dict | None = None) -> "OpenRun | RunResult":
    """Prepares ``out`` (resume or fresh), builds the experiment, restores the checkpoint and writes
    config.json. Returns the :class:`OpenRun`, or the finished run's result when a resumed run is
    already complete. ``config``: a fresh run's :class:`Checked` configuration, built as it is (a
    RunConfig from :func:`with_components` is checked here, as is a resumed run's: the recorded one
    merged with what the user gave); ``experiment``: an already built one (nothing is checked or built)."""
    checked = config if isinstance(config, Checked) else None
    config = config.config if isinstance(config, Checked) else config
    if change and not (resume and out is not None):
        raise RunError(f"{arg('change')} changes a resumed run from its checkpoint on: add {arg('resume')} (and "
                       f"{arg('out')}); a new run takes {arg('lr')} and {arg('option')} directly")
    if change and experiment is not None:
        raise RunError(f"{arg('change')} rebuilds the resumed run from its configuration; a run given model, data or "
                       "algorithm objects resumes without it")
    recorded: Recorded | None = None
    writes = out is not None and distributed.is_primary()
    if out is not None:
        config, recorded = _open_out(config, out, resume=resume, overwrite=overwrite, given=given, change=change)
    record = recorded.record if recorded is not None else {}
    t_build = time.perf_counter()
    if experiment is not None:
        exp = experiment
    else:   # checked once: a fresh run's before it opened the folder, a resumed run's now
        exp = build(checked if checked is not None and recorded is None else check(config))
    build_seconds = time.perf_counter() - t_build
    # Memory known before compiling: shapes and traced programs only (nothing compiled or allocated).
    estimate = memory.estimate(exp)
    if distributed.is_primary() and not quiet:
        print(memory.format_estimate(estimate), file=sys.stderr)
    problem = None
    try:
        memory.check_fits(estimate, config)
    except RunError as e:
        problem = e
    distributed.stop_together("estimating memory", problem)
    recorded_digest = record.get("data", {}).get("digest")
    if resume and recorded_digest and exp.data_record.get("digest") not in (None, recorded_digest):
        raise RunError(f"{arg('resume')}: the data differs from the recorded run's (content digest "
                       f"{exp.data_record['digest'][:12]} vs {recorded_digest[:12]} in {out}/config.json); "
                       f"resume with the same data, or start a new run in another {arg('out')}")
    exp, state, population = _start_state(config, exp)
    # Costs are exact Python ints (float only for expectations such as FedDrop's FLOPs).
    totals: dict[str, Any] = {"round": 0, "uplink_bits": 0, "downlink_bits": 0, "flops": 0, "seconds": 0.0,
                              "client_steps": 0, "client_steps_executed": 0}
    rows: list[dict] = []
    history: list = []
    if out is not None:
        if recorded is not None:
            changed = recorded.changed
            try:
                state, totals, saved_rows = restore_checkpoint(out, state, population=population)
            except RunError as e:
                if not changed:
                    raise
                raise RunError(f"{arg('change')} {', '.join(changed)}: {e} (the changed options need another state; "
                               "change only what keeps it, e.g. lr)") from None
            totals.setdefault("client_steps", None)
            totals.setdefault("client_steps_executed", None)
            totals = {k: exact_number(v) if k in COST_KEYS else v for k, v in totals.items()}
            # The checkpoint's own rows (a damaged or cut metrics.jsonl is restored from them); rows past it
            # are dropped: the resume recomputes them.
            done = int(totals["round"])
            saved = recorded.saved
            rows = recover_metrics(out, done, saved_rows, repair=writes,
                                   last_evaluation=done if done >= saved.rounds else done - done % saved.eval_every)
            # Every process has read the recorded run before process 0 rewrites any of it.
            distributed.barrier("fedjax_sparse:resume-read")
            if writes:
                write_metrics(out, rows)
            history = list(record.get("resumed", []))
            history.append({"at_round": int(totals["round"]), "changed": recorded.changes,
                            # --change: used from round at_round + 1 on ({key: {"from": old, "to": new}})
                            **({"changed_experiment": changed} if changed else {})})
            if changed and int(totals["round"]) >= config.rounds:
                raise RunError(f"{arg('change')}: the run in {out} has no rounds left ({int(totals['round'])} of "
                               f"{config.rounds}); pass a larger {arg('rounds')} with it")
            if int(totals["round"]) >= config.rounds:
                print(f"the run in {out} is complete ({int(totals['round'])} of {config.rounds} rounds); pass a "
                      "larger --rounds to extend it", file=sys.stderr)
                summary_path = out / "summary.json"
                if summary_path.exists():
                    return RunResult(json.loads(summary_path.read_text()), state, population, rows, config)
                # Killed between its last checkpoint and its summary: write the summary now.
                summary = summarize(config, exp, rows, totals, build_seconds, 0.0)
                if writes:
                    summary_path.write_text(json.dumps(jsonable(summary), indent=2, allow_nan=False))
                return RunResult(summary, state, population, rows, config)
        elif overwrite and writes:
            clear_outputs(out)  # only now that the new run has built
    exp, measured = _measured(config, exp, state, record)
    if writes and out is not None:
        _write_config(out, config, exp, estimate, population, measured, history)
    return OpenRun(config, exp, out, state, totals, rows, build_seconds, population)


def check_multi_process(config: RunConfig, engine: Engine) -> None:
    """The settings a multi-process run needs: every process must run the same program, and the
    cohort must split evenly over all devices (otherwise no process would share the work)."""
    devices = jax.device_count()
    if config.execution.client_state == "host":
        raise RunError(f"{arg('client_state', 'host')} keeps the population in one process's memory; a multi-process "
                       f"run shards it over the processes' devices: use {arg('client_state', 'device')}")
    if config.execution.client_parallelism == "measure":
        raise RunError(f"{arg('client_parallelism', 'measure')} times each process on its own and could pick "
                       f"different programs; a multi-process run uses vmap: drop it or pass "
                       f"{arg('client_parallelism', 'vmap')}")
    if engine.mode != "vmap":
        raise RunError(f"a multi-process run splits the cohort through vmap; "
                       f"{arg('client_parallelism', config.execution.client_parallelism)} would repeat all the work "
                       "on every process: use auto or vmap")
    if engine.client_sharding is None:
        raise RunError(f"a multi-process run splits each round's {engine.clients_per_round} clients over all "
                       f"{devices} devices ({jax.process_count()} processes): {arg('clients_per_round')} must be a "
                       f"multiple of {devices}")


class OpenRun:
    """One run's bookkeeping between jitted chunks: totals, metrics rows, output files, progress.

    The caller advances the state (alone, or stacked with other replicas) and hands each chunk's
    host metrics to :meth:`record`, which evaluates, writes the metrics row, checkpoints and
    reports progress. ``evaluate`` may be swapped for one shared between replicas (same numbers,
    one compilation)."""

    def __init__(self, config: RunConfig, exp: Experiment, out: Path | None, state: EngineState, totals: dict,
                 rows: list, build_seconds: float, population: "host_population.HostPopulation | None" = None):
        self.config, self.exp, self.out, self.state = config, exp, out, state
        self.execution = config.execution
        self.population = population
        # Process 0 writes the files (every process checkpoints: orbax coordinates them).
        self.writes = out is not None and distributed.is_primary()
        self.totals, self.rows, self.build_seconds = totals, rows, build_seconds
        self.evaluate: Callable[[EngineState], dict] = lambda s: exp.engine.evaluate(s, exp.data)
        if population is not None:
            self.evaluate = lambda s: host_population.evaluate(exp.engine, s, population, exp.data)
        self.compile_seconds = 0.0
        self.bar: Progress | None = None
        self.sinks: MetricSinks | None = None
        self.on_eval = None
        self.t0 = 0.0
        self.last_checkpoint = time.perf_counter()
        self.checkpointer: Checkpointer | None = None
        # The round of the newest checkpoint in ``out`` (a resume's: the one it restored; 0: none yet).
        self.saved_round = self.round
        # --dp-clip: round r -> epsilon after it at --dp-delta, for the run's sampling and accountant.
        self.dp_epsilon: Callable[[int], float] | None = None
        if config.dp_clip is not None:
            from fedjax_sparse.driver import privacy
            self.dp_epsilon = privacy.epsilon_by_round(
                float(exp.algorithm.hparams["dp_noise_multiplier"]), config.rounds, config.dp_delta,
                num_clients=config.num_clients, clients_per_round=config.clients_per_round,
                sampling=privacy_sampling(config), accountant=privacy_accountant(config))

    @property
    def round(self) -> int:
        return int(self.totals["round"])

    def start(self, bar: "Progress | None", on_eval=None) -> None:
        """Opens the extra logs and starts the clock (``bar``: this run's progress, or None)."""
        self.bar, self.on_eval = bar, on_eval
        self.sinks = MetricSinks(self.out if self.writes else None, self.config.execution.log)
        self.t0 = time.perf_counter() - float(self.totals["seconds"])

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()   # waits for the last write
            self.checkpointer = None
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None

    def next_chunk(self, cap: int | None = None) -> int:
        """Rounds in the next chunk: up to the next evaluation, round checkpoint (``--checkpoint-every``)
        or the end, and at most ``cap`` (0 when the run is done)."""
        done, config = self.round, self.config
        if done >= config.rounds:
            return 0
        n = min(config.eval_every - done % config.eval_every, config.rounds - done)
        if config.execution.checkpoint_every:
            n = min(n, config.execution.checkpoint_every - done % config.execution.checkpoint_every)
        return min(n, cap) if cap else n

    def _checkpoint_due(self) -> bool:
        """A checkpoint between evaluations: on the round cadence, or by the clock."""
        config = self.config
        if config.execution.checkpoint_every and self.round % config.execution.checkpoint_every == 0:
            return True
        # Several processes must agree on every checkpoint (orbax saves together): no clock there.
        return bool(config.execution.checkpoint_seconds) and not distributed.multi_process() and \
            time.perf_counter() - self.last_checkpoint >= config.execution.checkpoint_seconds

    def record(self, state: EngineState, metrics: dict, n: int, chunk_started: float | None = None) -> dict | None:
        """Books ``n`` rounds that ended in ``state`` (``metrics``: host metrics, one entry per
        round): totals; at an evaluation round (or a diverged one) the evaluation and the metrics row;
        a checkpoint on ``--checkpoint-every`` / ``--checkpoint-seconds`` and at the end (a stop's:
        :meth:`checkpoint_for_stop`); progress. ``chunk_started``: the clock at the start of this
        process's first chunk (its time includes compiling). Returns the row, if any."""
        config, totals, out = self.config, self.totals, self.out
        self.state = state
        # A NaN loss is divergence, except in a round whose (Poisson) cohort was empty: no loss at all.
        empty = metrics["clients"] == 0 if "clients" in metrics else np.zeros(n, bool)
        bad = [self.round + i + 1 for i in range(n) if not np.isfinite(metrics["loss"][i]) and not empty[i]]
        totals["round"] = self.round + n
        for key in COST_KEYS:
            # An algorithm that does not count a cost leaves its total unknown (None), not 0.
            unknown = key not in metrics or totals[key] is None
            totals[key] = None if unknown else totals[key] + sum(metrics[key].tolist())
        for key in STEP_METRICS:
            # A checkpoint from before these counts existed has none: its totals stay unknown (None).
            if key in metrics and totals.get(key) is not None:
                totals[key] = int(totals[key]) + int(metrics[key].sum())
        if "cohort_overflow" in metrics:
            # Poisson cohorts larger than the capacity (probability <= 1e-9 a round): counted, warned, never silent.
            overflow = int(metrics["cohort_overflow"].sum())
            totals["cohort_overflow"] = int(totals.get("cohort_overflow", 0)) + overflow
            if overflow:
                warnings.warn(f"{overflow} sampled client(s) beyond the Poisson cohort capacity "
                              f"{self.exp.engine.cohort_capacity} were left out in rounds {self.round - n + 1}-"
                              f"{self.round} (the highest ids; counted in total_cohort_overflow)", stacklevel=2)
        at_eval = self.round % config.eval_every == 0 or self.round >= config.rounds or bool(bad)
        evaluation = self.evaluate(state) if at_eval else None
        if chunk_started is not None:
            self._first_chunk_done(chunk_started, n)
        totals["seconds"] = time.perf_counter() - self.t0
        row = self._log(evaluation, metrics, bad) if evaluation is not None else None
        # Checkpoints keep their own cadence (not every evaluation): the clock and --checkpoint-every,
        # the end, and a stop; rows written after the last checkpoint are recomputed by a resume.
        if out is not None and (self.round >= config.rounds or self._checkpoint_due()):
            self.checkpoint()
        if row is not None and self.on_eval is not None:
            self.on_eval(row, state, self.exp)
        if self.bar is not None:
            self.bar.update(self.round, self.rows[-1]["accuracy"] if self.rows else None)
        return row

    def checkpoint(self) -> None:
        """A checkpoint of the rounds booked so far (with the metrics rows up to them), written while the
        next chunk runs; closing the run waits for it."""
        if self.out is None:
            return
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.out)
        self.checkpointer.save(self.state, self.totals, population=self.population, rows=self.rows)
        self.last_checkpoint = time.perf_counter()
        self.saved_round = self.round

    def checkpoint_for_stop(self) -> None:
        """What a stop leaves: a checkpoint of the rounds booked so far, unless one of them is already
        written (a signal may land during any moment of a chunk's bookkeeping, a checkpoint's write too)."""
        if self.saved_round != self.round:
            self.checkpoint()

    def _first_chunk_done(self, chunk_started: float, n: int) -> None:
        # This process's first chunk includes compiling the round (and the evaluation, when it ends at
        # one; after a resume too): reported apart, and left out of the ETA.
        totals = self.totals
        self.compile_seconds = time.perf_counter() - chunk_started
        # Summed over the sessions of a resumed run, so its steady-state speed stays true.
        totals["compile_seconds"] = float(totals.get("compile_seconds", 0.0)) + self.compile_seconds
        totals["first_chunk_rounds"] = int(totals.get("first_chunk_rounds", 0)) + n
        if self.bar is not None:
            self.bar.note(f"first chunk (incl. compilation) took {self.compile_seconds:.1f} s")
            self.bar.restart(self.round)

    def _log(self, evaluation: dict, metrics: dict, bad: list) -> dict:
        """Appends the metrics row (``evaluation``, the last round's training metrics, the totals) and raises
        on divergence."""
        config, totals, out = self.config, self.totals, self.out
        # A NaN/inf test loss means non-finite outputs, whose argmax (class 0) is no accuracy: the row keeps
        # its keys with the accuracies null, and the run ends below.
        broken = [k for k in ("test_loss", "global_test_loss")
                  if isinstance(evaluation.get(k), float) and not np.isfinite(evaluation[k])]
        if broken:
            evaluation = {k: None if "accuracy" in k else v for k, v in evaluation.items()}
        row = {"round": totals["round"],
               **{k: v for k, v in evaluation.items() if k != "client_accuracies"},
               "loss": float(metrics["loss"][-1]),
               **{key: metrics[key][-1] if key in metrics else None for key in COST_KEYS},
               "density": float(metrics["density"][-1]) if "density" in metrics else None,
               # The same value under an explicit name: the mean over the round's sampled clients
               # (``density_all_clients``, when the algorithm has personal models, is over all clients).
               "density_sampled": float(metrics["density"][-1]) if "density" in metrics else None,
               "seconds": totals["seconds"],
               "total_uplink_bits": totals["uplink_bits"],
               "total_downlink_bits": totals["downlink_bits"],
               "total_flops": totals["flops"]}
        for key in STEP_METRICS:
            if key in metrics and totals.get(key) is not None:
                row[f"total_{key}"] = totals[key]
        for key, value in metrics.items():
            if key not in row and key != "num_examples":
                row[key] = int(value[-1]) if key in STEP_METRICS or key in COHORT_METRICS else float(value[-1])
        if "cohort_overflow" in metrics:
            row["total_cohort_overflow"] = totals.get("cohort_overflow", 0)
        if self.dp_epsilon is not None:
            row["dp_epsilon"] = self.dp_epsilon(totals["round"])
            row["dp_clipped_fraction"] = row.get("server_dp_clipped_fraction")
        if self.population is not None:
            # Clients trained at least once so far (the others still hold the initial row).
            row["clients_touched"] = self.population.touched
            row["host_population_bytes"] = self.population.nbytes
        row = {k: jsonable(v) for k, v in row.items()}
        self.rows.append(row)
        if self.writes and out is not None:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")
            assert self.sinks is not None, "start() opens the sinks"
            self.sinks.write(self.rows)
        if (bad or broken) and self.bar is not None:
            self.bar.close()
        if bad:
            raise RunError(f"training diverged{self.label}: the loss is NaN/inf at round {bad[0]}; lower {arg('lr')} "
                           f"(now {config.lr}) or check the data preprocessing ({arg('preprocess')})")
        if broken:
            raise RunError(f"evaluation diverged{self.label}: the test loss is NaN/inf at round {totals['round']} "
                           "(the model's outputs are not finite), so no accuracy is reported; check the model's "
                           f"normalisation (a BatchNorm running variance below 0 gives NaN) or lower {arg('lr')} "
                           f"(now {config.lr})")
        return row

    label = ""   # " (seed k)" for a replica, in error messages

    def finish(self) -> dict:
        """The summary (also written to OUT/summary.json)."""
        summary = summarize(self.config, self.exp, self.rows, self.totals, self.build_seconds, self.compile_seconds)
        if self.writes and self.out is not None:
            (self.out / "summary.json").write_text(json.dumps(jsonable(summary), indent=2, allow_nan=False))
        return summary
