"""Building an experiment: a ``RunConfig`` (and optionally your own model, data or algorithm
objects) -> data, partition, model, task, algorithm and engine, as one ``Experiment``.

``build`` does everything a run does before its first round; ``fedjax_sparse.driver.runner.run`` drives the
rounds, ``fedjax_sparse.driver.progress`` reports them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.driver import pinning
from fedjax_sparse.algorithms import Algorithm, Task, compose, make_algorithm
from fedjax_sparse.driver.config import RunConfig, model_name, resolved_dp_accountant, validate, with_default_lr
from fedjax_sparse.errors import DataError, DataWarning, ModelWarning, RunError, arg, in_callers_words
from fedjax_sparse.data.federated import FederatedData, build_federated_data
from fedjax_sparse.core.engine import Engine, choose_pack_width, poisson_capacity
from fedjax_sparse.models import Model, make_model
from fedjax_sparse.models.flax.adapter import from_flax


@contextlib.contextmanager
def _one_line(*errors: type[Exception]) -> Iterator[None]:
    """A library's refusal (a ValueError, or one of ``errors``) as the one-line RunError users see; a
    DataError as it is."""
    caught: tuple[type[Exception], ...] = (ValueError, *errors)
    try:
        yield
    except DataError:
        raise
    except caught as e:
        raise RunError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything built from a config, ready to run (also handy in notebooks). Frozen: a run that
    changes a part (its data laid out over processes, a measured client schedule) makes a new one
    with ``dataclasses.replace``."""
    config: RunConfig
    dataset: Any
    partition: Any
    data: FederatedData
    task: Task
    engine: Engine

    # Paths and sha256 of the pinned-draw files used ({} when none).
    pinned: dict = dataclasses.field(default_factory=dict)
    # The data's name, shapes and content digest (config.json "data"; a resume must match it).
    data_record: dict = dataclasses.field(default_factory=dict)

    @property
    def algorithm(self):
        return self.engine.algorithm

    @property
    def model(self):
        return self.task.model

    def __repr__(self) -> str:  # the default one prints every array of the data and the task
        c = self.config
        return (f"Experiment({c.algorithm} on {c.dataset}: {self.data.num_clients} clients ({c.partition}), "
                f"{c.clients_per_round} per round, model {self.model.name}, {c.rounds} rounds; "
                f".data .task .engine .algorithm .model)")


@dataclasses.dataclass(frozen=True)
class Components:
    """What a library user hands ``run``/``build`` as objects instead of names (None: use the name
    in the config): a :class:`Model` or Flax module, a dataset (``PartitionedData`` from
    ``fedjax_sparse.data.from_arrays``, or a ``Dataset`` partitioned by the config), and an
    :class:`Algorithm` or a builder ``task -> Algorithm``."""
    model: Any = None
    data: Any = None
    algorithm: Any = None

    def given(self) -> set[str]:
        """The config fields given as objects (their names are labels): ``validate``'s ``objects``."""
        return {name for name, value in (("model", self.model), ("dataset", self.data),
                                         ("algorithm", self.algorithm)) if value is not None}


def with_components(config: RunConfig, model=None, data=None, algorithm=None) -> tuple[RunConfig, Components]:
    """Splits objects out of ``config`` (``RunConfig(algorithm=my_algorithm)`` works too) and puts
    their names in their place, so config.json records what ran: the algorithm's name, the model's
    name, the data's name, and a partitioned dataset's client count and partition."""
    from fedjax_sparse.algorithms import Algorithm
    from fedjax_sparse.data.arrays import PartitionedData
    from fedjax_sparse.data.datasets import Dataset
    # The algorithm's default (an object's: catalog.DEFAULT_LR), applied here only; config.json records it.
    config = with_default_lr(config, algorithm)
    if not isinstance(config.algorithm, str):
        if algorithm is not None:
            raise RunError("give the algorithm once: in RunConfig(algorithm=...) or as run(..., algorithm=...)")
        algorithm = config.algorithm
    if config.model is not None and not isinstance(config.model, str):
        if model is not None:
            raise RunError("give the model once: in RunConfig(model=...) or as run(..., model=...)")
        model = config.model
    changes: dict[str, Any] = {}
    if algorithm is not None:
        if isinstance(algorithm, Algorithm):
            changes["algorithm"] = algorithm.name
        elif callable(algorithm):
            changes["algorithm"] = getattr(algorithm, "__name__", type(algorithm).__name__)
        else:
            raise RunError(f"algorithm must be a name, an Algorithm or a function task -> Algorithm, not "
                           f"{type(algorithm).__name__}")
    if model is not None:
        changes["model"] = model.name if isinstance(model, Model) else type(model).__name__
    if data is not None:
        if isinstance(data, PartitionedData):
            changes.update(dataset=data.name, num_clients=data.num_clients, partition=data.partition.spec)
        elif isinstance(data, Dataset):
            changes["dataset"] = data.name
        else:
            raise RunError(f"data must come from fedjax_sparse.data (from_arrays, partition or load), not "
                           f"{type(data).__name__}")
    return dataclasses.replace(config, **changes), Components(model, data, algorithm)


