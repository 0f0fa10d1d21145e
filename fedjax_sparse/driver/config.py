"""A run's configuration: ``RunConfig`` (its fields, the CLI flags and config-file keys, are declared
with their flags in :mod:`fedjax_sparse.driver.settings`), reading it, KEY=VALUE overrides, its validation, and
the one-line ``RunError`` users see."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Iterable, Sequence

from fedjax_sparse.algorithms.registry import algorithm_names, algorithm_options, resolve_options, wrapper_refusal
from fedjax_sparse.data.federated import PREPROCESSING
from fedjax_sparse.models import model_names
from fedjax_sparse.models.registry import is_model_reference, resolve_model_options
from fedjax_sparse.errors import RunError, arg, in_callers_words, in_cli
from fedjax_sparse.schema import Option, describe, fits, from_text, listing, resolve
from fedjax_sparse.driver.settings import EXECUTION_FIELDS, Execution, RunFields, flag_of, refuse_assignment

# The execution modes a run offers: those with a recorded win (docs/design.md, "Execution modes").
CLIENT_PARALLELISM = ("auto", "vmap", "map", "packed", "measure")
PERSONAL_EVAL_MODES = ("auto", "per_client")
# Keys of removed execution modes that recorded config.json files hold at these inert values
# (tests/end_to_end/test_recorded_results.py): dropped on reading; any other value is refused.
REMOVED_EXECUTION = {"round_mode": "scan", "client_bucket_size": 0}
CLIENT_STATES = ("device", "host")
CLIENT_STORAGE = ("float32", "bfloat16")


# Model used when --model is not given.
DEFAULT_MODELS = {
    "mnist": "lenet5_caffe", "fashion_mnist": "lenet5_caffe", "emnist_letters": "lenet5_caffe",
    "digits": "cnn_small", "synthetic": "logreg", "cifar10": "cnn7", "cifar10_sample": "cnn7",
    "cifar100": "resnet18_narrow", "svhn": "lenet5_caffe",
}


class FrozenOptions(dict):
    """A configuration's option dict, read-only: changing it in place raises a TypeError naming
    ``config.replace(FIELD={...})``. A dict otherwise (equality, JSON, ``**`` unpacking, pickling)."""
    __slots__ = ("field",)

    def __init__(self, items=(), field: str = "options"):
        super().__init__(items)
        self.field = field

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"RunConfig.{self.field} is read-only: use config.replace({self.field}={{...}}), a new "
                        "configuration with the dict replaced whole")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return type(self), (dict(self), self.field)


@dataclasses.dataclass(frozen=True)
class RunConfig(RunFields):
    """A run's configuration: what is computed, its fields declared once with their flags in
    :class:`fedjax_sparse.driver.settings.RunFields` (``python -m fedjax_sparse run --help`` lists them, by group,
    with their defaults), and how it runs, ``execution`` (:class:`Execution`). ``config.json`` holds its
    :meth:`to_json`, :meth:`from_json` reads that back (and config files); :func:`validate` checks it.
    Frozen, its option dicts too (:class:`FrozenOptions`): :meth:`replace` (or ``dataclasses.replace``) gives
    a changed copy."""

    def __post_init__(self):
        for field in OPTION_PREFIXES.values():
            value = getattr(self, field)
            if isinstance(value, dict) and not isinstance(value, FrozenOptions):
                object.__setattr__(self, field, FrozenOptions(value, field))

    def replace(self, **changes) -> "RunConfig":
        """A new configuration with ``changes``, RunConfig and Execution fields by name:
        ``config.replace(rounds=5, client_parallelism="map")`` (an option dict is replaced whole)."""
        execution = changes.pop("execution", self.execution)
        moved = {name: changes.pop(name) for name in [*changes] if name in EXECUTION_FIELDS}
        return dataclasses.replace(self, **changes, execution=dataclasses.replace(execution, **moved))

    def to_json(self) -> dict:
        """The fields as ``config.json`` holds them: flat, execution's among the others (the file's keys
        are those of every version; `from_json` reads both forms)."""
        fields = dataclasses.asdict(self)
        execution = fields.pop("execution")
        return {**fields, **{field: dict(getattr(self, field)) for field in OPTION_PREFIXES.values()}, **execution}

    @classmethod
    @in_callers_words
    def from_setting(cls, name: str, **overrides) -> "RunConfig":
        """A paper's experiment by name (``fedjax_sparse.papers.settings.SETTINGS``; ``run --setting NAME``), with
        ``overrides`` (flat keys, execution's among them; the option dicts are merged into the
        setting's): ``RunConfig.from_setting("spafl_fmnist", data_dir="../shared/data", rounds=100)``."""
        from fedjax_sparse.papers.settings import setting
        data = setting(name)
        for key in OPTION_PREFIXES.values():
            if key in overrides:
                overrides = {**overrides, key: {**data.get(key, {}), **overrides[key]}}
        return cls.from_json({**data, **overrides})

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        """From ``config.json`` / a config file: the fields, ``"execution"`` an object of `Execution`
        fields; execution fields at the top level (config files and runs of earlier versions, the
        flags' names) are read into ``execution`` too."""
        if not isinstance(data, dict):
            raise RunError(f"a configuration must be a JSON object of RunConfig fields, not a {type(data).__name__}")
        data = dict(data)
        execution = data.pop("execution", None) or {}
        if not isinstance(execution, dict):
            raise RunError(f"config key 'execution' expects an object of {', '.join(EXECUTION_FIELDS)}, got "
                           f"{execution!r}")
        unknown = sorted(set(execution) - set(EXECUTION_FIELDS))
        if unknown:
            raise RunError(f"unknown execution key(s) {unknown}; valid keys: {list(EXECUTION_FIELDS)}")
        execution = dict(execution)
        for name, inert in REMOVED_EXECUTION.items():
            if name in data and data.pop(name) != inert:
                raise RunError(f"config key {name!r}: its mode was removed in 0.2.0 (docs/design.md, "
                               f"\"Execution modes\"); drop the key")
        for name in EXECUTION_FIELDS:
            if name in data:
                value = data.pop(name)
                if name in execution and execution[name] != value:
                    raise RunError(f"config key {name!r} is given twice, as {value!r} and as execution.{name} "
                                   f"{execution[name]!r}; keep one")
                execution[name] = value
        names = {f.name for f in dataclasses.fields(cls)} - {"execution"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise RunError(f"unknown config key(s) {unknown}; valid keys: {sorted(names | set(EXECUTION_FIELDS))}")
        for key, value in [*data.items(), *execution.items()]:
            hint = typing.get_type_hints(Execution if key in EXECUTION_FIELDS else cls)[key]
            if not fits(value, hint):
                raise RunError(f"config key {key!r}{in_cli(f' (flag {flag_of(key)})')} expects {describe(hint)}, "
                               f"got {value!r}")
        return cls(**data, execution=Execution(**execution))


refuse_assignment(RunConfig, "config.replace({name}=...) or dataclasses.replace(config, {name}=...), a new "
                             "configuration")


def model_name(config: RunConfig) -> str:
    """The model a run builds: ``--model``, else its data set's default (``DEFAULT_MODELS``; ``mlp``)."""
    return config.model or DEFAULT_MODELS.get(config.dataset, "mlp")


# ------------------------------------------------------------------ KEY=VALUE overrides
# ``option.NAME=V`` sets RunConfig.options[NAME] (``model_option.``, ``dataset_option.`` likewise); the
# fields' own plural names (``options.NAME``) are read too.
OPTION_PREFIXES = {"option": "options", "model_option": "model_options", "dataset_option": "dataset_options"}
OPTION_FIELDS = {field: prefix for prefix, field in OPTION_PREFIXES.items()}   # "options" -> "option"
LIST_SEPARATORS = {"xla_flags": ";"}   # bench --compare: XLA flags hold ',' (and '=')


def override_key(key: str) -> str:
    """``options.alpha`` -> ``option.alpha``; any other key as it is (stripped)."""
    prefix, dot, name = key.strip().partition(".")
    return f"{OPTION_FIELDS.get(prefix, prefix)}{dot}{name}"


def parse_overrides(specs: Sequence[str], flag: str, lists: bool = False) -> dict[str, Any]:
    """The one KEY=VALUE grammar (``--option``, ``--model-option``, ``--dataset-option``, ``--change``,
    ``--sweep``, ``--compare``): ``["lr=0.1", "option.alpha=0.01"]`` -> ``{"lr": "0.1", "option.alpha":
    "0.01"}`` (the last of a key given twice wins), values as text: :func:`typed_value` types them for the
    configuration they apply to. ``lists``: ``KEY=V1,V2`` -> ``{KEY: ["V1", "V2"]}`` (``xla_flags``'
    values separated by ``;``), a key or a value given twice refused. One-line RunError naming ``flag``."""
    out: dict[str, Any] = {}
    for spec in specs:
        key, sep, text = spec.partition("=")
        key = override_key(key)
        separator = LIST_SEPARATORS.get(key, ",")
        form = f"V1{separator}V2" if lists else "VALUE"
        if not sep or not key:
            raise RunError(f"{flag} takes KEY={form}, got {spec!r}: write {flag} {key or 'KEY'}={form}")
        if not lists:
            out[key] = text.strip()
            continue
        values = [value.strip() for value in text.split(separator)]
        if not all(values):
            raise RunError(f"{flag} {spec!r} has an empty value: write {flag} {key}={form} (values separated by "
                           f"'{separator}')")
        if key in out:
            raise RunError(f"{flag} names {key!r} twice; give all its values once: {flag} {key}={form}")
        out[key] = values
    return out


def typed_value(config: RunConfig, key: str, value: Any, via: str) -> Any:
    """The value override ``key`` takes in ``config``: text read as the type the key declares (a RunConfig
    or Execution field's annotation; ``option.NAME`` / ``model_option.NAME`` / ``dataset_option.NAME``: the
    algorithm's typed options, the model's and the data set's schemas; a model of your own declares none:
    read as JSON spells it); any other value as it is (checked with the whole configuration). One-line
    RunError naming the key, the expected type and ``via`` (what gave it: ``sweep``, ``change``, ...)."""
    if not isinstance(value, str):
        return value
    prefix, dot, name = key.partition(".")
    try:
        if dot and prefix == "option":
            return algorithm_option_values(config.algorithm, {name: value})[name]
        if dot and prefix == "model_option":
            model = model_name(config)
            return from_text(value) if is_model_reference(model) else resolve_model_options(model, {name: value})[name]
        if dot and prefix == "dataset_option":
            from fedjax_sparse.data.datasets import dataset_options
            return dataset_options(config.dataset, {name: value})[name]
    except ValueError as e:
        raise RunError(str(e)) from None
    hints = {**typing.get_type_hints(RunConfig), **typing.get_type_hints(Execution)}
    if key in (*OPTION_PREFIXES.values(), "execution") or key not in hints:
        raise RunError(f"{arg(via)} {key}: not a setting; set a RunConfig or execution field (lr, client_parallelism, "
                       "...), option.NAME, model_option.NAME or dataset_option.NAME")
    try:
        return from_text(value, hints[key])
    except ValueError as e:
        raise RunError(f"{arg(via)} {key}={value!r}: {e}") from None


def typed_axes(config: RunConfig, axes: dict[str, list], via: str) -> dict[str, list]:
    """``{key: [values]}`` (``sweep``'s, ``compare``'s) typed for ``config`` (:func:`typed_value`); a key
    listing one value twice (``0.1,0.10``) is refused in one line."""
    typed = {}
    for key, values in axes.items():
        typed[key] = [typed_value(config, key, value, via) for value in values]
        if len(set(map(repr, typed[key]))) != len(values):
            raise RunError(f"{arg(via)} {key} lists a value twice: {', '.join(map(str, values))}")
    return typed


def with_overrides(config: RunConfig, values: dict[str, Any] | Iterable[tuple[str, Any]]) -> RunConfig:
    """A new ``config`` with ``values`` set (``{key: value}`` or ``((key, value), ...)``: RunConfig and
    Execution fields, ``option.NAME``, ``model_option.NAME``, ``dataset_option.NAME``), unchecked."""
    dicts: dict[str, Any] = {field: dict(getattr(config, field)) for field in OPTION_PREFIXES.values()}
    fields: dict[str, Any] = {}
    execution: dict[str, Any] = {}
    for key, value in dict(values).items():
        prefix, dot, name = key.partition(".")
        if dot and prefix in OPTION_PREFIXES:
            dicts[OPTION_PREFIXES[prefix]][name] = value
        else:
            (execution if key in EXECUTION_FIELDS else fields)[key] = value
    return dataclasses.replace(config, **dicts, **fields, execution=dataclasses.replace(config.execution, **execution))


def same_setting(config: RunConfig, key: str, a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` set override ``key`` of ``config`` alike: a flag's text and a recorded value
    (``"true"`` and ``True``; an earlier version's recorded text ``"0.01"`` and ``0.01``)."""
    try:
        return typed_value(config, key, a, "change") == typed_value(config, key, b, "change")
    except RunError:   # a key or value ``config`` cannot take: the same only as the same text
        return str(a) == str(b)


def with_default_lr(config: RunConfig, algorithm: Any = None) -> RunConfig:
    """``config`` with its learning rate set: the given one, else its algorithm's default
    (:func:`fedjax_sparse.driver.catalog.default_lr`; ``algorithm``: an object given in the name's place);
    config.json records the one used. The one place the default is applied, once per run
    (:func:`fedjax_sparse.driver.experiment.with_components`; a resumed run recorded by a version that did not
    record it: ``runner.open_run``)."""
    if config.lr is not None:
        return config
    from fedjax_sparse.driver.catalog import default_lr
    return dataclasses.replace(config, lr=default_lr(config.algorithm if algorithm is None else algorithm))


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def validate(config: RunConfig, objects: frozenset[str] | set[str] = frozenset()):
    """Raises RunError naming the problem and the fix; returns the algorithm's typed options (None
    when the algorithm is an object). ``objects``: the fields among ``algorithm``, ``model`` and
    ``dataset`` that a library user gave as objects (their names are labels, not registry keys)."""
    ex = config.execution
    positive, non_negative = (lambda v: _count(v, 1)), (lambda v: _count(v, 0))
    # (fields, where they are, the check, what the message says they must be), checked in this order
    ranges = ((("num_clients", "clients_per_round", "resample_every", "rounds", "local_epochs", "batch_size",
                "eval_every"), config, positive, "a positive integer"),
              (("eval_batch_size",), ex, lambda v: v is None or positive(v), "a positive integer"),
              (("host_chunk_rounds",), ex, positive, "a positive integer"),
              (("checkpoint_every",), ex, non_negative,
               "a non-negative integer (0: only at evaluations and by the clock)"),
              (("checkpoint_seconds", "max_chunk_seconds"), ex, _seconds, "a non-negative number of seconds (0: off)"),
              (("seed", "min_client_samples"), config, non_negative, "a non-negative integer"),
              (("lr",), config, lambda v: v is None or isinstance(v, (int, float)) and math.isfinite(v) and v > 0,
               "a positive number"))
    for names, where, ok, what in ranges:
        for name in names:
            if not ok(value := getattr(where, name)):
                raise RunError(f"{arg(name)} must be {what}, got {value!r}")
    if config.clients_per_round > config.num_clients:
        raise RunError(f"{arg('clients_per_round')} ({config.clients_per_round}) is larger than {arg('num_clients')} "
                       f"({config.num_clients}); sample at most as many clients as there are")
    if "algorithm" not in objects and config.algorithm not in algorithm_names():
        raise RunError(f"unknown algorithm {config.algorithm!r}; valid algorithms: {', '.join(algorithm_names())}")
    if ("model" not in objects and config.model is not None and config.model not in model_names()
            and not is_model_reference(config.model)):
        raise RunError(f"unknown model {config.model!r}; valid models: {', '.join(model_names())}, or "
                       "package.module:Name for your own Flax module")
    from fedjax_sparse.data import datasets
    if "dataset" in objects:
        pass
    elif isinstance(config.dataset, str) and config.dataset.startswith(datasets.NPZ_PREFIX):
        if not config.dataset[len(datasets.NPZ_PREFIX):]:
            raise RunError(f"{arg('dataset', config.dataset, quote=True)} names no file; pass npz:PATH, e.g. "
                           "npz:/data/mine.npz")
    elif config.dataset not in datasets.DATASETS:
        raise RunError(f"unknown dataset {config.dataset!r}; valid datasets: {', '.join(datasets.DATASETS)}, "
                       "or npz:PATH for your own .npz file")
    from fedjax_sparse.algorithms.compose import WRAPPER_AGGREGATORS, WRAPPER_ATTACKS
    choices: tuple[tuple[str, Any, tuple], ...] = (("preprocess", config.preprocess, PREPROCESSING),
        ("client_parallelism", ex.client_parallelism, CLIENT_PARALLELISM),
        ("aggregator", config.aggregator, (None, *WRAPPER_AGGREGATORS)),
        ("attack", config.attack, (None, *WRAPPER_ATTACKS)),
        ("personal_eval", ex.personal_eval, PERSONAL_EVAL_MODES), ("client_state", ex.client_state, CLIENT_STATES),
        ("client_storage", ex.client_storage, CLIENT_STORAGE))
    for name, choice, valid in choices:
        if choice not in valid:
            raise RunError(f"unknown {arg(name, choice, quote=True)}; valid: {', '.join(v for v in valid if v)}")
    if config.attack is not None and not 0.0 < config.malicious_fraction < 1.0:
        raise RunError(f"{arg('attack')} needs {arg('malicious_fraction')} in (0, 1), got {config.malicious_fraction}")
    if config.attack is not None and math.floor(config.malicious_fraction * config.num_clients) == 0:
        raise RunError(f"{arg('malicious_fraction', config.malicious_fraction)} of "
                       f"{arg('num_clients', config.num_clients)} makes no client malicious; raise it to at least "
                       f"{1 / config.num_clients:.3g}")
    options = None if "algorithm" in objects else algorithm_option_values(config.algorithm, config.options)
    check_sampling(config)
    check_privacy(config)
    if not 0.0 <= config.trim_fraction < 0.5:
        raise RunError(f"{arg('trim_fraction')} must be in [0, 0.5), got {config.trim_fraction}")
    from fedjax_sparse.driver.sinks import parse_log
    parse_log(ex.log)
    if ex.client_storage != "float32" and ex.client_state != "host":
        raise RunError(f"{arg('client_storage', ex.client_storage)} stores the clients' rows on the host: add "
                       f"{arg('client_state', 'host')}")
    if ex.client_state == "host" and ex.client_parallelism == "measure":
        raise RunError(f"{arg('client_parallelism', 'measure')} times rounds on the all-resident state; with "
                       f"{arg('client_state', 'host')} choose auto, vmap or map")
    if options is None:
        if config.options:
            raise RunError(f"{arg('option')} sets a named algorithm's options; an algorithm given as an object has its "
                           "options already: drop RunConfig.options")
        return None
    resolved = resolve_options(config.algorithm, options)   # typed and checked: the registry's dataclass
    check_wrappers(config, resolved)
    return resolved


def algorithm_option_values(algorithm: str, options: dict) -> dict:
    """``options`` of the registered ``algorithm`` (texts or values) typed as its options dataclass declares
    them, as the data sets' and models' are (``schema.resolve``); a one-line RunError, in its reader's
    words, for an unknown key (listing the valid ones) or a value of another type."""
    fields = dataclasses.fields(algorithm_options(algorithm))
    schema = {f.name: Option(type(f.default), f.default) for f in fields}
    unknown = sorted(set(options) - set(schema))
    if unknown:
        raise RunError(f"unknown option(s) {unknown} for algorithm {algorithm!r} ({arg('option', 'KEY=VALUE')}); "
                       f"valid options: {listing(schema)}")
    try:
        return resolve(schema, options, arg("option"), f"algorithm {algorithm}")
    except ValueError as e:
        raise RunError(str(e)) from None


def check_sampling(config: RunConfig) -> None:
    """One-line RunError for a client sampling the run cannot take (which algorithms can is decided
    when the algorithm is built: ``Algorithm.varying_cohort``)."""
    from fedjax_sparse.core.engine import CLIENT_SAMPLINGS
    if config.client_sampling not in CLIENT_SAMPLINGS:
        raise RunError(f"unknown {arg('client_sampling', config.client_sampling, quote=True)}; valid: "
                       f"{', '.join(CLIENT_SAMPLINGS)}")
    if config.client_sampling != "poisson":
        return
    fixed = [arg(name) for name, given in (("cohort_schedule", config.cohort_schedule),
                                           ("resample_every", config.resample_every != 1),
                                           ("aggregator", config.aggregator is not None),
                                           ("attack", config.attack is not None)) if given]
    if fixed:
        raise RunError(f"{arg('client_sampling', 'poisson')} draws a cohort of varying size every round, which "
                       f"{' and '.join(fixed)} cannot take (fixed cohorts of K / robust aggregation over K rows); "
                       f"drop {' and '.join(fixed)} or use {arg('client_sampling', 'fixed')}")


DP_ACCOUNTANTS = ("auto", "rdp", "pld")


def resolved_dp_accountant(dp_accountant: str | None, client_sampling: str | None) -> str:
    """The accountant a run uses: ``auto`` (and a config without the field) is PLD for Poisson sampling,
    where it is the tighter, and RDP for fixed K of N, which dp-accounting's PLD does not support."""
    if dp_accountant in (None, "auto"):
        return "pld" if client_sampling == "poisson" else "rdp"
    return str(dp_accountant)


def check_privacy(config: RunConfig) -> None:
    """One-line RunError for an incomplete or inapplicable differential-privacy setting."""
    given = [arg(name) for name in ("dp_noise_multiplier", "dp_target_epsilon") if getattr(config, name) is not None]
    clip = arg("dp_clip")
    if config.dp_clip is None:
        if given:
            raise RunError(f"{' and '.join(given)} need {arg('dp_clip', 'C')} (the L2 norm each client's update is "
                           "clipped to)")
        return
    if not (isinstance(config.dp_clip, (int, float)) and 0 < config.dp_clip < math.inf):
        raise RunError(f"{clip} must be a positive finite number, got {config.dp_clip!r}")
    if len(given) != 1:
        raise RunError(f"{clip} needs exactly one of {arg('dp_noise_multiplier', 'Z')} (noise Z * C on the sum of the "
                       f"clipped updates) or {arg('dp_target_epsilon', 'E')} (Z calibrated to reach E after "
                       f"{arg('rounds')})")
    for name, value, ok, bound in (("dp_noise_multiplier", config.dp_noise_multiplier, lambda v: v >= 0, ">= 0"),
                                   ("dp_target_epsilon", config.dp_target_epsilon, lambda v: v > 0, "> 0"),
                                   ("dp_delta", config.dp_delta, lambda v: 0 < v < 1, "in (0, 1)")):
        if value is not None and not ok(value):
            raise RunError(f"{arg(name)} must be {bound}, got {value}")
    if config.dp_accountant not in DP_ACCOUNTANTS:
        raise RunError(f"unknown {arg('dp_accountant', config.dp_accountant, quote=True)}; valid: "
                       f"{', '.join(DP_ACCOUNTANTS)}")
    if config.dp_accountant == "pld" and config.client_sampling != "poisson":
        raise RunError(f"{arg('dp_accountant', 'pld')} accounts Poisson sampling only (dp-accounting's PLD does not "
                       f"support K of N without replacement); add {arg('client_sampling', 'poisson')} or use "
                       f"{arg('dp_accountant', 'rdp')}")
    if config.cohort_schedule or config.resample_every != 1:
        raise RunError(f"{clip} accounts for a fresh cohort of K of N clients sampled every round; drop "
                       f"{arg('cohort_schedule')} / {arg('resample_every')}")
    if config.aggregator is not None:
        raise RunError(f"{clip} and {arg('aggregator')}: a robust aggregator inside DP-FedAvg would see K identical "
                       "private rows; drop one")
    if isinstance(config.algorithm, str) and config.algorithm in algorithm_names():
        from fedjax_sparse.algorithms.private import dp_refusal
        reason = dp_refusal(config.algorithm, algorithm_option_values(config.algorithm, config.options))
        if reason is not None:
            raise RunError(f"{clip}: {reason}")


def wrappable_algorithms() -> list[str]:
    """The registered algorithms (with their default options) that ``--aggregator`` and ``--attack`` can
    wrap: those whose clients send float updates (see ``register_algorithm(..., unwrappable=)``)."""
    return [name for name in algorithm_names() if wrapper_refusal(name) is None]


def check_wrappers(config: RunConfig, options) -> None:
    """One-line RunError when the aggregator / attack cannot wrap the named algorithm with these options,
    from what the algorithm declares (its clients' messages), before anything is built."""
    given = [(name, value) for name, value in (("aggregator", config.aggregator), ("attack", config.attack))
             if value is not None]
    if not given:
        return
    reason = wrapper_refusal(config.algorithm, options)
    if reason is None:
        return
    wrappers = " and ".join(arg(name, value) for name, value in given)
    names = " and ".join(arg(name) for name, _ in given)
    raise RunError(f"{wrappers} cannot wrap {config.algorithm}: {reason}; drop {names}, or wrap an algorithm "
                   f"whose clients send float updates: {', '.join(wrappable_algorithms())}")
