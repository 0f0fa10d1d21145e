"""SpaFL and a layer that starts fully pruned (a zero-initialised classifier head): refused in one line,
trained with ``dense_layers``, which keeps the layer dense in the masks, the bits, the FLOPs and the density."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import make_algorithm
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import make_model
from fedjax_sparse.algorithms import spafl_family as spafl  # fjs.algorithms.spafl is the builder

from helpers import make_task, tiny_federated
from test_spafl import SIZES, one_client


def zero_head(model, layer="fc2"):
    """``model`` with ``layer``'s kernel initialised to 0 (ViT's ``nn.Dense(classes, kernel_init=zeros)``)."""
    def init(key):
        variables = model.init(key)
        params = dict(variables["params"])
        params[layer] = {**params[layer], "kernel": jnp.zeros_like(params[layer]["kernel"])}
        return {**variables, "params": params}
    return dataclasses.replace(model, name=model.name + "_zero_head", init_fn=init)


def zero_head_task(data, **overrides):
    return make_task(data, model=zero_head(make_model("cnn_small", data.input_shape, data.num_classes)),
                     **overrides)


@pytest.mark.fast
def test_zero_initialised_head_is_refused_in_one_line_naming_layer_and_fix():
    _, data = tiny_federated(SIZES)
    with pytest.raises(ValueError) as err:
        make_algorithm("spafl", zero_head_task(data))
    message = str(err.value)
    assert "\n" not in message
    assert "layer(s) fc2 of model cnn_small_zero_head start fully pruned" in message
    assert "--option dense_layers=fc2" in message
    # The aliases refuse it too; the fix offered names the layers already kept dense as well.
    with pytest.raises(ValueError, match="dense_layers=fc1,fc2"):
        two_dead = zero_head(zero_head(make_model("cnn_small", data.input_shape, data.num_classes)), "fc1")
        make_algorithm("spafl_no_eq13", make_task(data, model=two_dead), {"dense_layers": "fc1"})
    # A normally initialised model is not refused.
    make_algorithm("spafl", make_task(data))


def test_without_the_refusal_the_zero_head_never_trains(monkeypatch):
    """What the refusal prevents: every fc2 row is pruned from round 0 on, fc2 stays exactly 0."""
    _, data = tiny_federated(SIZES)
    monkeypatch.setattr(spafl, "check_no_dead_layers", lambda *args: None)
    alg = make_algorithm("spafl", zero_head_task(data, batch_size=16, local_epochs=2))
    engine = Engine(alg, data.num_clients, 3)
    state = engine.init(jax.random.PRNGKey(1))
    before = engine.evaluate(state, data)["accuracy"]
    state, metrics = engine.run_rounds(state, data, 4)
    assert float(jnp.abs(state.clients.params["fc2"]["kernel"]).max()) == 0.0
    assert float(np.asarray(state.clients.kept["fc2"]).max()) == 0.0
    assert float(metrics["density"][0]) == pytest.approx(2 / 3)     # conv1, fc1 kept; fc2 pruned
    assert engine.evaluate(state, data)["accuracy"] == before        # zero logits: always class 0


@pytest.mark.fast
def test_dense_layers_option_is_checked():
    _, data = tiny_federated(SIZES)
    task = make_task(data)
    with pytest.raises(ValueError, match="dense_layers='fc9': fc9 is not a layer SpaFL thresholds in model "
                                         "cnn_small; valid: conv1, fc1, fc2"):
        make_algorithm("spafl", task, {"dense_layers": "fc9"})
    with pytest.raises(ValueError, match="nothing left to prune"):
        make_algorithm("spafl", task, {"dense_layers": "conv1, fc1,fc2"})
    assert make_algorithm("spafl", task, {"dense_layers": " fc2 ,"}).hparams["thresholded_layers"] == ["conv1", "fc1"]


def test_dense_head_trains_in_the_engine_and_sends_no_threshold_for_it():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("spafl", zero_head_task(data, batch_size=16, local_epochs=2), {"dense_layers": "fc2"})
    # cnn_small on 8x8x1, 4 classes: conv1 16 rows, fc1 64 rows; fc2 (4 rows) has no threshold.
    assert alg.hparams["num_thresholds"] == 16 + 64
    assert alg.hparams["thresholded_layers"] == ["conv1", "fc1"]
    engine = Engine(alg, data.num_clients, 3)
    state0 = engine.init(jax.random.PRNGKey(1))
    assert set(state0.server.tau) == {"conv1", "fc1"} and set(state0.clients.tau) == {"conv1", "fc1"}
    before = engine.evaluate(state0, data)["accuracy"]
    state, metrics = engine.run_rounds(state0, data, 4)
    assert float(jnp.abs(state.clients.params["fc2"]["kernel"]).max()) > 1e-3      # the head trained
    np.testing.assert_array_equal(metrics["uplink_bits"], 3 * 32 * 80)               # 3 clients x 80 thresholds
    np.testing.assert_array_equal(metrics["downlink_bits"], 3 * 32 * 80)
    assert float(metrics["loss"][-1]) < float(metrics["loss"][0])
    after = engine.evaluate(state, data)["accuracy"]
    # Zero logits: every prediction is class 0 before training (0.27; chance 0.25); measured 0.77 after 4 rounds.
    assert after > 0.6 and after > before + 0.3


def test_dense_head_counts_as_kept_in_density_and_dense_in_flops_by_hand():
    """One step on client 0 (10 samples, batch 16) with fc1 half pruned by the broadcast thresholds:
    density = mean(conv1 1, fc1 0.5, fc2 1 (dense)); FLOPs = 3 x 10 x sum_l 2 MACs_l x kept_l with fc2 at
    its dense cost, plus one eq. (13) update of the thresholded weights only (1.5 x (144 + 256 x 64))."""
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("spafl", zero_head_task(data, batch_size=16, lr=1e-4),
                         {"alpha": 0.0, "dense_layers": "fc2"})
    server, _ = alg.init(jax.random.PRNGKey(0))
    server = server._replace(tau={**server.tau, "fc1": server.tau["fc1"].at[::2].set(5.0)})
    _, msg, m = one_client(alg, cid=0, round_=1, data=data, server=server)
    assert set(msg) == {"conv1", "fc1"}
    assert float(m["density"]) == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    macs = {"conv1": 8 * 8 * 9 * 16, "fc1": 256 * 64, "fc2": 64 * 4}
    kept = {"conv1": 1.0, "fc1": 0.5, "fc2": 1.0}
    want = 3 * 10 * sum(2 * macs[n] * kept[n] for n in macs) + 1.5 * (9 * 16 + 256 * 64)
    assert float(m["flops"]) == pytest.approx(want, rel=1e-6)
    assert float(m["uplink_bits"]) == float(m["downlink_bits"]) == 32 * 80
