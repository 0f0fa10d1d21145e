"""How fast a configuration runs here: ``python -m fedjax_sparse bench`` and :func:`bench`.

How each variant is built and timed, what the table's columns and the JSON hold: docs/performance.md,
"Benchmark your configuration". Variants run one after another in this process; ``xla_flags`` variants
(and every variant with ``isolate=True``) run in child processes (``python -m fedjax_sparse bench ...
--json FILE`` with ``XLA_FLAGS`` extended), because XLA reads its flags once, when the backend starts.

A variant's record (:func:`time_variant`), beyond what the docs say: ``client_steps_executed_per_second``
counts what the client schedule ran (``vmap`` pads every client to the longest); ``tflops`` (10^12 FLOP/s
of the rounds' ``flops`` metric) is null when the algorithm counts no FLOPs, and ``tflops_share_of_matmul``
reads it against the matmul at the variant's precision (timed after the variants, its buffers out of their
memory peaks); ``compile_seconds`` = ``first_round_seconds`` less the median round;
``memory_estimate_device_mib`` is ``fedjax_sparse.core.memory``'s estimate (a configuration that does not
fit is refused in one line, as ``run`` refuses it); ``metrics``: every round's engine metrics, the
compiling round first; with ``count_kernels``, ``local_step`` (:func:`local_step_counts`; null where the
round has no local-step loop or lives in host memory).

The persistent compilation cache stays off unless asked for (``--compile-cache DIR``), so compile
times are cold; ``device.compilation_cache`` records the folder JAX used, if any.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core import memory
from fedjax_sparse.tools import programs, timing
from fedjax_sparse.driver import population as host_population
from fedjax_sparse.driver.config import (EXECUTION_FIELDS, OPTION_PREFIXES, RunConfig, model_name, parse_overrides,
                                         typed_axes, with_overrides)
from fedjax_sparse.errors import RunError, arg
from fedjax_sparse.driver.experiment import Checked, Components, Experiment, build, check, with_components
from fedjax_sparse.driver.progress import jsonable
from fedjax_sparse.driver.sweeps import grid

SCHEMA = "fedjax_sparse.tools.bench/1"
PRECISION_KEY = "matmul_precision"
XLA_FLAGS_KEY = "xla_flags"
# jax.default_matmul_precision's names (JAX's fp8 modes left out: they are not float32 programs).
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
NO_XLA_FLAGS = "none"   # the xla_flags value that adds no flag (the baseline)
# RunConfig fields that are not a variant: where files go, and the dicts compared key by key
# (option.NAME, model_option.NAME).
NOT_COMPARED = ("out", "options", "model_options", "dataset_options", "execution")
# The matmul read against: big enough to reach the device's float32 rate, small enough to take a
# second on two CPU cores (2048^3 x 2 = 17 GFLOP) and milliseconds on an H100 (8192^3 x 2 = 1.1 PFLOP).
MATMUL_SIZE_CPU = 2048
MATMUL_SIZE_ACCELERATOR = 8192


# ---------------------------------------------------------------------------- --compare
def parse_compare(specs: Sequence[str]) -> dict[str, list]:
    """``["client_parallelism=map,vmap", "xla_flags=none;--xla_foo=1"]`` -> ``{"client_parallelism":
    ["map", "vmap"], "xla_flags": ["", "--xla_foo=1"]}``: the grammar of every KEY=VALUE flag
    (``config.parse_overrides``; ``xla_flags``' values separated by ``;``, as XLA flags hold ``,`` and ``=``,
    ``none`` there meaning no added flag), values as text, typed by :func:`bench` for the configuration.
    One-line RunError for a malformed spec, an empty value, a key or value given twice."""
    axes = parse_overrides(specs, "--compare", lists=True)
    if XLA_FLAGS_KEY in axes:
        axes[XLA_FLAGS_KEY] = ["" if value == NO_XLA_FLAGS else value for value in axes[XLA_FLAGS_KEY]]
    return axes


def check_compare(axes: dict[str, list]) -> None:
    """One-line RunError for a key that names nothing a run has, an empty value list, or an unknown
    matmul precision (the values of other keys are checked with the variants' configurations)."""
    fields = [f.name for f in dataclasses.fields(RunConfig) if f.name not in NOT_COMPARED]
    for key, values in axes.items():
        if not values:
            raise RunError(f"--compare {key} has no values: write --compare {key}=V1,V2")
        prefix, dot, name = key.partition(".")
        if dot and prefix in OPTION_PREFIXES and name:
            continue
        if key == PRECISION_KEY:
            unknown = [v for v in values if v not in MATMUL_PRECISIONS]
            if unknown:
                raise RunError(f"--compare matmul_precision: unknown precision {unknown[0]!r}; valid: "
                               f"{', '.join(MATMUL_PRECISIONS)}")
            continue
        if key == XLA_FLAGS_KEY or key in EXECUTION_FIELDS or key in fields:
            continue
        raise RunError(f"unknown --compare key {key!r}; compare a RunConfig field ({', '.join(fields[:6])}, ...), "
                       f"an execution field ({', '.join(EXECUTION_FIELDS[:3])}, ...), option.NAME, "
                       f"model_option.NAME, dataset_option.NAME, {PRECISION_KEY} or {XLA_FLAGS_KEY}")


def variant_name(point: tuple) -> str:
    """``client_parallelism=map model_option.conv_impl=xla`` (``configuration`` for no variant)."""
    if not point:
        return "configuration"
    return " ".join(f"{key}={NO_XLA_FLAGS if key == XLA_FLAGS_KEY and value == '' else value}"
                    for key, value in point)


def variant_config(config: RunConfig, point: tuple, parts: Components) -> Checked:
    """``config`` with the variant's values (``matmul_precision`` and ``xla_flags`` are not
    configuration: they are how the process runs it), type-checked and validated as ``run`` would,
    once (``build`` takes the result unchecked); a bad value is a one-line RunError naming the
    ``--compare`` value. ``parts``: the objects given in place of names."""
    settings = tuple((key, value) for key, value in point if key not in (PRECISION_KEY, XLA_FLAGS_KEY))
    try:
        out = RunConfig.from_json(with_overrides(config, settings).to_json())   # type-checked as a config file
        return check(*with_components(out, parts.model, parts.data, parts.algorithm))
    except RunError as e:
        raise RunError(f"--compare {variant_name(point)}: {e}") from None


# ---------------------------------------------------------------------------- timing one variant
def _matmul_precision(precision: str | None):
    """``jax.default_matmul_precision`` around tracing and running (None: as the process has it).
    The setting is part of jit's cache key, so each precision compiles its own program."""
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def matmul_tflops(size: int, precision: str | None = None, repeats: int = 5) -> float:
    """10^12 FLOP/s of a float32 [size, size] @ [size, size] under ``precision``, best of
    ``repeats`` after a compiling call (``timing.matmul_gflops``)."""
    with _matmul_precision(precision):
        return timing.matmul_gflops(size, repeats) / 1e3


def _round_advancer(exp: Experiment, engine, state, population) -> Callable:
    """state -> (state, host metrics of one round), through the program a run uses for this
    configuration: the engine's scan (here one round long), or the host population's chunks."""
    if population is None:
        return lambda s: engine.advance(s, exp.data, 1)
    chunk = exp.config.execution.host_chunk_rounds
    return lambda s: host_population.advance(engine, s, population, exp.data, 1, chunk)


def _initial_state(exp: Experiment):
    """(state, host population or None), as ``run`` starts them."""
    config, engine = exp.config, exp.engine
    if config.execution.client_state != "host":
        return engine.init(jax.random.PRNGKey(config.seed)), None
    return host_population.init_for_run(engine, config.seed, config.execution.client_storage, config.algorithm)


def _per_second(total, seconds: float) -> float | None:
    return None if total is None else float(total) / seconds


def build_variant(checked: Checked) -> tuple[Experiment, float]:
    """(the variant's experiment, seconds to build it), from its :func:`variant_config`."""
    t0 = time.perf_counter()
    exp = build(checked)
    return exp, time.perf_counter() - t0


def check_models(exp: Experiment, configs: Sequence[RunConfig], points: Sequence[tuple]) -> None:
    """Builds every variant's model for ``exp``'s data and traces its forward pass on shapes alone
    (nothing compiled or run), so that a bad ``model_option`` value (one the model only reads when
    it runs, e.g. ``conv_impl``) is refused in one line before any variant is timed."""
    from fedjax_sparse.models import make_model
    for config, point in zip(configs, points):
        if config.dataset != exp.config.dataset:
            continue   # other data: checked when that variant is built
        try:
            model = make_model(model_name(config), exp.data.input_shape, exp.data.num_classes, **config.model_options)
            x = jax.ShapeDtypeStruct((1, *exp.data.input_shape), jnp.float32)
            jax.eval_shape(lambda x, model=model: model.apply(model.init(jax.random.PRNGKey(0)), x), x)
        except (ValueError, TypeError, ImportError, AttributeError) as e:
            raise RunError(f"--compare {variant_name(point)}: {e}") from None


def local_step_counts(engine, state, data) -> dict | None:
    """What one iteration of the local-step loop runs in the round program compiled for this device
    (``programs.loop_op_counts``): ``kernels`` launched at its top level (on a GPU each is at least one
    launch per step), ``loops_inside`` it, ``ops`` by opcode, ``grouped_convolutions``: the instructions
    of the whole round with a group count above 1; and :func:`step_cost`'s keys. None where the round
    has no such loop. Compiles the round once more (outside any timing)."""
    compiled = jax.jit(lambda s, d: engine.round_step(s, d)).lower(state, data).compile().as_text() or ""
    loops = [loop for loop in programs.loop_op_counts(compiled) if loop["in_scope"]]
    if not loops:
        return None
    step = loops[0]
    return {"kernels": step["kernels"], "loops_inside": step["ops"].get("while", 0), "ops": step["ops"],
            # anywhere in the round: a grouped convolution is a per-client kernel a GPU runs group by group
            "grouped_convolutions": len(programs.compiled_grouped_convolutions(compiled)),
            **step_cost(engine, state, data)}


def step_cost(engine, state, data, rounds: int = 50) -> dict:
    """One local step's cost (``programs.local_step_cost``: FLOPs and bytes accessed per platform, for
    the clients that step in lockstep and per client-step) and the schedule's padding: executed /
    useful client-steps over the cohorts of ``rounds`` rounds from ``state``'s key."""
    from fedjax_sparse.core.engine import executed_client_steps
    lockstep = {"vmap": engine.cohort_capacity, "packed": engine.pack_width}.get(engine.mode, 1)
    cost = programs.local_step_cost(lambda s, d: engine.round_step(s, d), state, data)
    per_client = {platform: None if costs is None else
                  {key: value / lockstep for key, value in costs.items() if key != "compiled"}
                  for platform, costs in cost.items()}
    padding = None
    if engine.local_epochs is not None and engine.batch_size is not None and not engine.poisson:
        cohorts = engine.cohorts(state.key, int(state.round), rounds)
        steps = engine.local_epochs * -(-np.asarray(data.train_count)[cohorts] // engine.batch_size)
        useful = int(steps.sum())
        executed = sum(int(executed_client_steps(jnp.asarray(row), engine.mode, engine.pack_width)) for row in steps)
        padding = {"rounds": rounds, "useful_client_steps": useful, "executed_client_steps": executed,
                   "executed_per_useful": executed / max(useful, 1)}
    return {"lockstep_clients": lockstep, "cost": cost, "cost_per_client_step": per_client, "padding": padding}


def time_variant(checked: Checked, point: tuple, rounds_timed: int,
                 note: Callable[[str], None] = lambda text: None, built: tuple | None = None,
                 count_kernels: bool = False) -> dict:
    """Builds ``checked`` (one variant's :func:`variant_config`; ``built``: its :func:`build_variant`
    already), runs the compiling round and times ``rounds_timed`` rounds, each synchronised. Returns
    the variant's record (``matmul_tflops`` and the share are added by :func:`bench`): its ``name`` and
    ``values``, the rounds' seconds (``round_seconds`` [R], the median ``seconds_per_round``, min, max and
    quartiles), rates, compile and build seconds, memory peaks and estimate, ``process``, ``metrics``."""
    config = checked.config
    precision = dict(point).get(PRECISION_KEY)
    if built is None:
        note("building ...")
        built = build_variant(checked)
    exp, build_seconds = built
    estimate = memory.estimate(exp)
    memory.check_fits(estimate, config)   # refused in one line, as run refuses it
    measured = None
    with _matmul_precision(precision):
        state, population = _initial_state(exp)
        engine = exp.engine
        if config.execution.client_parallelism == "measure":
            from fedjax_sparse.driver import runner
            mode, measured = runner.measure_client_parallelism(engine, state, exp.data)
            engine = dataclasses.replace(engine, client_parallelism=mode)
        advance = _round_advancer(exp, engine, state, population)
        rounds: list[dict] = []   # every round's host metrics

        def timed_round() -> float:
            nonlocal state
            t = time.perf_counter()
            state, round_metrics = advance(state)
            jax.block_until_ready(state)   # the metrics are on the host already; the state may still run
            rounds.append(round_metrics)
            return time.perf_counter() - t
        note(f"compiling and running round 1 ({engine.mode}) ...")
        first_seconds = timed_round()
        note(f"timing {rounds_timed} rounds ...")
        seconds = [timed_round() for _ in range(rounds_timed)]
        local_step = None
        if count_kernels and population is None:
            note("counting the kernels of a local step ...")
            local_step = local_step_counts(engine, state, exp.data)
    metrics = {key: np.concatenate([np.asarray(m[key]) for m in rounds]) for key in rounds[0]}
    timed = {key: values[1:] for key, values in metrics.items()}   # the compiling round left out
    total_seconds = float(sum(seconds))
    q1, median, q3 = (float(q) for q in np.percentile(seconds, [25, 50, 75]))
    # Costs an algorithm does not count stay unknown (null), never 0.
    # Exact: Python ints of an int64 or object array (a float of float64).
    flops = sum(np.asarray(timed["flops"]).tolist()) if "flops" in timed else None
    steps = int(timed["client_steps"].sum()) if "client_steps" in timed else None
    executed = int(timed["client_steps_executed"].sum()) if "client_steps_executed" in timed else None
    record = {
        "name": variant_name(point), "values": dict(point),
        "algorithm": config.algorithm, "model": exp.model.name, "num_params": int(exp.model.num_params),
        "forward_macs_per_example": int(exp.model.forward_macs),
        "clients_per_round": engine.clients_per_round, "client_parallelism": engine.mode,
        **({"client_parallelism_measured": measured} if measured is not None else {}),
        "matmul_precision": precision or "default",
        "build_seconds": build_seconds,
        "first_round_seconds": first_seconds,
        "compile_seconds": max(first_seconds - median, 0.0),
        "rounds_timed": rounds_timed, "round_seconds": seconds, "timed_seconds": total_seconds,
        "seconds_per_round": median, "seconds_per_round_min": float(min(seconds)),
        "seconds_per_round_max": float(max(seconds)), "seconds_per_round_q1": q1, "seconds_per_round_q3": q3,
        "rounds_per_second": rounds_timed / total_seconds,
        "total_client_steps": steps, "client_steps_per_second": _per_second(steps, total_seconds),
        "total_client_steps_executed": executed,
        "client_steps_executed_per_second": _per_second(executed, total_seconds),
        "total_flops": flops,
        "tflops": None if flops is None else float(flops) / total_seconds / 1e12,
        "peak_device_memory_mib": timing.device_peak_memory_mib(),
        "peak_host_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "memory_estimate_device_mib": estimate.device_total_bytes / 2 ** 20,
        "process": {"xla_flags": os.environ.get("XLA_FLAGS", ""), "isolated": False},
        **({"local_step": local_step} if count_kernels else {}),
        "metrics": {key: values.tolist() for key, values in metrics.items()},
    }
    return jsonable(record)


# ---------------------------------------------------------------------------- the whole benchmark
def device_facts() -> dict:
    """The device and software the timings belong to."""
    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind, "device_count": len(devices),
            "jax": jax.__version__, "software": timing.software_facts(),
            "compilation_cache": getattr(jax.config, "jax_compilation_cache_dir", None),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "machine": timing.machine_facts()}


def bench(config: RunConfig, compare: dict[str, list] | None = None, *, rounds_timed: int = 5,
          matmul_size: int | None = None, isolate: bool = False, progress: bool = False,
          count_kernels: bool = False, model=None, data=None, algorithm=None) -> dict:
    """Times the rounds of ``config`` and of its variants, side by side.

    Args:
      config: the configuration ``run`` would train (its ``rounds``, ``eval_every`` and ``out`` play no part).
      compare: ``{key: [values]}`` (:func:`parse_compare` reads the CLI's specs); the variants are the
        cartesian product. Keys: a RunConfig field, an execution field, ``option.NAME``,
        ``model_option.NAME``, ``matmul_precision`` (``jax.default_matmul_precision`` around the
        variant) and ``xla_flags`` (strings appended to ``XLA_FLAGS``, ``""`` for none; child processes).
      rounds_timed: R, the rounds timed one by one after the compiling round.
      matmul_size: N of the float32 N x N matmul read against (default 2048 on CPU, 8192 elsewhere).
      isolate: every variant in a child process of its own (cold compilation, its own memory peaks).
      progress: one line per step on stderr.
      count_kernels: add each variant's ``local_step`` (the kernels one local step launches in the
        compiled round program; compiles the round once more, outside the timings).
      model, data, algorithm: objects replacing the config's names, as in ``fjs.build`` (in-process
        variants only).

    Returns:
      ``{"schema": SCHEMA, "date", "config": config.json's flat fields, "compare": {key: [values]},
      "rounds_timed": R, "device": {"backend", "device_kind", "device_count", "jax",
      "compilation_cache", "xla_flags", "machine"}, "matmul": {"size": N, "dtype": "float32",
      "tflops": {precision: 10^12 FLOP/s}}, "variants": [record, ...], "fastest": the name of the
      variant with the lowest median seconds per round}``, a record per variant (:func:`time_variant`,
      the module docstring). JSON-ready (NaN and infinities as None).
    """
    if not isinstance(rounds_timed, int) or isinstance(rounds_timed, bool) or rounds_timed < 1:
        raise RunError(f"--rounds-timed must be a positive integer, got {rounds_timed!r}")
    if matmul_size is not None and (not isinstance(matmul_size, int) or matmul_size < 1):
        raise RunError(f"--matmul-size must be a positive integer, got {matmul_size!r}")
    axes = dict(compare or {})
    check_compare(axes)
    config, parts = with_components(config, model, data, algorithm)
    # Text values typed for the configuration (matmul precisions and XLA flags are text, not configuration).
    process = {key: axes[key] for key in (PRECISION_KEY, XLA_FLAGS_KEY) if key in axes}
    axes = {**typed_axes(config, {k: v for k, v in axes.items() if k not in process}, "compare"), **process}
    points = grid(axes)
    checked = [variant_config(config, point, parts) for point in points]   # all checked first, once each
    configs = [c.config for c in checked]
    for variant in configs:
        if variant.cohort_schedule and variant.rounds < 1 + rounds_timed:
            raise RunError(f"{arg('cohort_schedule')} pins the cohorts of {variant.rounds} rounds, but bench runs "
                           f"1 + --rounds-timed {rounds_timed}: lower --rounds-timed or raise {arg('rounds')}")
    header = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": config.to_json(),
              "compare": axes, "rounds_timed": rounds_timed}
    if isolate or XLA_FLAGS_KEY in axes:
        if parts.given():
            raise RunError("xla_flags and --isolate variants run in child processes, which build from the "
                           "configuration's names: give the model, data and algorithm by name")
        return jsonable({**header, **_bench_in_children(config, axes, rounds_timed, matmul_size, isolate,
                                                        progress, count_kernels)})
    note = _printer(progress)
    variants = []
    for i, (point, one) in enumerate(zip(points, checked)):
        name = variant_name(point)
        say = lambda text, i=i, name=name: note(f"[{i + 1}/{len(points)}] {name}: {text}")  # noqa: E731
        try:
            built = None
            if i == 0:
                say("building ...")
                built = build_variant(one)
                if parts.model is None:
                    check_models(built[0], configs, points)
            variants.append(time_variant(one, point, rounds_timed, note=say, built=built,
                                         count_kernels=count_kernels))
        except RunError as e:   # say which variant met it (one line still)
            if not point or str(e).startswith("--compare "):
                raise
            raise RunError(f"variant {name}: {e}") from None
        say(f"{variants[-1]['seconds_per_round']:.4g} s per round")
        # A built experiment's objects form reference cycles that hold its device arrays until a
        # collection: free them before the next variant allocates its own.
        gc.collect()
    # The matmul after the variants: its buffers (768 MiB at 8192) stay out of their memory peaks.
    size = matmul_size or (MATMUL_SIZE_CPU if jax.default_backend() == "cpu" else MATMUL_SIZE_ACCELERATOR)
    note(f"timing a float32 {size} x {size} matmul ...")
    rates = {p: matmul_tflops(size, None if p == "default" else p)
             for p in dict.fromkeys(v["matmul_precision"] for v in variants)}
    for record in variants:
        record["matmul_tflops"] = rates[record["matmul_precision"]]
        record["tflops_share_of_matmul"] = (None if record["tflops"] is None
                                            else record["tflops"] / record["matmul_tflops"])
    return jsonable({**header, "device": device_facts(),
                     "matmul": {"size": size, "dtype": "float32", "tflops": rates},
                     "variants": variants, "fastest": fastest(variants)})


