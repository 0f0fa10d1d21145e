"""BatchNorm in federated runs (issue 50 item 5): running statistics that a run's few local steps cannot
move away from their initial values are named at build time, in one line, with the momentum that fixes it."""
import warnings

import flax.linen as nn
import pytest
from flax import nnx

import fedjax_sparse as fjs
from fedjax_sparse.errors import ModelWarning
from fedjax_sparse.driver.experiment import batch_norm_lag, build
from fedjax_sparse.models import from_flax, make_model


class Net(nn.Module):
    momentum: float = 0.99   # Flax's default

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(8, (3, 3), padding="SAME", name="conv")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=self.momentum, name="bn")(x))
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5, name="bn2")(nn.Conv(8, (3, 3))(x)))
        return nn.Dense(10, name="out")(x.reshape(x.shape[0], -1))


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.95, rngs=rngs)
        self.out = nnx.Linear(4 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.conv(x))).reshape(x.shape[0], -1))


# digits: 20 clients of about 70 training examples, batch 32: 3 local steps a round with one local epoch.
DIGITS = dict(algorithm="fedavg", dataset="digits", num_clients=20, clients_per_round=5, local_epochs=1, rounds=10)


def test_models_say_how_slowly_their_batch_norm_statistics_follow():
    """Model.batch_norm_momentum: the slowest BatchNorm's Flax momentum (linen and nnx read from the modules),
    0.9 for the zoo's BatchNorm (PyTorch momentum 0.1)."""
    assert from_flax(Net(), (8, 8, 1)).batch_norm_momentum == 0.99
    assert from_flax(NnxNet(nnx.Rngs(0)), (8, 8, 1)).batch_norm_momentum == 0.95
    assert make_model("cnn7", (32, 32, 3), 10).batch_norm_momentum == 0.9


def test_lagging_statistics_are_named_at_build_with_the_fix():
    """Flax's default momentum 0.99 over 3 local steps a round keeps 0.99^30 = 74 % of the initial statistics
    at round 10: one ModelWarning with the momentum that brings them under 10 % (0.1^(1/30) = 0.926); 0.9 keeps
    4 % and builds silently; a personal model's statistics move only in the K/N rounds its client trains."""
    with pytest.warns(ModelWarning) as caught:
        exp = build(fjs.RunConfig(**DIGITS), model=Net())
    message = str(caught[0].message)
    assert "\n" not in message and message.startswith(
        "BatchNorm running statistics lag this run: momentum 0.99 over about 3 local steps a round keeps 74% of "
        "their initial values at round 10, the last evaluation (97% at round 1)")
    assert "use a BatchNorm momentum of 0.92 or lower (Flax: nn.BatchNorm(momentum=...))" in message
    assert message.endswith("docs/design.md, 'BatchNorm in federated runs'")
    fixed = from_flax(Net(momentum=0.9), (8, 8, 1), num_classes=10)
    assert fixed.batch_norm_momentum == 0.9
    assert batch_norm_lag(fixed, exp.algorithm, exp.data, exp.config) is None          # 0.9 ** 30 = 4 %
    longer = fjs.RunConfig(**{**DIGITS, "local_epochs": 10})                           # 30 steps a round
    assert batch_norm_lag(exp.model, exp.algorithm, exp.data, longer) is None          # 0.99 ** 300 = 5 %
    with pytest.warns(ModelWarning, match="momentum 0.9 over about 3 local steps a round keeps 45%"):
        personal = build(fjs.RunConfig(**{**DIGITS, "algorithm": "local"}), model=Net(momentum=0.9))
    assert personal.algorithm.personal_predict is not None
    assert "keeps 45% of their initial values at round 10" in batch_norm_lag(   # 0.9 ** (3 * 10 * 5 / 20)
        fixed, personal.algorithm, personal.data, personal.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelWarning)
        build(fjs.RunConfig(**DIGITS))   # no BatchNorm in the digits default model: nothing to say
