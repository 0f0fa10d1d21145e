"""Command line: ``python -m fedjax_sparse run|bench|partition|list|plot|report ...``.

User errors (bad names, sizes, paths, corrupt files, an occupied --out)
print one line ``error: ...`` naming the problem and the fix, and exit 2,
without a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from fedjax_sparse.driver.settings import GROUPS, RUN_FLAGS   # each setting's flag, type, help and group

# The settings' KEY=VALUE flags (one option dict each; their keys' prefix: config.OPTION_PREFIXES).
OPTION_FLAGS = {flag: flag[2:].replace("-", "_") for flag, _, kind, *_ in RUN_FLAGS if kind is dict}
KEY_VALUE_FLAGS = (*OPTION_FLAGS, "--compare", "--change")
RUN_EXAMPLES = """examples:
  python -m fedjax_sparse run --algorithm fedavg --dataset digits --rounds 20 --out runs/fedavg
  python -m fedjax_sparse run --setting spafl_fmnist --data-dir ../shared/data --rounds 100 --out runs/spafl
  python -m fedjax_sparse run --algorithm spafl --dataset fashion_mnist --data-dir ../shared/data \\
      --option alpha=0.002 --lr 0.001 --out runs/spafl_fmnist
  python -m fedjax_sparse run --dataset digits --dp-clip 1.0 --dp-target-epsilon 8 --out runs/dp
  python -m fedjax_sparse run --dataset digits --sweep lr=0.01,0.1 --seeds 0 1 2 --out runs/lr_sweep
  python -m fedjax_sparse run --out runs/spafl --resume --rounds 500     # continue (or extend) a run
  python -m fedjax_sparse run --out runs/spafl --resume --change lr=0.0005  # continue with a lower lr
  python -m fedjax_sparse list       # algorithms, data sets, models, partitions"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fedjax_sparse",
                                     description="Sparse federated learning simulator (JAX).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a federated experiment", epilog=RUN_EXAMPLES,
                         usage="python -m fedjax_sparse run [FLAGS]   (by group below; examples at the end)",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = _add_config_arguments(run)
    groups["outputs"].add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    groups["outputs"].add_argument(
        "--change", action="append", metavar="KEY=VALUE",
        help="with --resume: continue from the checkpoint with another lr (--change lr=0.01) or algorithm option "
             "(--change option.alpha=0.01), e.g. after a divergence; recorded in config.json with the round, "
             "marked by report and plot (repeatable)")
    groups["outputs"].add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    groups["outputs"].add_argument("--quiet", action="store_true", help="no progress bar")
    groups["execution"].add_argument("--compile-cache", default=None, metavar="DIR|off",
                     help="folder of JAX's persistent compilation cache, so a rerun, a resume or another seed "
                          "of the same shapes skips compiling (default: $FEDJAX_SPARSE_COMPILE_CACHE, else "
                          "$XDG_CACHE_HOME/fedjax_sparse/jax, i.e. ~/.cache/...; 'off' disables it)")
    groups["execution"].add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="multi-process run (jax.distributed): address of process 0; with --num-processes and "
                          "--process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    groups["execution"].add_argument("--num-processes", type=int, default=None, metavar="N",
                     help="multi-process run: how many processes (one command per process, same flags)")
    groups["execution"].add_argument("--process-id", type=int, default=None, metavar="I",
                     help="multi-process run: this process's index, 0 .. N-1 (process 0 writes the files)")
    groups["seeds and sweeps"].add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED",
                     help="replicas: run the configuration once per seed in one process, each in OUT/seed<SEED>/ "
                          "(OUT/replicas.json: mean and std over seeds); replaces --seed")
    groups["seeds and sweeps"].add_argument("--replica-parallelism", default="auto",
                     help="--seeds and --sweep: auto (sequential on CPU, vmap elsewhere) | vmap (all members in one "
                          "program) | sequential (one member after another through one compiled program)")
    groups["seeds and sweeps"].add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2",
                     help="a grid (repeatable): KEY is lr, local_epochs, malicious_fraction (any RunConfig field), "
                          "option.NAME, model_option.NAME or dataset_option.NAME; every point runs every --seeds "
                          "seed, in "
                          "OUT/<point>/seed<SEED>/, with OUT/sweep.json and OUT/sweep.md (mean +- std over seeds)")
    groups["seeds and sweeps"].add_argument("--sweep-select", default=None, metavar="KEY",
                     help="--sweep: how the best point is chosen: best_accuracy (default; on --resume the recorded "
                          "one) | final_accuracy | accuracy_at_gbit:X (best accuracy within X Gbit)")

    part = sub.add_parser("partition", help="partition a dataset and write the partition report")
    part.add_argument("--dataset", required=True)
    part.add_argument("--data-dir")
    part.add_argument("--num-clients", type=int, default=100)
    part.add_argument("--partition", default="dirichlet:0.5")
    part.add_argument("--min-client-samples", type=int, default=1)
    part.add_argument("--seed", type=int, default=0)
    part.add_argument("--out", help="write OUT/partition.json (and print the table)")
    part.add_argument("--max-rows", type=int, default=20)

    sub.add_parser("list", help="list algorithms (with options), datasets, models, partitions")

    plot = sub.add_parser("plot", help="compare runs: accuracy vs round, Gbit and TFLOPs (and density) in one figure")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="directories written by run --out")
    plot.add_argument("--out", required=True, help="figure file (.png, .pdf, .svg)")
    plot.add_argument("--x", default=None, help="one panel: x key (round, gbit, tflops or any metrics.jsonl key)")
    plot.add_argument("--y", default=None, help="one panel: y key (accuracy, global_accuracy, density, loss, ...)")
    plot.add_argument("--title", default=None)

    report = sub.add_parser("report", help="markdown table of runs: final/best accuracy, Gbit, TFLOPs, rounds/s")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", default=None, help="also write the table to this file")

    _add_bench_arguments(sub.add_parser(
        "bench", help="how fast a configuration runs here: seconds per round, TFLOP/s, compile time, memory; "
                      "variants side by side (--compare)",
        description="Times the rounds of the configuration that `run` with the same flags would train "
                    "(replace `run` by `bench`), and of its variants (--compare), side by side in one process. "
                    "Writes nothing but --json FILE."))
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> dict:
    """The flags that make a run's configuration (``run`` and ``bench`` read them alike:
    :func:`config_from_args`), in their groups (settings.GROUPS, in order); returns {name: group}."""
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    groups["configuration"].add_argument("--config",
                                         help="JSON config file (RunConfig fields); flags given override it")
    groups["configuration"].add_argument(
        "--setting", metavar="NAME", help="a paper's experiment (fedjax_sparse/papers/settings.py: spafl_fmnist, "
        "feddrop_fmnist, fsl_mnist, their methods as spafl_fmnist_fedavg ...; `list` names all); --config "
        "and the flags given override its keys")
    from fedjax_sparse.driver.config import EXECUTION_FIELDS, RunConfig
    defaults = RunConfig()
    for flag, dest, kind, text, group in RUN_FLAGS:
        if kind is dict:   # KEY=VALUE, repeatable: typed by config.typed_value
            groups[group].add_argument(flag, action="append", metavar="KEY=VALUE", help=text)
        elif kind is bool:
            groups[group].add_argument(flag, action="store_true", default=None, help=text)
        else:
            if "default" not in text:
                # The flag's default is the RunConfig field's (argparse's own default stays None so that the
                # flags given can be told apart from a config file's values).
                default = getattr(defaults.execution if dest in EXECUTION_FIELDS else defaults, dest)
                text = f"{text} (default: {default})"
            groups[group].add_argument(flag, dest=dest, type=kind, default=None, help=text)
    return groups


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    """``bench``: run's configuration flags, run's other flags (so that a run command line is a bench
    command line: each is used, ignored or refused in one line by :func:`cmd_bench`), and its own."""
    _add_config_arguments(bench)
    bench.add_argument("--rounds-timed", type=int, default=5, metavar="N",
                       help="rounds timed one by one after the compiling round, per variant (default: 5)")
    bench.add_argument("--compare", action="append", default=None, metavar="KEY=V1,V2",
                       help="variants to time side by side (repeatable; the variants are every combination): KEY "
                            "is a RunConfig field (clients_per_round, batch_size, ...), an execution field "
                            "(client_parallelism, ...), option.NAME, dataset_option.NAME, model_option.NAME (e.g. "
                            "model_option.conv_impl=xla,auto), matmul_precision (default, high, highest, "
                            "bfloat16, tensorfloat32, float32) or xla_flags, whose values are separated by "
                            "';' (XLA flags hold ',' and '='), 'none' meaning no added flags, each run in a "
                            "child process with XLA_FLAGS extended, e.g. "
                            "--compare 'xla_flags=none;--xla_gpu_autotune_level=0'")
    bench.add_argument("--json", default=None, metavar="FILE",
                       help="write the whole result as JSON (refused if FILE exists, unless --overwrite)")
    bench.add_argument("--overwrite", action="store_true", help="replace an existing --json FILE")
    bench.add_argument("--isolate", action="store_true",
                       help="each variant in a fresh child process (cold compilation, its own peak memory)")
    bench.add_argument("--matmul-size", type=int, default=None, metavar="N",
                       help="the float32 N x N matmul whose rate achieved TFLOP/s are read against "
                            "(default: 2048 on CPU, 8192 on accelerators)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--count-kernels", action="store_true",
                       help="also count what one local step launches in each variant's compiled round program "
                            "(kernels, loops inside the step; compiles the round once more, outside the timings)")
    bench.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="JAX's persistent compilation cache folder (default: off, so compile times are "
                            "cold; JAX_COMPILATION_CACHE_DIR, when set, is used by JAX itself)")
    # run's flags that have no meaning for a benchmark: accepted so that a run command line works, then
    # ignored (--out, --replica-parallelism, --sweep-select) or refused in one line (cmd_bench).
    bench.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    for flag, kwargs in (("--coordinator", {}), ("--num-processes", {"type": int}), ("--process-id", {"type": int}),
                         ("--seeds", {"type": int, "nargs": "+"}), ("--replica-parallelism", {}),
                         ("--sweep", {"action": "append"}), ("--sweep-select", {})):
        bench.add_argument(flag, default=None, help=argparse.SUPPRESS, **kwargs)