def fastest(variants: Sequence[dict]) -> str | None:
    """The name of the variant with the lowest median seconds per round."""
    timed = [v for v in variants if v.get("seconds_per_round") is not None]
    return min(timed, key=lambda v: v["seconds_per_round"])["name"] if timed else None


def _printer(enabled: bool) -> Callable[[str], None]:
    return (lambda text: print(text, file=sys.stderr, flush=True)) if enabled else (lambda text: None)


# ---------------------------------------------------------------------------- child processes
def compare_spec(key: str, values: Sequence) -> str:
    """The --compare spec of ``values`` (as :func:`parse_compare` reads it back)."""
    def text(value):
        if key == XLA_FLAGS_KEY:
            return value or NO_XLA_FLAGS
        return "none" if value is None else json.dumps(value) if isinstance(value, bool) else str(value)
    return f"{key}={(';' if key == XLA_FLAGS_KEY else ',').join(text(v) for v in values)}"


def child_command(config_file: str, axes: dict[str, list], rounds_timed: int, matmul_size: int | None,
                  out: str, quiet: bool = True, count_kernels: bool = False) -> list[str]:
    """``python -m fedjax_sparse bench --config FILE --compare ... --json OUT [--quiet]`` for one child."""
    command = [sys.executable, "-m", "fedjax_sparse", "bench", "--config", config_file,
               "--rounds-timed", str(rounds_timed), "--json", out] + (["--quiet"] if quiet else [])
    if matmul_size:
        command += ["--matmul-size", str(matmul_size)]
    if count_kernels:
        command.append("--count-kernels")
    for key, values in axes.items():
        command += ["--compare", compare_spec(key, values)]
    return command


