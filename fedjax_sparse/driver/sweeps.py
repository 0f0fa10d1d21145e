"""Sweeps: a grid of hyper-parameters x seeds in one process, and the table a paper needs.

``sweep(config, {"lr": [0.01, 0.1]}, seeds=[0, 1, 2])`` runs every grid point with every seed, each
member in ``OUT/<point>/seed<seed>/``, and writes ``OUT/sweep.json`` and ``OUT/sweep.md``. Traced values
share one program (:func:`make_rebuild`), the other keys split the grid; a diverged member is recorded;
``resume=True`` continues or extends (:func:`resume_plan`). All of it: docs/sweeps.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.algorithms.registry import algorithm_builder, algorithm_names, resolve_options
from fedjax_sparse.driver.checkpoint import has_checkpoint, locked_out_dir, read_metrics
from fedjax_sparse.driver.config import (EXECUTION_FIELDS, OPTION_PREFIXES, RunConfig, parse_overrides, typed_axes,
                                         with_overrides)
from fedjax_sparse.data.arrays import PartitionedData
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.errors import RunError, arg, in_callers_words, in_python
from fedjax_sparse.driver.experiment import Experiment, build, check, with_components, wrap_algorithm
from fedjax_sparse.driver.settings import flag_of
from fedjax_sparse.driver.replicas import RunGroup, resolve_replica_parallelism, seed_list, unshareable_reason
from fedjax_sparse.driver.runner import (RESUMABLE_CHANGES, RunResult, StopSignals, differing_settings, open_run,
                                         resumed_config)

# Keys whose values a program may take as traced arrays (if the algorithm's builder allows: tried).
TRACEABLE_FIELDS = ("lr",)
# RunConfig fields a sweep may not vary: the seed has --seeds; the rest are where and how it runs.
NOT_SWEPT = ("seed", "out", "data_dir", "download", "algorithm", "dataset", "execution", "options",
             "model_options", "dataset_options", "rounds", "eval_every")
SELECT_KEYS = ("best_accuracy", "final_accuracy")


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a sweep: a grid point (``((key, value), ...)`` in axis order) and a seed."""
    point: tuple
    seed: int
    config: RunConfig


def parse_sweep(specs: Sequence[str]) -> dict[str, list]:
    """``["lr=0.01,0.1", "option.alpha=0.001,0.002"]`` -> ``{"lr": ["0.01", "0.1"], ...}``: the values as
    text, typed by :func:`sweep` for the configuration they vary (``config.parse_overrides``, the grammar of
    every KEY=VALUE flag). One-line RunError on a malformed or repeated key."""
    return parse_overrides(specs, "--sweep", lists=True)


# Keys an object given to ``sweep`` decides (its config name is a label): sweeping them would change nothing.
OBJECT_DECIDES = {"model": ("model", "model_option."),
                  "dataset": ("dataset", "data_dir", "download", "dataset_option."),
                  "partitioned data": ("num_clients", "partition", "min_client_samples", "partition_file"),
                  "algorithm": ("algorithm", "option.")}


def axis_lists(axes) -> dict[str, list]:
    """``axes`` as {key: list of values}, or a one-line RunError: a single value (``{"lr": 0.1}``; a string
    would be swept letter by letter) or a set (no order) is refused, never coerced."""
    if not isinstance(axes, dict):
        raise RunError(f"a sweep's axes are a dict {{key: [values]}}, got a {type(axes).__name__}: write e.g. "
                       "{'lr': [0.01, 0.1]}")
    out = {}
    for key, values in axes.items():
        if isinstance(values, (str, bytes, dict, set, frozenset)) or not hasattr(values, "__iter__"):
            raise RunError(f"sweep axis {key!r} needs a list of values, got the {type(values).__name__} {values!r}: "
                           f"write {{{key!r}: [{values!r}]}}")
        out[key] = list(values)
    return out