def compile_cache_dir(flag: str | None) -> Path | None:
    """The persistent compilation cache folder for a CLI run (None: off). JAX's own
    ``JAX_COMPILATION_CACHE_DIR`` wins when set (JAX reads it itself)."""
    import os
    choice = flag or os.environ.get("FEDJAX_SPARSE_COMPILE_CACHE")
    if choice == "off" or (choice is None and os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        return None
    if choice:
        return Path(choice).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedjax_sparse" / "jax"


def enable_compile_cache(flag: str | None) -> None:
    """Turns on JAX's persistent compilation cache for this process (the CLI is the process's
    entry point; library users set ``jax_compilation_cache_dir`` themselves). A compiled program
    is reused only for identical programs, XLA flags and versions, so no number changes."""
    folder = compile_cache_dir(flag)
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"notice: no compilation cache ({folder}: {e.strerror}); every run compiles afresh; "
              "pass --compile-cache DIR or --compile-cache off", file=sys.stderr)
        return
    import jax
    jax.config.update("jax_compilation_cache_dir", str(folder))


def config_from_args(args):
    """The RunConfig that ``run``'s flags describe (``--setting``, the ``--config`` file over it, then the flags
    given, ``--option``, ``--model-option``), and the fields the user set (the setting's and the config
    file's keys and the flags given).
    Returns (config, given). Raises ValueError (one line) on a bad file or a removed flag."""
    from fedjax_sparse.driver.config import OPTION_PREFIXES, RunConfig, parse_overrides, typed_value, with_overrides
    base = {}
    if args.setting:
        from fedjax_sparse.papers.settings import setting
        base = setting(args.setting)
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ValueError(f"config file {path} not found; pass an existing JSON file to --config")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON ({e})") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {args.config} must hold a JSON object of RunConfig fields "
                             f"(e.g. {{\"algorithm\": \"fedavg\", \"rounds\": 10}}), not a {type(loaded).__name__}")
        # Over --setting's keys (its option dicts merged with the file's).
        merged = {k: {**base[k], **loaded[k]} for k in OPTION_PREFIXES.values()
                  if isinstance(base.get(k), dict) and isinstance(loaded.get(k), dict)}
        base = {**base, **loaded, **merged}
    config = RunConfig.from_json(base)
    # What the user set: the config file's keys (execution's by their own names) and the flags below.
    given = set(base) - {"execution"} | set(base.get("execution") or {})
    flags = {dest: getattr(args, dest) for _, dest, kind, *_ in RUN_FLAGS
             if kind is not dict and getattr(args, dest) is not None}
    overrides = {}
    for flag, prefix in OPTION_FLAGS.items():
        specs = getattr(args, flag[2:].replace("-", "_")) or []
        overrides.update({f"{prefix}.{key}": text for key, text in parse_overrides(specs, flag).items()})
        given |= {OPTION_PREFIXES[prefix]} if specs else set()
    config = with_overrides(config, flags)
    if not getattr(args, "resume", False):
        # Typed for the configuration they set; a resumed run's stay text, typed against the recorded
        # configuration they are compared with (runner.resumed_config: its algorithm's options).
        overrides = {key: typed_value(config, key, text, key.partition(".")[0]) for key, text in overrides.items()}
    return with_overrides(config, overrides), given | set(flags)