@dataclasses.dataclass(frozen=True)
class Checked:
    """A configuration ready to build: its objects split out and its default learning rate applied
    (:func:`with_components`), validated (:func:`check`), once; ``options``: the algorithm's typed
    options (None for an algorithm object)."""
    config: RunConfig
    parts: Components = Components()
    options: Any = None


def check(config: RunConfig, parts: Components = Components()) -> Checked:
    """``config`` (from :func:`with_components`, with ``parts``) validated: the one check of a run's
    configuration, before anything is loaded or written; a RunError names the problem and the fix."""
    return Checked(config, parts, validate(config, objects=parts.given()))


@in_callers_words
def build(config: RunConfig | Checked, *, model=None, data=None, algorithm=None) -> Experiment:
    """Data, model, algorithm and engine from ``config``; ``model``, ``data`` and ``algorithm``
    objects replace the config's names (see :class:`Components`). A :class:`Checked` configuration
    (with its objects) is built as it is, not checked again."""
    if isinstance(config, Checked) and any(value is not None for value in (model, data, algorithm)):
        raise TypeError("a Checked configuration holds its objects: build(checked) takes no model, data or algorithm")
    checked = config if isinstance(config, Checked) else check(*with_components(config, model, data, algorithm))
    config, parts, options = checked.config, checked.parts, checked.options
    from fedjax_sparse.data.arrays import PartitionedData, load as load_data
    from fedjax_sparse.data.partitions import partition_dataset
    pinned = {}
    if isinstance(parts.data, PartitionedData):
        dataset, partition = parts.data.dataset, parts.data.partition
        if config.partition_file:
            raise RunError(f"{arg('partition_file')} pins a partition, but the data given is already partitioned; "
                           "drop one")
    else:
        if parts.data is not None:
            dataset = parts.data
        else:
            dataset_options = dict(config.dataset_options)
            if config.dataset == "synthetic":
                dataset_options.setdefault("num_clients", config.num_clients)
                dataset_options.setdefault("seed", config.seed)
            dataset = load_data(config.dataset, config.data_dir, download=config.download, **dataset_options)
        with _one_line():
            if config.partition_file:
                partition = pinning.load_partition_file(config.partition_file, dataset, config.num_clients)
                pinned["partition_file"] = {"path": config.partition_file,
                                            "sha256": pinning.file_digest(config.partition_file)}
            else:
                partition = partition_dataset(dataset, config.partition, config.num_clients,
                                              config.seed, min_train_samples=config.min_client_samples)
    with _one_line():
        data = build_federated_data(dataset, partition, preprocess=config.preprocess)
    data_record = PartitionedData(dataset, partition).describe()
    largest = int(np.max(np.asarray(data.train_count))) if data.num_clients else 0
    if 0 < largest < config.batch_size:
        # Not an error (each client trains full-batch), but not what the flag says: said once (warnings'
        # default filter shows it once per place; stacklevel 1 keeps the place here, whoever builds: every
        # sweep member or replica builds).
        warnings.warn(DataWarning(
            f"{arg('batch_size', config.batch_size)} is larger than every client's training set (the largest holds "
            f"{largest} examples): each local epoch is one full-batch step, padded to {config.batch_size} rows; "
            f"{arg('batch_size', largest)} takes the same steps without the padding"), stacklevel=1)
    if parts.model is None:
        with _one_line(TypeError, ImportError, AttributeError):
            model = make_model(model_name(config), data.input_shape, data.num_classes, **config.model_options)
    elif isinstance(parts.model, Model):
        model = parts.model
        if tuple(model.input_shape) != tuple(data.input_shape) or model.num_classes != data.num_classes:
            raise RunError(f"model {model.name} takes {tuple(model.input_shape)} inputs and gives {model.num_classes} "
                           f"logits, but the data has {tuple(data.input_shape)} inputs and {data.num_classes} "
                           "classes; build the model for the data's shapes")
    else:
        with _one_line(TypeError):
            model = from_flax(parts.model, data.input_shape, num_classes=data.num_classes)
    initial_variables = None
    if config.init_params:
        if getattr(options, "init", "model") != "model":
            raise RunError(f"{arg('init_params')} gives the initial weights, but {config.algorithm} re-initialises "
                           f"them (option init={options.init!r}); add {arg('option', 'init=model')}")
        template = jax.eval_shape(model.init, jax.random.PRNGKey(0))
        with _one_line():
            variables, extras = pinning.load_init_params(config.init_params, template)
        # model.init returns the pinned variables whatever the key.
        model = dataclasses.replace(model, init_fn=lambda key: jax.tree_util.tree_map(jnp.asarray, variables))
        initial_variables = dict(variables)
        if extras:
            initial_variables["scores"] = {k.split("/")[1]: v for k, v in extras.items()}
        pinned["init_params"] = {"path": config.init_params, "sha256": pinning.file_digest(config.init_params)}
    schedule = None
    if config.cohort_schedule:
        if config.resample_every != 1:
            raise RunError(f"{arg('cohort_schedule')} fixes every round's cohort; drop {arg('resample_every')}")
        with _one_line():
            schedule = pinning.load_cohort_schedule(config.cohort_schedule, num_clients=config.num_clients,
                                                    clients_per_round=config.clients_per_round,
                                                    rounds=config.rounds)
        pinned["cohort_schedule"] = {"path": config.cohort_schedule,
                                     "sha256": pinning.file_digest(config.cohort_schedule)}
    assert config.lr is not None   # with_components set the algorithm's default
    task = Task(model=model, num_clients=config.num_clients, clients_per_round=config.clients_per_round,
                local_epochs=config.local_epochs, batch_size=config.batch_size, lr=float(config.lr),
                rounds=config.rounds, preprocess=data.preprocess, seed=config.seed,
                initial_variables=initial_variables)
    if parts.algorithm is None:
        with _one_line():   # the algorithm refuses the model or the setting (one line, with the fix)
            algorithm = make_algorithm(config.algorithm, task, options)
    else:
        algorithm = parts.algorithm if isinstance(parts.algorithm, Algorithm) else parts.algorithm(task)
        if not isinstance(algorithm, Algorithm):
            raise RunError(f"the algorithm builder {config.algorithm} returned a {type(algorithm).__name__}, "
                           "not an Algorithm")
    algorithm = wrap_algorithm(algorithm, config)
    if config.client_sampling == "poisson" and not algorithm.varying_cohort:
        raise RunError(f"{arg('client_sampling', 'poisson')}: {algorithm.name}'s server assumes a fixed cohort of K "
                       f"clients (its aggregation, vote or per-client optimisation is not written for a varying, "
                       f"possibly empty cohort); use {arg('client_sampling', 'fixed')}, or fedavg (and fedavgm, "
                       "fedadam, fedyogi, fedadagrad), fedprox or spafl")
    lag = batch_norm_lag(model, algorithm, data, config)
    if lag is not None:
        warnings.warn(ModelWarning(lag), stacklevel=2)
    engine = Engine(algorithm, config.num_clients, config.clients_per_round,
                    client_sampling=config.client_sampling,
                    # ``measure`` is decided by the run (measure_client_parallelism); "auto" until then.
                    client_parallelism=("auto" if config.execution.client_parallelism == "measure"
                                        else config.execution.client_parallelism),
                    resample_every=config.resample_every,
                    local_epochs=config.local_epochs,
                    batch_size=config.batch_size,
                    eval_batch_size=config.execution.eval_batch_size or auto_eval_batch_size(data),
                    personal_eval=config.execution.personal_eval,
                    cohort_schedule=None if schedule is None else tuple(map(tuple, schedule.tolist())),
                    pack_width=pack_width_for(config, data, schedule))
    return Experiment(config, dataset, partition, data, task, engine, pinned, data_record)