def check_axes(config: RunConfig, axes: dict[str, list], objects: Sequence[str] = ()) -> None:
    """One-line RunError for keys a sweep cannot vary (with the fix). ``objects``: the components
    given as objects (``OBJECT_DECIDES``'s keys), whose keys cannot be swept."""
    for kind in objects:
        decided = [key for key in axes if any(key == k or (k.endswith(".") and key.startswith(k))
                                              for k in OBJECT_DECIDES[kind])]
        if decided:
            raise RunError(f"{arg('sweep')} {decided[0]}: the {kind} is an object, which decides it; sweep over "
                           "objects with a loop of fjs.run, or give the component by name")
    if not axes:
        raise RunError(f"a sweep needs at least one {arg('sweep', 'KEY=V1,V2')} (several seeds alone: {arg('seeds')})")
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    for key, values in axes.items():
        if not values:
            raise RunError(f"{arg('sweep')} {key} has no values")
        prefix, _, name = key.partition(".")
        if prefix in OPTION_PREFIXES and name:
            continue
        if key in EXECUTION_FIELDS:
            raise RunError(f"{arg('sweep')} {key}: execution settings change no number; sweep what is computed")
        if key == "seed":
            raise RunError(f"{arg('sweep')} seed: give the seeds with {arg('seeds', [0, 1, 2])} (every grid point "
                           "runs each)")
        if key not in fields or key in NOT_SWEPT:
            raise RunError(f"{arg('sweep')} cannot vary {key!r}; sweep a RunConfig field (lr, local_epochs, "
                           "malicious_fraction, ...), option.NAME, model_option.NAME or dataset_option.NAME")


def grid(axes: dict[str, list]) -> list[tuple]:
    """Every grid point, ``((key, value), ...)`` in the keys' order, the first axis slowest; one empty
    point (the configuration as given) when there is no axis."""
    return [tuple(zip(axes, values)) for values in itertools.product(*axes.values())]


def point_label(point: tuple) -> str:
    """The point's folder name and table label, e.g. ``lr=0.01,option.alpha=0.002``."""
    return ",".join(f"{key}={value}" for key, value in point).replace("/", "_")


def members_of(config: RunConfig, axes: dict[str, list], seeds: Sequence[int]) -> list[Member]:
    out = Path(config.out) if config.out else None
    return [Member(point, int(seed), dataclasses.replace(
                with_overrides(config, point), seed=int(seed),
                out=str(out / point_label(point) / f"seed{seed}") if out else None))
            for point in grid(axes) for seed in seeds]


# ------------------------------------------------------------------ one program for many points
def _float_options(config: RunConfig) -> set[str]:
    """The algorithm's options declared as floats: the only ones traced (as float32 arrays), so an
    integer or boolean option never reaches the algorithm with another dtype than its run alone."""
    options = resolve_options(config.algorithm, config.options)
    return {f"option.{f.name}" for f in dataclasses.fields(options) if type(f.default) is float}


def _hp_of(point: tuple, keys: Sequence[str]) -> dict:
    """The traced values of a point: {key: float32 [] array}."""
    values = dict(point)
    return {key: jnp.asarray(values[key], jnp.float32) for key in keys}


def make_rebuild(exp: Experiment, keys: Sequence[str]) -> Callable[[dict], Engine]:
    """``hp -> Engine``: ``exp``'s engine with its algorithm rebuilt from the traced values ``hp``
    (``lr`` and ``option.NAME`` keys) by the algorithm's registered builder; everything else as
    ``exp`` was built (its options were checked with their concrete values)."""
    config = exp.config
    options = resolve_options(config.algorithm, config.options)
    concrete = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    builder = algorithm_builder(config.algorithm)

    def rebuild(hp: dict) -> Engine:
        values = dict(concrete)
        values.update({key.partition(".")[2]: value for key, value in hp.items() if key.startswith("option.")})
        task = dataclasses.replace(exp.task, lr=hp["lr"]) if "lr" in hp else exp.task
        built = builder(task, **values)
        # The untraced options in hparams, as make_algorithm records them: with_dp reads its refusals there
        # (FedDrop's optimize=); a traced value is an array and is left out.
        fixed = {name: value for name, value in concrete.items() if f"option.{name}" not in hp}
        algorithm = wrap_algorithm(dataclasses.replace(built, hparams={**fixed, **built.hparams}), config)
        return dataclasses.replace(exp.engine, algorithm=algorithm)
    return rebuild


def _trace_problem(exp: Experiment, state, keys: Sequence[str], point: tuple) -> str | None:
    """None when the round traces with ``keys`` as arrays; else the tracing error's first line."""
    rebuild = make_rebuild(exp, keys)
    try:
        jax.eval_shape(lambda hp, s: rebuild(hp).round_step(s, exp.data), _hp_of(point, keys), state)
    except Exception as e:  # noqa: BLE001 - any failure to trace means: a program per value
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return None