def cmd_run(args) -> int:
    from fedjax_sparse.driver import distributed, runner
    from fedjax_sparse.driver.progress import format_summary
    enable_compile_cache(args.compile_cache)
    processes = distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    config, given = config_from_args(args)
    if args.resume and not config.out:
        raise ValueError("--resume needs --out pointing at the interrupted run's directory")
    from fedjax_sparse.driver.config import parse_overrides
    change = parse_overrides(args.change or [], "--change")
    if change and (args.sweep is not None or args.seeds is not None):
        raise ValueError("--change continues one run from its checkpoint; resume a sweep's or replicas' member "
                         "alone with --out MEMBER_FOLDER --resume --change ...")
    if args.sweep is not None or (args.resume and config.out and (Path(config.out) / "sweep.json").exists()):
        if change:
            raise ValueError("--change continues one run from its checkpoint; resume a sweep's member alone with "
                             "--out OUT/<point>/seed<SEED> --resume --change ...")
        if processes > 1:
            raise ValueError("--sweep runs in one process")
        return _run_sweep(args, config, given)
    # runner.run and replicas.run_replicas check the whole configuration, once, before anything is loaded or
    # written (a resumed run's configuration is the recorded one, checked once merged).
    if args.seeds is not None:
        if processes > 1:
            raise ValueError("--seeds runs in one process; launch one multi-process run per --seed instead")
        return _run_replicas(args, config, given)
    summary = runner.run(config, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet,
                         given=given, change=change or None).summary
    if not distributed.is_primary():
        return 0  # process 0 reports
    print(format_summary(summary))
    if config.out:
        print(f"outputs: {config.out}/{{config.json,metrics.jsonl,summary.json}}")
    return 0