def _bench_in_children(config: RunConfig, axes: dict[str, list], rounds_timed: int, matmul_size: int | None,
                       isolate: bool, progress: bool, count_kernels: bool = False) -> dict:
    """Runs the variants in child processes: one per ``xla_flags`` value (the other keys' variants
    side by side inside it), or one per variant with ``isolate``. This process starts no backend
    (on a GPU it would hold the memory the children need). Returns the merged result's body."""
    flag_values = axes.get(XLA_FLAGS_KEY, [""])
    inner = {k: v for k, v in axes.items() if k != XLA_FLAGS_KEY}
    # (XLA flags, the child's --compare axes, the child's label as a point)
    jobs: list[tuple[str, dict, tuple]] = []
    for flags in flag_values:
        flag_point = ((XLA_FLAGS_KEY, flags),) if XLA_FLAGS_KEY in axes else ()
        if isolate:
            jobs += [(flags, {k: [v] for k, v in point}, flag_point + point) for point in grid(inner)]
        else:
            jobs.append((flags, inner, flag_point))
    note = _printer(progress)
    variants: list[dict] = []
    first: dict = {}
    base_flags = os.environ.get("XLA_FLAGS", "")
    with tempfile.TemporaryDirectory(prefix="fedjax_sparse_bench_") as tmp:
        config_file = str(Path(tmp) / "config.json")
        Path(config_file).write_text(json.dumps(dict(config.to_json(), out=None)))
        for i, (flags, job_axes, label) in enumerate(jobs):
            out = str(Path(tmp) / f"child{i}.json")
            command = child_command(config_file, job_axes, rounds_timed, matmul_size, out, quiet=not progress,
                                    count_kernels=count_kernels)
            env = dict(os.environ, XLA_FLAGS=" ".join(f for f in (base_flags, flags) if f))
            note(f"[process {i + 1}/{len(jobs)}] {variant_name(label)}: XLA_FLAGS={env['XLA_FLAGS']!r} "
                 f"{shlex.join(command[1:])}")
            _run_child(command, env, variant_name(label), note)
            child = json.loads(Path(out).read_text())
            first = first or child
            for record in child["variants"]:
                # The variant's values in --compare's order, its XLA flags among them.
                point = tuple((k, flags if k == XLA_FLAGS_KEY else record["values"][k]) for k in axes)
                record.update(values=dict(point), name=variant_name(point),
                              process={"xla_flags": env["XLA_FLAGS"], "isolated": isolate, "device": child["device"]})
                variants.append(record)
    # Order as grid(axes) lists the variants (the first key slowest).
    order = {variant_name(point): i for i, point in enumerate(grid(axes))}
    variants.sort(key=lambda v: order.get(v["name"], len(order)))
    # Each process timed its own matmul (XLA flags may change it): every record holds its own rate.
    return {"device": first["device"], "matmul": {**first["matmul"], "per_process": True}, "variants": variants,
            "fastest": fastest(variants)}