def traced_keys(exp: Experiment, state, point: tuple, algorithm_object: bool = False
                ) -> tuple[list[str], dict[str, str]]:
    """(keys the program takes as arrays, {key: why not} for the others): each candidate tried
    alone, then those that traced, together. ``algorithm_object``: the algorithm was given as an
    object (its name may still be a registered one, but the registry's builder is not what runs)."""
    if algorithm_object or exp.config.algorithm not in algorithm_names():
        return [], {key: "the algorithm is an object, not a registered name: it cannot be rebuilt"
                    for key, _ in point}
    why: dict[str, str] = {}
    ok = []
    float_options = _float_options(exp.config)
    for key, _ in point:
        if key.startswith("option.") and key not in float_options:
            why[key] = "not a float option (traced values are float32 arrays)"
        elif key not in TRACEABLE_FIELDS and key not in float_options:
            why[key] = "not a learning rate or an algorithm option (shapes, data or the threat model)"
        elif problem := _trace_problem(exp, state, [key], point):
            why[key] = problem
        else:
            ok.append(key)
    if ok and (problem := _trace_problem(exp, state, ok, point)):
        why.update({key: f"traced alone, not together ({problem})" for key in ok})
        ok = []
    return ok, why


# ------------------------------------------------------------------ the sweep
@dataclasses.dataclass(repr=False)
class SweepResult:
    """What ``sweep`` returns: the members' results (None where diverged), the table's rows
    (one per grid point), the best point and the sweep's record (``sweep.json``). ``by_point``: the
    results as ``{point label: {seed: RunResult or None}}`` (each with its metrics ``rows``);
    ``repr`` is the table (never the states' arrays)."""
    members: list[Member]
    results: list[RunResult | None]
    rows: list[dict]
    best: dict | None
    record: dict

    def table(self) -> str:
        return format_table(self.record)

    @property
    def by_point(self) -> dict[str, dict[int, RunResult | None]]:
        """The members' results by grid point (its label, e.g. ``lr=0.1``; the grid's order) and seed."""
        points: dict[str, dict[int, RunResult | None]] = {}
        for member, result in zip(self.members, self.results):
            points.setdefault(point_label(member.point), {})[member.seed] = result
        return points

    def __repr__(self) -> str:
        return "SweepResult (.by_point[point][seed]: the members' results)\n" + self.table()

    __str__ = __repr__