def cmd_bench(args) -> int:
    """``bench``: run's flags make the configuration; run's flags that make no sense for a benchmark
    are refused in one line, or ignored with a notice (``--out``: bench writes nothing but ``--json``)."""
    from fedjax_sparse.tools import bench
    one_process = "bench times one process"
    refused = {"--resume": (args.resume or None, "give the run's flags or --config FILE instead"),
               "--seeds": (args.seeds, "bench one --seed (or --compare seed=0,1)"),
               "--sweep": (args.sweep, "time each point alone with --compare KEY=V1,V2"),
               "--coordinator": (args.coordinator, one_process), "--num-processes": (args.num_processes, one_process),
               "--process-id": (args.process_id, one_process)}
    for flag, (value, fix) in refused.items():
        if value is not None:
            raise ValueError(f"bench does not take {flag}: {fix}")
    config, _ = config_from_args(args)
    if config.out:
        print(f"notice: bench writes no run folder; --out {config.out} ignored (--json FILE writes the result)",
              file=sys.stderr)
        config = dataclasses.replace(config, out=None)
    if args.json:   # before the benchmark runs, not after it
        bench.check_json_writable(args.json, overwrite=args.overwrite)
    axes = bench.parse_compare(args.compare or [])
    if args.compile_cache and args.compile_cache != "off":
        enable_compile_cache(args.compile_cache)
    result = bench.bench(config, axes, rounds_timed=args.rounds_timed, matmul_size=args.matmul_size,
                         isolate=args.isolate, progress=not args.quiet, count_kernels=args.count_kernels)
    result["command"] = "python -m fedjax_sparse " + shlex.join(args.argv)
    print(bench.format_table(result), end="")
    if args.json:
        print(f"wrote {bench.write_json(result, args.json, overwrite=args.overwrite)}")
    return 0