def _run_child(command: list[str], env: dict, label: str, note: Callable[[str], None]) -> None:
    """Runs one child, its stderr passed on as progress; a failure is a one-line RunError with the
    child's own ``error:`` line."""
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as child:
        assert child.stderr is not None
        last = ""
        for line in child.stderr:
            line = line.rstrip()
            if line:
                last = line
                note(f"  {line}")
        code = child.wait()
    if code != 0:
        reason = last[len("error: "):] if last.startswith("error: ") else f"exit code {code}: {last}"
        raise RunError(f"variant {label} (child process): {reason}")


# ---------------------------------------------------------------------------- reading the result
def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if abs(value) >= 10 ** digits:   # no exponent for large counts: 2210, not 2.21e+03
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def format_table(result: dict) -> str:
    """The side-by-side table (one row per variant) and the device line."""
    device, matmul = result["device"], result["matmul"]
    columns = ["variant", "s/round (median)", "min-max", "rounds/s", "client steps/s", "TFLOP/s", "of matmul",
               "compile s", "peak dev MiB", "peak host MiB"]
    counted = any("local_step" in v for v in result["variants"])
    if counted:
        columns += ["kernels/step", "MB/client-step (cuda)", "executed/useful"]
    rows = []
    for v in result["variants"]:
        share = v.get("tflops_share_of_matmul")
        rows.append([v["name"], _fmt(v["seconds_per_round"], 4),
                     f"{_fmt(v['seconds_per_round_min'])}-{_fmt(v['seconds_per_round_max'])}",
                     _fmt(v["rounds_per_second"]), _fmt(v["client_steps_per_second"]), _fmt(v["tflops"]),
                     "n/a" if share is None else f"{100 * share:.1f}%", _fmt(v["compile_seconds"]),
                     _fmt(v["peak_device_memory_mib"], 4), _fmt(v["peak_host_memory_mib"], 4)])
        if counted:
            step = v.get("local_step")
            rows[-1].append("n/a" if not step else str(step["kernels"]) +
                            (f" (+{step['loops_inside']} loops)" if step["loops_inside"] else ""))
            cuda = ((step or {}).get("cost_per_client_step") or {}).get("cuda")
            padding = (step or {}).get("padding")
            rows[-1] += ["n/a" if not cuda else _fmt(cuda["bytes_accessed"] / 1e6, 4),
                         "n/a" if not padding else f"{padding['executed_per_useful']:.2f}"]
    widths = [max(len(str(r[i])) for r in [columns] + rows) for i in range(len(columns))]
    line = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    rates = ", ".join(f"{p} {_fmt(t)}" for p, t in (matmul.get("tflops") or {}).items())
    where = " (first child process; each variant is read against its own process's)" if matmul.get("per_process") \
        else ""
    head = (f"{device['backend']} ({device['device_kind']} x {device['device_count']}), jax {device['jax']}; "
            f"float32 {matmul['size']}^2 matmul: {rates} TFLOP/s{where}; {result['rounds_timed']} rounds timed "
            "per variant")
    return "\n".join([head, line(columns), line(["-" * w for w in widths]), *map(line, rows),
                      f"fastest: {result['fastest']}"]) + "\n"


def _refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; choose another --json FILE or pass {arg('overwrite')}")


def check_json_writable(path: str | Path, overwrite: bool = False) -> None:
    """Refuses, before a benchmark spends its minutes, a ``--json`` path that :func:`write_json` could not
    write: an existing file (unless ``overwrite``), a folder, or a place where no file can be created
    (tried: the folders made and the temporary file written and removed)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--json {path} is a folder; give a file name, e.g. --json {path / 'bench.json'}")
    _refuse_existing(path, overwrite)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("")
        tmp.unlink()
    except OSError as e:
        raise ValueError(f"--json {path}: cannot write there ({e.strerror or type(e).__name__}); choose a writable "
                         "--json FILE") from None


def write_json(result: dict, path: str | Path, overwrite: bool = False) -> Path:
    """Writes ``result`` to ``path`` (atomically: a temporary file renamed). An existing file is
    refused unless ``overwrite``."""
    path = Path(path)
    _refuse_existing(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, allow_nan=False))
    os.replace(tmp, path)
    return path