@in_callers_words
def sweep(config: RunConfig, axes: dict[str, list] | None = None, seeds: Sequence[int] | None = None, *,
              parallelism: str = "auto", select: str | None = None, resume: bool = False, overwrite: bool = False,
              progress: bool = True, given: set[str] | None = None, keep_states: bool = True, model=None, data=None,
              algorithm=None) -> SweepResult:
    """Runs every grid point of ``axes`` ({key: values}) with every seed (docs/sweeps.md): member ``(point,
    seed)`` is the run of ``config`` with the point's values and that seed, in ``OUT/<point>/seed<seed>/`` (the
    same numbers as that run alone); ``OUT/sweep.json`` and ``OUT/sweep.md`` hold the mean ± sample std over
    seeds per point and the best point by ``select``. One program's members are open at a time.
    ``keep_states``: keep every member's final state in ``results`` (False: ``RunResult.state`` is None, and
    only the running group's states are alive).
    ``model``, ``data``, ``algorithm``: objects replacing the config's names in every member, as in
    ``fjs.run`` (the keys they decide cannot be swept; an algorithm object gets a program per point).
    ``seeds``: default ``(0,)``; ``select``: default ``best_accuracy``.

    ``resume=True`` with ``config.out`` holding a sweep continues it (see :func:`resume_plan`): ``axes``,
    ``seeds`` and ``select`` left None are the recorded ones, and ``config`` must be the recorded
    configuration (``given``: the fields the user set, as for ``fjs.run``; None compares every field);
    a larger grid or more seeds extend the sweep, anything else is refused in one line."""
    config, parts = with_components(config, model, data, algorithm)
    objects = sorted(parts.given()) + (["partitioned data"] if isinstance(parts.data, PartitionedData) else [])
    out = Path(config.out) if config.out else None
    previous = _read_record(out) if (resume and out is not None) else {}
    seeds = None if seeds is None else seed_list(seeds)
    axes = None if axes is None else axis_lists(axes)
    if axes is not None:
        # The keys in the sweep's words, then text values typed for the configuration they vary: the
        # recorded one when resuming (its algorithm's options), so that they compare with the recorded grid.
        check_axes(config, axes, objects)
        axes = typed_axes(RunConfig.from_json(previous["config"]) if previous else config, axes, "sweep")
    if previous:
        assert out is not None
        config, axes, seeds, select, notice = resume_plan(config, axes, seeds, select, previous, given, out)
        if notice:
            print(notice, file=sys.stderr)
    elif axes is None:
        raise RunError(f"a sweep needs at least one {arg('sweep', 'KEY=V1,V2')}"
                       + (f" ({out} holds no sweep.json to resume)" if resume and out is not None else ""))
    seeds = [0] if seeds is None else seeds
    select = select or "best_accuracy"
    parse_select(select)
    if config.execution.client_state == "host":
        raise RunError(f"a sweep stacks its members' clients on the device; sweep with {arg('client_state', 'device')}")
    members = members_of(config, axes, seeds)
    checked = [check(member.config, parts) for member in members]   # each once, before anything runs
    mode = resolve_replica_parallelism(parallelism)
    diverged: dict[str, str] = dict(previous.get("diverged", {}))
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        signals = stack.enter_context(StopSignals())
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            stack.enter_context(locked_out_dir(out))
            if not resume and not overwrite and (out / "sweep.json").exists():
                raise RunError(f"{out} already holds a sweep; pass {arg('resume')} to continue it, {arg('overwrite')} "
                               f"to replace it, or another {arg('out')}")
        results: dict[int, RunResult] = {}

        def open_member(index: int):
            """The member's OpenRun, or its RunResult when its folder holds a finished run."""
            member = members[index]
            member_out = Path(member.config.out) if member.config.out else None
            if member_out is not None:
                stack.enter_context(locked_out_dir(member_out))
            resume_m = resume and member_out is not None and has_checkpoint(member_out)
            if resume and not resume_m and member_out is not None:
                kept = _finished_without_checkpoint(member.config, member_out)
                if kept is not None:
                    results[index] = kept
                    return None
            experiment = build(checked[index]) if objects else None
            run = open_run(checked[index], member_out, resume=resume_m,
                           overwrite=overwrite or (resume and not resume_m), experiment=experiment, given=given,
                           quiet=True)
            if isinstance(run, RunResult):
                results[index] = run if keep_states else dataclasses.replace(run, state=None)
                return None
            return run

        programs: list[dict] = []

        def run_group(opened: list[tuple[int, Any]], keys: list[str]) -> None:
            """Runs one program's members (``(index, OpenRun or None when finished)``) to their end."""
            group = [(i, run) for i, run in opened if run is not None]
            if not group:
                return
            runs = [run for _, run in group]
            reason = unshareable_reason(runs) if len(runs) > 1 else None
            group_mode = mode if reason is None else "separate"
            program = None
            if keys and group_mode != "separate":
                program = (make_rebuild(runs[0].exp, keys), [_hp_of(members[i].point, keys) for i, _ in group])
            programs.append({"points": sorted({point_label(members[i].point) for i, _ in group}),
                             "members": len(group), "mode": group_mode,
                             **({"why_separate": reason} if reason else {})})
            runner_group = RunGroup(runs, group_mode, progress, [None] * len(runs), program, keep_going=True,
                                    label=lambda r: f" ({r.out.parent.name}/{r.out.name})" if r.out else "",
                                    signals=signals, out=out)
            for j, ((index, _), result) in enumerate(zip(group, runner_group.run_to_end(keep_states))):
                if result is None:
                    diverged[_name(members[index])] = runner_group.diverged[j]
                else:
                    results[index] = result

        # The first unfinished member decides which keys trace; then the members are opened one program
        # (group) at a time, so only one group's states are alive at once (docs/sweeps.md).
        pending = [i for i, m in enumerate(members) if _name(m) not in diverged]
        first = next(filter(lambda opened: opened[1] is not None, ((i, open_member(i)) for i in pending)), None)
        if first is not None:
            keys, why = traced_keys(first[1].exp, first[1].state, members[first[0]].point,
                                    algorithm_object=parts.algorithm is not None)
            groups: dict[tuple, list[int]] = {}
            for index in pending:
                if index not in results:
                    structural = tuple((k, v) for k, v in members[index].point if k not in keys)
                    groups.setdefault(structural, []).append(index)
            handed = {first[0]: first[1]}   # the member opened to trace with, run by its group
            del first
            for indices in groups.values():
                # A function, so that the group's runs and states are released when it returns.
                run_group([(i, handed.pop(i) if i in handed else open_member(i)) for i in indices], keys)
                gc.collect()   # a finished run's objects hold each other (cycles): free its device arrays now
        else:
            keys, why = list(previous.get("traced_keys", [])), dict(previous.get("own_program_keys", {}))
        ordered = [results.get(i) for i in range(len(members))]
        record = _record(config, axes, seeds, members, ordered, diverged, select, mode, keys, why,
                         programs or previous.get("programs", []), time.perf_counter() - t_start)
        if previous and _without_time(record) == _without_time(previous):
            record = previous   # nothing ran and nothing changed: the files stay as they are, byte for byte
        if out is not None:
            for name, text in (("sweep.json", json.dumps(record, indent=2, allow_nan=False) + "\n"),
                               ("sweep.md", format_table(record))):
                path = out / name
                if not path.exists() or path.read_text() != text:
                    path.write_text(text)
        return SweepResult(members, ordered, record["points"], record["best"], record)


