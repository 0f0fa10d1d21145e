"""A run's settings, each declared once with its flag: what is computed (``RunFields``, the fields of
:class:`fedjax_sparse.driver.config.RunConfig`, which adds reading and validation) and how it runs
(:class:`Execution`, ``RunConfig.execution``). A field's metadata holds its flag's help group and help
(its flag is ``--`` + its name with dashes; its type its annotation's); the CLI of ``run``, ``bench`` and
``--sweep`` builds its flags and help groups from them (``RUN_FLAGS``, ``GROUPS``), and
:func:`fedjax_sparse.errors.arg` names a setting as its reader sets it. A leaf module (stdlib and the leaf
``schema``): the errors read it without importing the configuration, which imports them."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from fedjax_sparse import errors
from fedjax_sparse.schema import kinds

# `run --help`'s groups, in order (a flag that is no setting names its group where the CLI adds it).
GROUPS = ("configuration", "data", "model", "algorithm", "privacy", "robustness", "seeds and sweeps", "execution",
          "outputs")


def setting(default: Any = None, *, group: str, help: str, factory: Any = None, flag: str | None = None) -> Any:
    """A settings field with its flag's ``group`` and ``help`` (``flag``: a KEY=VALUE flag's own name, for
    the option dicts; ``default``'s ``factory`` for a mutable default)."""
    metadata = {"group": group, "help": help, **({"flag": flag} if flag else {})}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(name: str) -> str:
    """A RunConfig or Execution field's flag: ``client_parallelism`` -> ``--client-parallelism``."""
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a run executes: client schedules, round programs, evaluation mode, where the clients' state
    lives, checkpoint cadence, extra logs. None of it changes what is computed (bitwise, tested;
    ``client_storage="bfloat16"`` is the one lossy choice and says so), so every field may change when
    a run is resumed. Flags of the same names set it (``--client-parallelism`` ...); ``config.json``
    holds it as ``"execution"``. Which mode wins where: docs/design.md. Frozen, as the configuration is:
    ``config.replace(client_parallelism="map")`` gives a new one."""
    client_parallelism: str = setting(
        "auto", group="execution",
        help="auto (map on a CPU, packed on one accelerator, vmap across several or across processes) | vmap | map | "
             "packed (clients sorted by size, in lockstep groups that pad at most ~1.2x) | measure (time one round "
             "of map, vmap and packed, use the fastest; recorded in config.json)")
    eval_batch_size: int | None = setting(   # None: fedjax_sparse.driver.experiment.auto_eval_batch_size
        group="execution", help="evaluation batch size (default: from the clients' test-set sizes)")
    personal_eval: str = setting(
        "auto", group="execution", help="personalised evaluation: auto (default) = per_client (one call per client, "
                                        "whole test set, native convolutions)")
    client_state: str = setting(   # fedjax_sparse.driver.population
        "device", group="execution",
        help="where the clients' persistent state lives: device (default, all N rows) | host (host memory, "
             "copy-on-write; only each chunk's cohort rows go to the device: populations of 10^5+ clients)")
    client_storage: str = setting(
        "float32", group="execution",
        help="with --client-state host: float32 (default, exact) | bfloat16 (half the host memory, lossy)")
    host_chunk_rounds: int = setting(
        25, group="execution",
        help="with --client-state host: rounds per device program (default 25; the device holds this x K rows)")
    # Checkpoints on their own cadence besides the end and a stop.
    checkpoint_every: int = setting(
        0, group="outputs",
        help="checkpoint every N rounds (default 0: by the clock, at the end and when stopped by a signal)")
    checkpoint_seconds: float = setting(
        60.0, group="outputs",
        help="checkpoint at the first chunk end this many seconds after the previous checkpoint (default 60; 0: off)")
    # Chunks of rounds sized from the measured round time.
    max_chunk_seconds: float = setting(
        5.0, group="execution",
        help="the host regains control after about this much device work: progress, checkpoints, SIGTERM/SIGINT "
             "(default 5; 0: chunks end only at evaluations and checkpoints)")
    log: str = setting("", group="outputs",
                       help="extra logs beside metrics.jsonl: csv, tensorboard (comma-separated)")


@dataclasses.dataclass(frozen=True)
class RunFields:
    """What a run computes (and where it reads and writes): ``RunConfig``'s fields, declared here with
    their flags; see :class:`fedjax_sparse.driver.config.RunConfig`."""
    algorithm: str = setting("fedavg", group="algorithm", help="algorithm name (see `list`)")
    dataset: str = setting(
        "digits", group="data",
        help="dataset name (see `list`), or npz:PATH (your arrays: x_train, y_train, x_test, y_test [, "
             "client_ids_train, client_ids_test] with --partition natural)")
    data_dir: str | None = setting(group="data", help="folder with the dataset's original files")
    download: bool = setting(False, group="data", help="fetch the dataset with TFDS")
    model: str | None = setting(
        group="model",
        help="model name (see `list`; default: per dataset), or package.module:Name for your own flax.linen / "
             "flax.nnx module (a class built without arguments, an instance, or a factory; the working directory is "
             "on the import path)")
    num_clients: int = setting(20, group="data", help="number of clients N")
    clients_per_round: int = setting(5, group="algorithm", help="clients sampled per round K (<= N)")
    resample_every: int = setting(
        1, group="algorithm", help="keep each sampled cohort for this many rounds (default 1)")
    client_sampling: str = setting(   # fedjax_sparse.core.engine, docs/privacy.md
        "fixed", group="algorithm",
        help="fixed (default: exactly K of N each round) | poisson (each client independently with probability "
             "K / N: cohorts of varying size; DP accounted as published)")
    rounds: int = setting(30, group="algorithm", help="number of rounds")
    local_epochs: int = setting(2, group="algorithm", help="local epochs E per round")
    batch_size: int = setting(32, group="algorithm", help="local batch size")
    lr: float | None = setting(   # None: the algorithm's default (fedjax_sparse.driver.catalog), recorded as used
        group="algorithm",
        help="client learning rate (default: the algorithm's, `list` shows it: 0.1, SpaFL's and SignSGD's 0.01)")
    partition: str = setting(
        "dirichlet:0.5", group="data",
        help="iid | dirichlet:ALPHA | dirichlet_split:ALPHA[:FRAC] | shards:S | natural")
    min_client_samples: int = setting(
        1, group="data", help="redraw the partition until every client has this many")
    seed: int = setting(0, group="algorithm", help="random seed (data partition, init, sampling)")
    eval_every: int = setting(1, group="outputs", help="evaluate (and log, checkpoint) every M rounds")
    out: str | None = setting(
        group="outputs", help="output directory (config.json, metrics.jsonl, summary.json, checkpoint)")
    preprocess: str = setting("unit", group="data", help="input scaling: unit (x/255) | raw (0-255) | standardize")
    # Composition (fedjax_sparse.algorithms.compose) around the algorithm's server side.
    aggregator: str | None = setting(
        group="robustness", help="robust aggregation around any algorithm: mean | trimmed_mean | multi_krum")
    trim_fraction: float = setting(
        0.1, group="robustness", help="fraction of the cohort trimmed per side / assumed malicious (0.1)")
    attack: str | None = setting(group="robustness", help="model-poisoning attack around any algorithm: min_max")
    malicious_fraction: float = setting(   # fixed client ids, seeded by --seed
        0.0, group="robustness", help="fraction of malicious clients for --attack")
    # Client-level differential privacy (fedjax_sparse.algorithms.private; accounting in fedjax_sparse.driver.privacy).
    dp_clip: float | None = setting(
        group="privacy", help="client-level DP (DP-FedAvg): clip each sampled client's update to this L2 norm")
    dp_noise_multiplier: float | None = setting(
        group="privacy",
        help="DP: Gaussian noise of this x --dp-clip on the sum of the clipped updates (the mean's: / K)")
    dp_target_epsilon: float | None = setting(
        group="privacy", help="DP: instead of --dp-noise-multiplier, the noise calibrated to reach this epsilon after "
                              "--rounds")
    dp_delta: float = setting(1e-5, group="privacy", help="DP: the delta epsilon is reported at (default 1e-5)")
    dp_accountant: str = setting(   # config.resolved_dp_accountant
        "auto", group="privacy",
        help="DP: the accountant of epsilon and --dp-target-epsilon: auto (default: pld with --client-sampling "
             "poisson, else rdp) | rdp | pld (--client-sampling poisson only)")
    # Pinned draws (fedjax_sparse.driver.pinning): replay another run's partition, initial weights, cohorts.
    partition_file: str | None = setting(
        group="data", help="pinned partition: a fedjax_sparse.partition/1 JSON (client -> train/test indices; "
                           "`partition --out` writes one)")
    init_params: str | None = setting(
        group="model", help="pinned initial weights: .npz keyed params/<layer>/<name> (layouts in "
                            "docs/running.md, \"Pinned draws\")")
    cohort_schedule: str | None = setting(
        group="algorithm", help="pinned cohorts: a fedjax_sparse.cohorts/1 JSON, the client ids of every round")
    options: dict = setting(factory=dict, group="algorithm", flag="--option",
                            help="algorithm option (repeatable; `list` shows each algorithm's)")
    model_options: dict = setting(factory=dict, group="model", flag="--model-option",
                                  help="model option (repeatable; `list` shows each model's)")
    dataset_options: dict = setting(factory=dict, group="data", flag="--dataset-option",
                                    help="data set option, e.g. verify_checksums=false (repeatable; `list` shows "
                                         "each data set's)")
    execution: Execution = dataclasses.field(default_factory=Execution)   # its fields are flags of their own


def refuse_assignment(cls: type, fix: str) -> type:
    """Makes assigning to (or deleting) an attribute of the frozen dataclass ``cls`` say how to get a
    changed copy: ``fix`` with ``{name}`` the attribute's (still a ``dataclasses.FrozenInstanceError``)."""
    def refuse(self, name, *value):
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is frozen: use {fix.format(name=name)}")
    cls.__setattr__ = refuse   # type: ignore[method-assign,assignment]
    cls.__delattr__ = refuse   # type: ignore[method-assign,assignment]
    return cls


refuse_assignment(Execution, "config.replace({name}=...), a new configuration with it changed "
                             "(dataclasses.replace(execution, {name}=...): a new Execution)")
EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(Execution))
errors.declare_execution_fields(EXECUTION_FIELDS)
# The settings' flags: (flag, field, type, help, group); a KEY=VALUE flag's type is dict, a switch's bool.
RUN_FLAGS = [(f.metadata.get("flag") or flag_of(f.name), f.name,
              next(k for k in kinds(typing.get_type_hints(cls)[f.name]) if k is not type(None)),
              f.metadata["help"], f.metadata["group"])
             for cls in (RunFields, Execution) for f in dataclasses.fields(cls) if "help" in f.metadata]
