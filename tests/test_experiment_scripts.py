"""The experiment scripts' reported quantities (on hand-made rows) and a tiny end-to-end run."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import feddrop_fmnist  # noqa: E402
import fsl_mnist  # noqa: E402


def row(r, acc, gbytes, tflops):
    bits = gbytes * 1e9 * 8
    return dict(round=r, global_accuracy=acc, total_uplink_bits=bits / 2, total_downlink_bits=bits / 2,
                total_flops=tflops * 1e12)


ROWS = [row(1, 0.5, 1.0, 2.0), row(2, 0.79, 2.0, 4.0), row(3, 0.81, 3.0, 6.0), row(4, 0.86, 4.5, 8.0)]


def test_cost_to_target_is_the_first_round_reaching_the_target_within_the_budget():
    assert feddrop_fmnist.cost_to_target(ROWS, 0.80) == (6e12, 3e9, 3)
    assert feddrop_fmnist.cost_to_target(ROWS, 0.85, budget_bytes=5e9) == (8e12, 4.5e9, 4)
    # 85 % comes only after the 4 GB budget is spent: not reached.
    assert feddrop_fmnist.cost_to_target(ROWS, 0.85, budget_bytes=4e9) is None
    assert feddrop_fmnist.cost_to_target(ROWS, 0.90) is None


def test_table_takes_each_methods_cheapest_configuration():
    slow = [row(1, 0.5, 1.0, 3.0), row(2, 0.82, 2.0, 9.0)]
    table = feddrop_fmnist.compute_table({"fedavg": {"E1": ROWS, "E2": slow}, "unidrop": {"E1": slow[:1]}},
                                         [0.80], [8.0])
    assert table[(0.80, 8.0)]["fedavg"] == (6.0, "E1")
    assert table[(0.80, 8.0)]["unidrop"] is None


def test_fsl_script_runs_reports_and_skips_finished_runs(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--dataset", "digits", "--num-clients", "8", "--clients-per-round", "2",
            "--rounds", "2", "--local-epochs", "1", "--eval-every", "1", "--tables", "table1",
            "--methods", "fsl", "signsgd", "--quiet"]
    assert fsl_mnist.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())["table1"]
    for method in ("fsl", "signsgd"):
        ours = results[method]["ours"]
        summary = json.loads((tmp_path / method / "seed0" / "summary.json").read_text())
        assert ours["rounds"] == 2 and ours["accuracy"] == pytest.approx(summary["final_accuracy"])
        assert ours["accuracy_std_over_clients"] == pytest.approx(summary["final_accuracy_std"])
    # Learning: 10 digits (chance 0.1); FSL reaches 0.27 after these 2 rounds (measured).
    assert results["fsl"]["ours"]["accuracy"] > 0.2
    # Rankings cost the same both ways; SignSGD uploads 1 bit and downloads 32 bits per weight.
    assert results["fsl"]["ours"]["upload_mb"] == pytest.approx(results["fsl"]["ours"]["download_mb"])
    assert results["signsgd"]["ours"]["download_mb"] == pytest.approx(32 * results["signsgd"]["ours"]["upload_mb"])
    assert results["topk10"]["ours"] is None
    capsys.readouterr()
    assert fsl_mnist.main(argv) == 0
    assert capsys.readouterr().out.count("[skip]") == 2