# A BatchNorm whose running statistics still hold more than this share of their initial values at the
# run's last evaluation is flagged: the final (and best) accuracy rest on them (the measurement that set
# it: docs/design.md, "Constants and the measurements behind them").
STALE_STATISTICS = 0.1


def batch_norm_lag(model: Model, algorithm: Algorithm, data: FederatedData, config: RunConfig) -> str | None:
    """One line when the model's BatchNorm running statistics cannot follow the run, else None: more than
    ``STALE_STATISTICS`` of their initial values left, m ** (S r), after S local steps a round (the median
    client's; a personal model's in K / N of the rounds) over r rounds. Why: docs/design.md, "BatchNorm in
    federated runs"."""
    m = float(model.batch_norm_momentum)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    if not jax.tree_util.tree_leaves(variables.get("batch_stats", {})) or m <= 0:
        return None
    counts = np.asarray(jax.device_get(data.train_count))
    counts = counts[counts > 0]
    if not counts.size:
        return None
    steps = config.local_epochs * int(np.median(-(-counts // config.batch_size)))
    per_round = steps * (config.clients_per_round / config.num_clients if algorithm.personal_predict else 1.0)
    share = m ** (per_round * config.rounds)
    if share <= STALE_STATISTICS:
        return None
    first = min(config.eval_every, config.rounds)
    fix = STALE_STATISTICS ** (1 / (per_round * config.rounds)) if per_round else 0.0
    earlier = f" ({m ** (per_round * first):.0%} at round {first})" if first < config.rounds else ""
    return (f"BatchNorm running statistics lag this run: momentum {m:g} over about {steps} local steps a round keeps "
            f"{share:.0%} of their initial values at round {config.rounds}, the last evaluation{earlier}, and "
            f"evaluation normalises with them, so accuracy can "
            f"fall below chance while the training loss falls; use a BatchNorm momentum of "
            f"{math.floor(fix * 100) / 100:.2f} or lower (Flax: nn.BatchNorm(momentum=...)) or more local steps "
            f"({arg('local_epochs')}, {arg('rounds')}); docs/design.md, 'BatchNorm in federated runs'")


def wrap_algorithm(algorithm: Algorithm, config: RunConfig) -> Algorithm:
    """``algorithm`` inside the wrappers ``config`` asks for (``--dp-clip``, ``--aggregator``,
    ``--attack``; the attack outermost: it is what the clients send)."""
    with _one_line(TypeError):
        if config.dp_clip is not None:
            from fedjax_sparse.algorithms.private import with_dp
            algorithm = with_dp(algorithm, clip_norm=config.dp_clip, noise_multiplier=noise_multiplier(config),
                                clients_per_round=config.clients_per_round)
        if config.aggregator is not None:
            algorithm = compose.with_aggregator(algorithm, config.aggregator, trim_fraction=config.trim_fraction)
        if config.attack is not None:
            algorithm = compose.with_attack(algorithm, config.attack, num_clients=config.num_clients,
                                            malicious_fraction=config.malicious_fraction, seed=config.seed)
    return algorithm


def noise_multiplier(config: RunConfig) -> float:
    """``--dp-noise-multiplier``, or the one ``--dp-target-epsilon`` calibrates for the run's rounds
    (the run's sampling and accountant: ``privacy_sampling``, ``privacy_accountant``; fedjax_sparse.driver.privacy)."""
    if config.dp_noise_multiplier is not None:
        return float(config.dp_noise_multiplier)
    from fedjax_sparse.driver import privacy
    assert config.dp_target_epsilon is not None   # config.check_privacy
    return privacy.calibrate_noise_multiplier(config.dp_target_epsilon, config.rounds, config.dp_delta,
                                              num_clients=config.num_clients,
                                              clients_per_round=config.clients_per_round,
                                              sampling=privacy_sampling(config), accountant=privacy_accountant(config))


def privacy_accountant(config: RunConfig) -> str:
    """The run's accountant (``--dp-accountant``, ``auto`` resolved: PLD for Poisson sampling, else RDP)."""
    return resolved_dp_accountant(config.dp_accountant, config.client_sampling)


def privacy_sampling(config: RunConfig) -> str:
    """The accountant's name for the run's client sampling: ``without_replacement`` (fixed K of N,
    replace-one adjacency) or ``poisson`` (add/remove-one; fedjax_sparse.driver.privacy)."""
    return "poisson" if config.client_sampling == "poisson" else "without_replacement"


def pack_width_for(config: RunConfig, data, schedule) -> int:
    """``Engine.pack_width`` for this run's clients (``engine.choose_pack_width`` over their local step
    counts; the pinned cohorts where a schedule pins them). Set for every schedule, so that ``measure``
    and ``bench`` can switch to ``packed``; only ``packed`` reads it."""
    counts = np.asarray(data.train_count, np.int64)
    steps = config.local_epochs * -(-counts // config.batch_size)
    slots = config.clients_per_round
    if config.client_sampling == "poisson":
        rate = config.clients_per_round / config.num_clients
        slots = max(poisson_capacity(config.num_clients, rate), min(config.clients_per_round, config.num_clients), 1)
    if slots > config.num_clients:   # the Engine refuses it, with its own message
        return 1
    return choose_pack_width(steps, slots, cohorts=schedule)[0]


def auto_eval_batch_size(data: FederatedData, cap: int = 512) -> int:
    """Smallest power of two >= the mean client test-set size (at most ``cap``):
    each client's test set is cut into ceil(n / B) batches, so a batch much
    larger than a client's test set is mostly padding."""
    counts = np.asarray(data.test_count)
    mean = float(counts[counts > 0].mean()) if (counts > 0).any() else 1.0
    return int(min(cap, max(16, 2 ** math.ceil(math.log2(max(mean, 1.0))))))
