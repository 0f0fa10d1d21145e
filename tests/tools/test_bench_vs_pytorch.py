"""The plain PyTorch SpaFL of experiments/tools/torch_spafl.py (the reference loop of
experiments/bench/bench_vs_pytorch.py): its mask rule, straight-through gradient, reset rule, eq. (13),
weight layouts and a tiny end-to-end run. Skipped where torch is not installed (pip install -e .[bench])."""
import json

import numpy as np
import pytest

from helpers import load_script

torch = pytest.importorskip("torch")
torch_spafl = load_script("tools/torch_spafl.py")


def two_row_layer(tau=(0.5, 0.5)):
    layer = torch_spafl.MaskedLayer((2, 3), "linear")
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.1, -0.1, 0.1], [1.0, -1.0, 1.0]]))   # mean |w|: 0.1 and 1.0
        layer.threshold.copy_(torch.tensor(tau))
    return layer


def test_a_row_whose_mean_abs_weight_is_below_its_threshold_is_zeroed_the_other_kept():
    layer = two_row_layer()
    layer.train()
    out = layer(torch.ones(1, 3))
    assert out.tolist() == [[0.0, 1.0]]
    assert layer.kept == 0.5
    # Eval masks the same way.
    layer.eval()
    assert torch.equal(layer.masked_weight()[0], torch.zeros(3))
    assert torch.equal(layer.masked_weight()[1], torch.tensor([1.0, -1.0, 1.0]))


def test_straight_through_gradient_reaches_the_thresholds_of_kept_and_pruned_rows():
    layer = two_row_layer()
    layer.train()
    layer(torch.ones(1, 3)).sum().backward()
    # d out_i / d tau_i = -(sum_j w_ij x_j) through the identity estimator, pruned row included.
    assert torch.allclose(layer.threshold.grad, torch.tensor([-0.1, -1.0]))


def test_reset_rule_zeroes_thresholds_after_a_forward_that_kept_at_most_one_percent():
    layer = two_row_layer(tau=(5.0, 5.0))
    layer.train()
    assert layer(torch.ones(1, 3)).tolist() == [[0.0, 0.0]] and layer.kept == 0.0
    layer.eval()   # evaluation applies the reset without writing it back
    assert torch.allclose(layer(torch.ones(1, 3)), torch.tensor([[0.1, 1.0]]))
    assert layer.threshold.tolist() == [5.0, 5.0]
    layer.train()  # the next training forward resets them
    assert torch.allclose(layer(torch.ones(1, 3)), torch.tensor([[0.1, 1.0]]))
    assert layer.threshold.tolist() == [0.0, 0.0] and layer.kept == 1.0


def test_eq13_moves_each_row_by_one_sign_and_the_fan_in():
    layer = torch_spafl.MaskedLayer((2, 2, 1, 2), "conv", "fan_in")   # fan_in 4, kernel area 2
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[[[1.0, 1.0]], [[1.0, -2.5]]], [[[-1.0, 0.5]], [[0.0, 0.0]]]]))
    before = layer.weight.detach().clone()
    layer.eq13_(torch.tensor([0.4, 0.4]))
    # Row 0 sums to 0.5 > 0: every weight -= 0.1; row 1 sums to -0.5 < 0: += 0.1.
    assert torch.allclose(layer.weight - before, torch.tensor([-0.1, 0.1]).view(2, 1, 1, 1).expand(2, 2, 1, 2))
    assert torch_spafl.MaskedLayer((2, 2, 1, 2), "conv", "kernel_area").eq13_divisor == 2.0


def test_init_params_from_the_project_layouts(tmp_path):
    rng = np.random.default_rng(0)
    k = {"conv1": rng.normal(size=(5, 5, 1, 20)), "conv2": rng.normal(size=(5, 5, 20, 50)),
         "fc1": rng.normal(size=(800, 500)), "fc2": rng.normal(size=(500, 10))}
    path = tmp_path / "init.npz"
    np.savez(path, **{f"params/{n}/kernel": v for n, v in k.items()})
    w = torch_spafl.load_init_params(path)
    assert w["conv2"][7, 3, 1, 2] == k["conv2"][1, 2, 3, 7]   # HWIO -> OIHW
    # fc1: the project's input (h, w, c) -> PyTorch's flattening of NCHW (c, h, w).
    h, ww, c, o = 2, 3, 41, 123
    assert w["fc1"][o, c * 16 + h * 4 + ww] == k["fc1"][(h * 4 + ww) * 50 + c, o]
    assert w["fc2"].shape == (10, 500)


def test_tiny_end_to_end_run(tmp_path, capsys):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "data.npz", train_x=rng.integers(0, 256, (40, 28, 28), dtype=np.uint8),
             train_y=rng.integers(0, 10, 40), test_x=rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
             test_y=rng.integers(0, 10, 12))
    (tmp_path / "partition.json").write_text(json.dumps({"clients": [
        {"client": 0, "train_indices": list(range(0, 25)), "test_indices": list(range(0, 6))},
        {"client": 1, "train_indices": list(range(25, 40)), "test_indices": list(range(6, 12))}]}))
    (tmp_path / "cohorts.json").write_text(json.dumps({"rounds": [[1], [0]]}))
    shapes = {"conv1": (5, 5, 1, 20), "conv2": (5, 5, 20, 50), "fc1": (800, 500), "fc2": (500, 10)}
    np.savez(tmp_path / "init_params.npz",
             **{f"params/{n}/kernel": rng.uniform(-0.05, 0.05, s).astype(np.float32) for n, s in shapes.items()})
    assert torch_spafl.main(["--inputs", str(tmp_path), "--rounds", "2", "--epochs", "1", "--batch-size", "8",
                             "--threads", "1", "--fixed-batch-steps", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["examples"] for r in result["rounds"]] == [15, 25]
    assert all(np.isfinite(r["loss"]) and r["train_seconds"] > 0 for r in result["rounds"])
    assert len(result["fixed_batch_ce"]) == 2 and np.array(result["init_logits"]).shape == (8, 10)