def _run_replicas(args, config, given: set) -> int:
    from fedjax_sparse.driver import replicas
    if "seed" in given:
        raise ValueError("give either --seed (one run) or --seeds (one replica per seed), not both")
    results = replicas.run_replicas(config, args.seeds, parallelism=args.replica_parallelism, resume=args.resume,
                                    overwrite=args.overwrite, progress=not args.quiet, given=given)
    finals = [r.summary.get("final_accuracy") for r in results]
    for seed, final in zip(args.seeds, finals):
        print(f"seed {seed}: final accuracy {'n/a' if final is None else f'{100 * final:.2f}%'}")
    known = [f for f in finals if f is not None]
    if len(known) > 1:
        import numpy as np
        print(f"over {len(known)} seeds: {100 * np.mean(known):.2f}% ± {100 * np.std(known, ddof=1):.2f}% "
              "(mean ± sample std)")
    if config.out:
        print(f"outputs: {config.out}/seed<SEED>/{{config.json,metrics.jsonl,summary.json}}, "
              f"{config.out}/replicas.json")
    return 0


def _run_sweep(args, config, given: set) -> int:
    from fedjax_sparse.driver import sweeps
    if "seed" in given and args.seeds is not None:
        raise ValueError("give either --seed or --seeds with --sweep, not both")
    seeds = args.seeds if args.seeds is not None else ([config.seed] if "seed" in given or not args.resume else None)
    # --resume of a sweep: the grid, seeds and configuration left out are the recorded ones; given ones
    # may only extend it (sweeps.resume_plan: refused in one line otherwise).
    axes = sweeps.parse_sweep(args.sweep) if args.sweep is not None else None
    result = sweeps.sweep(config, axes, seeds, parallelism=args.replica_parallelism, select=args.sweep_select,
                          resume=args.resume, overwrite=args.overwrite, progress=not args.quiet, given=given,
                          keep_states=False)   # the files hold what the command reports
    print(result.table(), end="")
    if config.out:
        print(f"outputs: {config.out}/<point>/seed<SEED>/, {config.out}/sweep.json, {config.out}/sweep.md")
    return 0


def cmd_partition(args) -> int:
    from fedjax_sparse.data.arrays import load
    from fedjax_sparse.data.partitions import (format_partition_report, partition_dataset,
                                              partition_report)
    dataset = load(args.dataset, args.data_dir)
    part = partition_dataset(dataset, args.partition, args.num_clients, args.seed,
                                       min_train_samples=args.min_client_samples)
    report = partition_report(dataset, part)
    print(format_partition_report(report, max_rows=args.max_rows))
    if args.out:
        from fedjax_sparse.driver import pinning
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        target = out / "partition.json"
        if target.exists():
            raise ValueError(f"{target} already exists; choose another --out or delete it")
        # Label statistics plus every client's indices: usable as `run --partition-file`.
        doc = pinning.partition_to_json(part, dataset=args.dataset, seed=args.seed, report=report)
        target.write_text(json.dumps(doc))
        print(f"wrote {target} (usable as run --partition-file)")
    return 0


def cmd_list(args) -> int:
    from fedjax_sparse.algorithms import algorithm_names, algorithm_options
    from fedjax_sparse.driver.config import DEFAULT_MODELS
    from fedjax_sparse.data import datasets
    from fedjax_sparse.data.partitions import PARTITION_SCHEMES
    from fedjax_sparse.algorithms.registry import algorithm_entry
    from fedjax_sparse.driver.catalog import MODELS, algorithm_line, default_lr
    from fedjax_sparse.models import model_names
    from fedjax_sparse.models.registry import model_options
    print("algorithms: (--algorithm NAME: what it is, its paper; then --option KEY=VALUE: type = default)")
    for name in algorithm_names():
        fields = dataclasses.fields(algorithm_options(name))
        options = ", ".join(f"{f.name}: {type(f.default).__name__} = {f.default!r}" for f in fields)
        print(f"  {name:<24} {algorithm_line(algorithm_entry(name)) or '(your algorithm)'}")
        print(f"  {'':<24}   default --lr {default_lr(name)}; options: {options or '(none)'}")
    from fedjax_sparse.driver.config import wrappable_algorithms
    print("--aggregator / --attack wrap: " + ", ".join(wrappable_algorithms()) + " (their clients send float updates)")
    print("datasets: (--dataset NAME, then --dataset-option KEY=VALUE: type = default, what)")
    alike: dict[int, list[str]] = {}   # the data sets sharing one schema (the file-based ones), on one line
    for name in datasets.DATASETS:
        alike.setdefault(id(datasets.DATASET_OPTIONS[name]), []).append(name)
    for names in alike.values():
        schema = datasets.DATASET_OPTIONS[names[0]]
        print(f"  {', '.join(names)}: " + "; ".join(f"{key}: {o.kind.__name__ if o.kind else 'any'} = {o.default!r} "
                                                  f"({o.help})" for key, o in schema.items()))
    print("models: (--model NAME: the data sets it suits; default per data set: "
          + ", ".join(f"{d} {m}" for d, m in DEFAULT_MODELS.items()) + "; then --model-option KEY=VALUE)")
    for name in model_names():
        print(f"  {name:<24} {MODELS.get(name, '(your model)')}")
        print(f"  {'':<24}   options: " + ", ".join(f"{k}: {type(v).__name__} = {v!r}"
                                                    for k, v in model_options(name).items()))
    print("partitions: " + ", ".join(PARTITION_SCHEMES))
    from fedjax_sparse.papers.settings import SETTINGS
    print("settings:   (--setting NAME: a paper's experiment or the quickstart's, fedjax_sparse/papers/settings.py) "
          + ", ".join(SETTINGS))
    return 0