def _name(member: Member) -> str:
    return f"{point_label(member.point)}/seed{member.seed}"


def _without_time(record: dict) -> dict:
    """The record as JSON holds it, less the session's seconds (which change on every resume) and the
    folder it was written to (a sweep moved elsewhere and resumed is the same sweep)."""
    plain = {k: v for k, v in json.loads(json.dumps(record)).items() if k != "seconds_this_session"}
    plain["config"] = {k: v for k, v in plain.get("config", {}).items() if k != "out"}
    return plain


def _finished_without_checkpoint(config: RunConfig, out: Path) -> RunResult | None:
    """A member folder holding a finished run whose checkpoints were deleted (to save space, as the
    recorded results do) is that member's result: kept, never rerun over. Its recorded configuration
    must be the member's (else the sweep is refused in one line); a folder without a complete run
    (no summary.json, or fewer rounds) returns None and the member starts."""
    summary_path, config_path = out / "summary.json", out / "config.json"
    if not (summary_path.exists() and config_path.exists()):
        return None
    try:
        summary = json.loads(summary_path.read_text())
        recorded = RunConfig.from_json(json.loads(config_path.read_text())["config"])
    except (ValueError, TypeError, KeyError) as e:
        raise RunError(f"{out} holds a run whose summary.json or config.json cannot be read ({e}); move the folder "
                       f"away or pass {arg('overwrite')} to rerun the member") from None
    rows = read_metrics(out)
    if not rows or int(rows[-1].get("round", 0)) < config.rounds:
        return None
    resumed_config(config, recorded, None)   # a different experiment in the member's folder: refused in one line
    return RunResult(summary, None, None, rows, recorded)