def cmd_plot(args) -> int:
    from fedjax_sparse.tools.reporting import plot_runs
    plot_runs(args.runs, args.out, x=args.x, y=args.y, title=args.title)
    print(f"wrote {Path(args.out)}")
    return 0


def cmd_report(args) -> int:
    from fedjax_sparse.tools.reporting import report_table
    table = report_table(args.runs)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    return 0


def key_value_problem(argv: list[str]) -> str | None:
    """``--option momentum 0.9`` (a space for the ``=``): argparse would answer "unrecognized
    arguments: 0.9". The one-line message saying how to write it, or None."""
    for i, token in enumerate(argv):
        flag, sep, value = token.partition("=")
        if flag not in KEY_VALUE_FLAGS:
            continue
        rest = argv[i + 1:]
        if not sep:
            if not rest:
                return None  # argparse's "expected one argument"
            value, rest = rest[0], rest[1:]
        after = rest[0] if rest else None
        if "=" in value or value.startswith("--"):
            continue
        if after is not None and not after.startswith("--"):
            return f"{flag} takes KEY=VALUE, got {value!r} followed by {after!r}: write {flag} {value}={after}"
        return f"{flag} takes KEY=VALUE, got {value!r}: write {flag} {value}=VALUE"
    return None


def one_line_warnings() -> None:
    """Our own warnings (:class:`~fedjax_sparse.errors.DataWarning`) as one ``warning: ...`` line, like
    ``error: ...``, without Python's file, line and source line. Set by the command line's process
    (``main()`` reading ``sys.argv``); a notebook or a test calling ``main([...])`` keeps Python's format."""
    import warnings

    from fedjax_sparse.errors import DataWarning
    default = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        if issubclass(category, DataWarning):
            return f"warning: {message}\n"
        return default(message, category, filename, lineno, line)
    warnings.formatwarning = formatwarning  # type: ignore[assignment]


def main(argv=None) -> int:
    if argv is None:   # the process's own command line: python -m fedjax_sparse, or the fedjax-sparse script
        one_line_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    problem = key_value_problem(argv)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    args.argv = argv   # bench records its command line
    from fedjax_sparse.errors import DataError, RunInterrupted, RunStopped, cli_caller
    try:
        commands = {"run": cmd_run, "partition": cmd_partition, "list": cmd_list, "plot": cmd_plot,
                    "report": cmd_report, "bench": cmd_bench}
        with cli_caller():   # errors name flags, not Python arguments (errors.in_callers_words)
            return commands[args.command](args)
    except RunStopped as e:  # SIGTERM / SIGINT: checkpointed, one line, the conventional exit code
        print(str(e), file=sys.stderr)
        return e.exit_code
    except (ValueError, DataError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # read-only or full disk, permissions: name the file and the fix
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}; check that --out is writable and the disk has space, then "
              "rerun (with --resume if a checkpoint was written)", file=sys.stderr)
        return 2
    except RunInterrupted as e:   # a run's second Ctrl-C: what its folder holds now
        print(f"\n{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command (with --resume to continue from a checkpoint, where one "
              "was written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