def resume_plan(config: RunConfig, axes: dict[str, list] | None, seeds: list[int] | None, select: str | None,
                record: dict, given: set[str] | None, out: Path) -> tuple[RunConfig, dict, list[int], str, str | None]:
    """What resuming the sweep recorded in ``out`` (``record``: its sweep.json) runs: (config, axes,
    seeds, select, notice or None), by the rule of docs/sweeps.md, "Resuming and extending a sweep":
    the recorded configuration, grid, seeds and select, extended by new values and seeds; any other
    difference is refused in one RunError listing them. ``given``: the fields the user set (None: every
    field). ``notice``: one line naming the new points and seeds when the sweep grows."""
    recorded = RunConfig.from_json(record["config"])
    old_axes: dict[str, list] = {k: list(v) for k, v in record["axes"].items()}
    old_seeds = [int(s) for s in record["seeds"]]
    problems = []
    if axes is not None and set(axes) != set(old_axes):
        problems.append(f"swept keys {sorted(axes)} (recorded: {sorted(old_axes)})")
    swept = set(old_axes) | set(axes or {})
    # The configuration: the recorded one; what the user set must agree with it (swept keys and the seed aside).
    fields = [f.name for f in dataclasses.fields(RunConfig) if f.name not in ("execution", "seed", *swept)]
    asked = [f for f in fields if (given is None or f in given) and f not in RESUMABLE_CHANGES]
    for name, key, mine, theirs in differing_settings(config, recorded, asked, skip=swept):
        value = mine if key is None else {key: mine}
        shown = f"{name}={value!r}" if in_python() else f"{flag_of(name)} {value!r}"
        problems.append(f"{shown} (recorded: {theirs!r})")
    if problems:
        raise RunError(f"{out} holds a sweep that {arg('resume')} can only continue or extend (more values of its "
                       f"swept keys, more seeds), but this would change it: {'; '.join(problems)}; run it in a new "
                       f"{arg('out')}, or replace it with {arg('overwrite')} (without {arg('resume')})")
    # Swept fields and the seed take the recorded base values; the rest is runner.resumed_config's merge.
    clean = dataclasses.replace(
        config, seed=recorded.seed, **{k: getattr(recorded, k) for k in swept if "." not in k},
        options={k: v for k, v in config.options.items() if f"option.{k}" not in swept},
        model_options={k: v for k, v in config.model_options.items() if f"model_option.{k}" not in swept})
    merged, _ = resumed_config(clean, recorded, None if given is None else given - {"seed"} - swept)
    new_axes = old_axes
    if axes is not None:
        # A value is a recorded one when it makes the same folder name (``1`` and ``1.0`` do not).
        new_axes = {k: v + [x for x in axes[k] if str(x) not in map(str, v)] for k, v in old_axes.items()}
    new_seeds = old_seeds + [s for s in (seeds or []) if s not in old_seeds]
    old_points = {point_label(p) for p in grid(old_axes)}
    added = [point_label(p) for p in grid(new_axes) if point_label(p) not in old_points]
    notice = None
    if added or len(new_seeds) > len(old_seeds):
        what = []
        if added:
            what.append(f"{len(added)} new point{'s' * (len(added) != 1)} ({', '.join(added)})")
        if len(new_seeds) > len(old_seeds):
            what.append(f"new seeds {new_seeds[len(old_seeds):]} for every point")
        notice = (f"notice: extending the sweep in {out}: {' and '.join(what)}; {len(old_points)} recorded "
                  f"point{'s' * (len(old_points) != 1)} x seeds {old_seeds} kept")
    return merged, new_axes, new_seeds, select or record.get("select", "best_accuracy"), notice


def _read_record(out: Path) -> dict:
    path = out / "sweep.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise RunError(f"{path} is damaged; delete it to resume the sweep's members from their own folders") from None


# ------------------------------------------------------------------ the table
def parse_select(select: str) -> tuple[str, float | None]:
    """``best_accuracy`` | ``final_accuracy`` | ``accuracy_at_gbit:X`` (the best accuracy evaluated
    within X Gbit of communication)."""
    key, _, budget = select.partition(":")
    if key in SELECT_KEYS and not budget:
        return key, None
    if key == "accuracy_at_gbit" and budget:
        try:
            return key, float(budget)
        except ValueError:
            pass
    raise RunError(f"unknown {arg('sweep_select', select, quote=True)}; valid: best_accuracy, final_accuracy, "
                   "accuracy_at_gbit:X")


def _accuracy_at_gbit(out: Path | None, budget: float) -> float | None:
    if out is None or not (out / "metrics.jsonl").exists():
        return None
    within = [r["accuracy"] for r in read_metrics(out) if r.get("accuracy") is not None
              and r.get("total_uplink_bits") is not None and r.get("total_downlink_bits") is not None
              and (r["total_uplink_bits"] + r["total_downlink_bits"]) / 1e9 <= budget]
    return max(within) if within else None


def _mean_std(values: list) -> tuple[float | None, float | None]:
    known = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not known:
        return None, None
    return float(np.mean(known)), (float(np.std(known, ddof=1)) if len(known) > 1 else None)


def _record(config, axes, seeds, members, results, diverged, select, mode, keys, why, programs, seconds) -> dict:
    key, budget = parse_select(select)
    points = []
    for point in grid(axes):
        label = point_label(point)
        mine = [(m, r) for m, r in zip(members, results) if m.point == point]
        summaries = [r.summary if r is not None else None for _, r in mine]
        ok = [s for s in summaries if s is not None]

        row: dict[str, Any] = {"point": label, "values": dict(point), "seeds": [m.seed for m, _ in mine],
                               "finished": len(ok), "diverged": [m.seed for m, _ in mine if _name(m) in diverged]}
        for name, source, scale in (("final_accuracy", "final_accuracy", 1.0), ("best_accuracy", "best_accuracy", 1.0),
                                    ("gbit", "total_gbit", 1.0), ("tflops", "total_flops", 1e-12),
                                    ("density", "final_density", 1.0)):
            row[name], row[f"{name}_std"] = _mean_std([None if s.get(source) is None else s[source] * scale
                                                       for s in ok])
        if budget is not None:
            row[select], row[f"{select}_std"] = _mean_std(
                [_accuracy_at_gbit(Path(m.config.out) if m.config.out else None, budget) for m, r in mine
                 if r is not None])
        points.append(row)
    score = select if budget is not None else key
    ranked = [p for p in points if p.get(score) is not None]
    best = max(ranked, key=lambda p: p[score]) if ranked else None
    return {"config": config.to_json(),
            "algorithm": config.algorithm, "dataset": config.dataset, "rounds": config.rounds,
            "axes": axes, "seeds": list(seeds), "select": select,
            "best": None if best is None else {"point": best["point"], "values": best["values"], select: best[score]},
            "points": points, "diverged": diverged, "parallelism": mode,
            "traced_keys": keys, "own_program_keys": why, "programs": programs,
            "members": [_name(m) for m in members], "seconds_this_session": seconds}


def _fmt(mean, std, scale=100.0, digits=2, unit="%") -> str:
    if mean is None:
        return "n/a"
    text = f"{mean * scale:.{digits}f}"
    return text + (f" ± {std * scale:.{digits}f}" if std is not None else "") + unit


def format_table(record: dict) -> str:
    """The sweep's markdown table: mean ± sample std over seeds per grid point."""
    select = record["select"]
    extra = [select] if select.startswith("accuracy_at_gbit") else []
    head = ["point", "seeds ok", "final accuracy", "best accuracy", *extra, "Gbit", "TFLOPs", "density"]
    lines = [f"Sweep of {record['algorithm']} on {record['dataset']}, {record['rounds']} rounds, seeds "
             f"{record['seeds']} (mean ± sample std over seeds).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in record["points"]:
        cells = [p["point"], f"{p['finished']}/{len(p['seeds'])}"
                 + (f" (diverged: {p['diverged']})" if p["diverged"] else ""),
                 _fmt(p["final_accuracy"], p["final_accuracy_std"]), _fmt(p["best_accuracy"], p["best_accuracy_std"]),
                 *[_fmt(p.get(k), p.get(f"{k}_std")) for k in extra],
                 _fmt(p["gbit"], p["gbit_std"], 1.0, 4, ""), _fmt(p["tflops"], p["tflops_std"], 1.0, 3, ""),
                 _fmt(p["density"], p["density_std"], 1.0, 3, "")]
        lines.append("| " + " | ".join(cells) + " |")
    best = record["best"]
    lines += ["", f"Best by {select}: " + ("n/a" if best is None else f"{best['point']} ({100 * best[select]:.2f}%)")]
    if record.get("own_program_keys"):
        lines += ["", "Keys with a program per value: " + "; ".join(
            f"{k} ({v})" for k, v in record["own_program_keys"].items())]
    return "\n".join(lines) + "\n"


def is_sweep(path: str | Path) -> bool:
    return (Path(path) / "sweep.json").is_file()


def load_sweep(path: str | Path) -> dict:
    return json.loads((Path(path) / "sweep.json").read_text())


def member_dirs(path: str | Path, record: dict | None = None) -> dict[str, list[Path]]:
    """{point label: [its seeds' run folders that have metrics]}."""
    record = record or load_sweep(path)
    by_point: dict[str, list[Path]] = {}
    for name in record["members"]:
        label, _, _ = name.rpartition("/")
        folder = Path(path) / name
        if (folder / "metrics.jsonl").exists():
            by_point.setdefault(label, []).append(folder)
    return by_point
