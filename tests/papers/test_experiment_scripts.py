"""The experiment scripts' reported quantities (on hand-made rows), a tiny end-to-end run, and the
rule that no script imports another (shared code lives in the package)."""
import ast
import json

import pytest
from helpers import EXPERIMENTS, load_script

feddrop_fmnist = load_script("reproduce/feddrop_fmnist.py")
fsl_mnist = load_script("reproduce/fsl_mnist.py")


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


def test_feddrop_paper_unit_is_forward_macs_per_example():
    """Our FLOPs (2 per MAC, training = 3 x forward) / 6 = the FedDrop paper's unit (forward MACs):
    hand count of the Table 6 CNN, then the paper's Table 5 (r = 0.5, R = 100, E = 8, 100 clients
    holding FMNIST's 60,000 training images: 281.85 expected TFLOPs). A factor 2 gives 843.8."""
    from fedjax_sparse.core.accounting import layer_forward_flops
    from fedjax_sparse.models import make_model
    model = make_model("feddrop_fmnist_cnn", (28, 28, 1), 10)
    # Forward MACs per image: out positions x out channels x kernel x in channels, then the dense layers.
    macs = (28 * 28 * 32 * 5 * 5 * 1 + 14 * 14 * 64 * 5 * 5 * 32 + 5 * 5 * 64 * 3 * 3 * 64
            + 256 * 512 + 512 * 10)
    assert macs == model.forward_macs == 11_720_192
    examples = 60_000 * 8 * 100
    ours = 0.5 * examples * 3 * float(layer_forward_flops(model).sum())  # the engine's convention
    assert ours == 0.5 * examples * 6 * macs
    paper_tflops = feddrop_fmnist.to_paper_unit(ours) / 1e12
    assert paper_tflops == pytest.approx(0.5 * examples * macs / 1e12, rel=1e-12)  # 281.28
    assert paper_tflops == pytest.approx(281.85, rel=5e-3)

    # The report shows both units: a run with 6 TFLOPs (ours) is 1 TFLOP in the paper's unit, and the
    # paper's FedAvg 30.54 (80 %, 8 GB) is 183.24 in ours.
    table = feddrop_fmnist.compute_table({"fedavg": {"E1": ROWS}}, [0.80], [8.0])
    text = feddrop_fmnist.format_table(table, ["fedavg"], "full")
    ours_part, paper_part = text.split(f"## {feddrop_fmnist.UNIT_PAPER}")
    assert f"## {feddrop_fmnist.UNIT_OURS}" in ours_part
    assert "| 80% | 8 GB | 6.00 [E1] |" in ours_part and "| 183.24 |" in ours_part
    assert "| 80% | 8 GB | 1.00 [E1] |" in paper_part and "| 30.54 |" in paper_part


def _metrics_row(r, acc, up, down, flops):
    return dict(round=r, accuracy=acc, total_uplink_bits=up, total_downlink_bits=down, total_flops=flops)


def test_spafl_table2_rows_come_from_the_recorded_runs(tmp_path):
    # Table 2 is assembled from runs; on hand-made runs every cell is checkable by hand.
    spafl_table2 = load_script("reproduce/spafl_table2.py")
    results = tmp_path / "results"
    (results / "vs_authors").mkdir(parents=True)
    recorded = dict(seeds=[0], rounds=[500], best_acc=[0.9], final_acc=[0.89], gbit=[0.1856],
                    flops_paper_convention=[2.5e11], density_at_best=[0.38])
    (results / "results_spafl_variants.json").write_text(json.dumps({"spafl": recorded}))
    for seed, accs in ((1, [20.0, 40.0]), (2, [30.0, 60.0])):
        rows = [dict(round=r + 1, accuracy=a) for r, a in enumerate(accs)]
        (results / "vs_authors" / f"ours_seed{seed}.json").write_text(json.dumps({"rows": rows}))
    for seed, rows in ((0, [_metrics_row(5, 0.6, 10**9, 3 * 10**9, 4e12), _metrics_row(10, 0.8, 2 * 10**9, 6 * 10**9, 8e12),
                            _metrics_row(15, 0.7, 3 * 10**9, 9 * 10**9, 12e12)]),
                       (1, [_metrics_row(5, 0.5, 10**9, 3 * 10**9, 4e12), _metrics_row(10, 0.9, 2 * 10**9, 6 * 10**9, 8e12),
                            _metrics_row(15, 0.9, 3 * 10**9, 9 * 10**9, 12e12)])):
        run = results / "baselines_cpu" / "heterofl" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"config": {"num_clients": 100}}))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a diverged seed (fedjax_sparse.papers.studies.run_one's marker) is counted apart, not averaged in
    run = results / "baselines_cpu" / "heterofl" / "seed2"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": {"num_clients": 100}}))
    (run / "metrics.jsonl").write_text(json.dumps(_metrics_row(5, 0.1, 10**9, 3 * 10**9, 4e12)) + "\n")
    (run / "diverged.json").write_text(json.dumps({"error": "training diverged: the loss is NaN/inf at round 1"}))
    assert spafl_table2.main(["--results", str(results)]) == 0
    table = json.loads((results / "table2.json").read_text())
    assert set(table) == {"spafl", "heterofl"}
    het = table["heterofl"]
    assert het["seeds"] == [0, 1] and het["rounds"] == [15, 15] and het["diverged_seeds"] == [2]
    assert het["best_acc"] == [0.8, 0.9] and het["final_acc"] == [0.7, 0.9]
    assert het["gbit"] == [12.0, 12.0]                       # (3 + 9) * 10^9 bits
    assert het["flops_paper_convention"] == [6e10, 6e10]     # 12e12 / (2 x 100 clients)
    text = (results / "table2.md").read_text()
    assert "| HeteroFL | 2 (+1 diverged) | 15 | 85.00 ± 5.00 | 80.00 ± 10.00 | 85.97 ± 0.20 | 12.00 ± 0.00 | 68.88 |" \
        in text
    assert "| SpaFL | 1 | 500 | 90.00 | 89.00 |" in text
    assert (results / "fig2a_learning_curves.png").stat().st_size > 0


def test_spafl_table2_prefers_spafl_runs_with_whole_curves(tmp_path):
    # The H100 SpaFL record has no per-round metrics (its curve is the 50-round band); a CPU run
    # under spafl_cpu/ has every evaluated round, so it gives the SpaFL row and its whole curve.
    spafl_table2 = load_script("reproduce/spafl_table2.py")
    results = tmp_path / "results"
    results.mkdir()
    recorded = dict(seeds=[0], rounds=[500], best_acc=[0.9], final_acc=[0.89], gbit=[0.1856],
                    flops_paper_convention=[2.5e11], density_at_best=[0.38])
    (results / "results_spafl_variants.json").write_text(json.dumps({"spafl": recorded}))
    run = results / "spafl_cpu" / "spafl" / "seed0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": {"num_clients": 100}}))
    rows = [_metrics_row(5, 0.5, 10**6, 10**6, 2e12), _metrics_row(10, 0.75, 2 * 10**6, 2 * 10**6, 4e12)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table, curves = spafl_table2.build(results)
    spafl = table["spafl"]
    assert spafl["source"] == "spafl_cpu/spafl/seed*" and spafl["seeds"] == [0] and spafl["rounds"] == [10]
    assert spafl["best_acc"] == [0.75] and spafl["gbit"] == [0.004] and spafl["flops_paper_convention"] == [2e10]
    (rounds, acc), = curves["spafl"]
    assert rounds.tolist() == [5, 10] and acc.tolist() == [50.0, 75.0]


def test_a_diverging_run_is_recorded_and_the_study_goes_on(tmp_path, capsys):
    # FjORD's seed 1 at Table 7's lr diverged at round 1 and the script used to die with a traceback,
    # taking the runs after it along. Now: diverged.json, the next method runs, the report counts it.
    from fedjax_sparse.papers import studies
    base = dict(dataset="digits", model="mlp", num_clients=6, clients_per_round=3, local_epochs=1, batch_size=32,
                partition="iid", eval_every=1, min_client_samples=1)
    study = dict(title="divergence", base=base, rounds=2, default_methods=["blowup", "fine"], paper={},
                 methods={"blowup": dict(algorithm="fedavg", lr=1e9), "fine": dict(algorithm="fedavg", lr=0.1)})
    argv = ["--out", str(tmp_path), "--seeds", "0", "--quiet"]
    assert studies.main(argv, studies={"s": study}, default_study="s") == 0
    printed = capsys.readouterr().out
    assert "[diverged] blowup seed 0: training diverged" in printed
    marker = json.loads((tmp_path / "blowup" / "seed0" / "diverged.json").read_text())
    assert marker["error"].startswith("training diverged") and marker["seed"] == 0
    assert (tmp_path / "fine" / "seed0" / "summary.json").exists()
    table = json.loads((tmp_path / "results.json").read_text())
    assert "blowup" not in table and table["fine"]["diverged_seeds"] == []
    assert "| blowup | 0 (+1 diverged) |" in (tmp_path / "results.md").read_text()
    # a rerun skips it instead of diverging again
    assert studies.main(argv, studies={"s": study}, default_study="s") == 0
    assert "blowup/seed0 diverged (diverged.json); delete the folder" in capsys.readouterr().out


@pytest.mark.slow   # about two minutes on 2 cores: one round of six methods on the 7-layer CNN
def test_spafl_cifar10_column_runs_all_six_methods_with_exact_costs(tmp_path, shared_data):
    # Table 2's CIFAR-10 configurations end to end on the CIFAR-10 sample (issue 13, item 5).
    import jax
    from fedjax_sparse.mechanisms.widths import WidthLayout
    from fedjax_sparse.models import make_model
    spafl_cifar = load_script("reproduce/spafl_cifar.py")
    methods = ["spafl", "fedavg", "local", "fedpm", "heterofl", "fjord"]
    assert spafl_cifar.main(["--study", "cifar10", "--dataset", "cifar10_sample", "--data-dir", str(shared_data),
                             "--num-clients", "40", "--clients-per-round", "2", "--rounds", "1",
                             "--local-epochs", "1", "--methods", *methods, "--seeds", "0", "--quiet",
                             "--out", str(tmp_path)]) == 0
    summary = {m: json.loads((tmp_path / m / "seed0" / "summary.json").read_text()) for m in methods}
    model = make_model("cnn7", (32, 32, 3), 10)
    variables = model.init(jax.random.PRNGKey(0))
    layout = WidthLayout.from_model(model, variables)
    kernels = sum(layer.num_weights for layer in model.layers)
    values = layout.num_values(layout.out_channels)   # kernels + BatchNorm scale/bias + running stats
    assert values == kernels + 4 * 640 and kernels == 804_800
    both = lambda s: s["total_uplink_bits"] + s["total_downlink_bits"]  # noqa: E731
    assert both(summary["fedavg"]) == 2 * 2 * 32 * values
    assert both(summary["heterofl"]) == 2 * 2 * 32 * layout.num_values(layout.static_counts(0.5))
    assert both(summary["spafl"]) == 2 * 2 * 32 * 650                         # thresholds only
    stats = 32 * 2 * 640                                # BatchNorm running means and variances, float32
    assert summary["fedpm"]["total_uplink_bits"] == 2 * (kernels + stats)      # one bit per weight
    assert summary["fedpm"]["total_downlink_bits"] == 2 * (32 * kernels + stats)
    assert 2 * 32 * layout.num_values(layout.static_counts(0.4)) <= summary["fjord"]["total_uplink_bits"] \
        <= 2 * 32 * layout.num_values(layout.static_counts(0.6)) == summary["fjord"]["total_downlink_bits"]
    assert both(summary["local"]) == 0


@pytest.mark.slow   # about 80 s on 2 cores: one round of the three baselines on a width-4 ResNet-18
def test_spafl_cifar100_column_runs_the_sparse_baselines_on_the_resnet(tmp_path, shared_data):
    # Table 2's CIFAR-100 baselines on the ResNet (residual width slicing) on the CIFAR-10 sample.
    import jax
    from fedjax_sparse.mechanisms.widths import WidthLayout
    from fedjax_sparse.models import make_model
    spafl_cifar = load_script("reproduce/spafl_cifar.py")
    methods = ["fedpm", "heterofl", "fjord"]
    assert spafl_cifar.main(["--study", "cifar100", "--dataset", "cifar10_sample", "--data-dir", str(shared_data),
                             "--num-clients", "4", "--clients-per-round", "2", "--rounds", "1",
                             "--local-epochs", "1", "--resnet-width", "4", "--methods", *methods, "--seeds", "0",
                             "--quiet", "--out", str(tmp_path)]) == 0
    summary = {m: json.loads((tmp_path / m / "seed0" / "summary.json").read_text()) for m in methods}
    model = make_model("resnet18_narrow", (32, 32, 3), 10, width=4)
    layout = WidthLayout.from_model(model, model.init(jax.random.PRNGKey(0)))
    both = lambda s: s["total_uplink_bits"] + s["total_downlink_bits"]  # noqa: E731
    # the p = 0.5 sub-model of the width-4 ResNet is the width-2 one (10 classes kept)
    half = make_model("resnet18_narrow", (32, 32, 3), 10, width=2).init(jax.random.PRNGKey(0))
    assert layout.num_values(layout.static_counts(0.5)) == sum(int(x.size) for x in jax.tree_util.tree_leaves(half))
    assert both(summary["heterofl"]) == 2 * 2 * 32 * layout.num_values(layout.static_counts(0.5))
    assert summary["fjord"]["total_downlink_bits"] == 2 * 32 * layout.num_values(layout.static_counts(0.6))
    kernels = sum(layer.num_weights for layer in model.layers)
    # running mean and variance of the stem's BN (4 channels), the 8 pre-activations (over the stream)
    # and the 8 inner BNs, at 32 bits; one bit per kernel entry
    stats = 32 * 2 * (4 + (4 + 4 + 4 + 8 + 8 + 16 + 16 + 32) + (4 + 4 + 8 + 8 + 16 + 16 + 32 + 32))
    assert summary["fedpm"]["total_uplink_bits"] == 2 * (kernels + stats)
    for m in methods:
        assert 0.0 <= summary[m]["final_accuracy"] <= 1.0


def test_compare_run_groups_by_hand(tmp_path):
    """Two project runs (accuracy as fractions, one evaluated every other round) and one
    authors'-code run (percent): round 2 has 40 and 60 -> mean 50, std sqrt(200); round 1
    only the first run (n 1, no std); the authors' group is read in percent as is."""
    compare_run_groups = load_script("tools/compare_run_groups.py")

    def ours(name, seed, accs):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"config": {"seed": seed}}))
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({"round": r, "accuracy": a, "density": 0.5, "seconds": float(r)}) + "\n"
            for r, a in accs))
        return folder

    a = ours("a", 1, [(1, 0.30), (2, 0.40)])
    b = ours("b", 2, [(2, 0.60)])
    auth = tmp_path / "auth"
    auth.mkdir()
    (auth / "curve.json").write_text(json.dumps({"seed": 1, "rounds": [
        {"round": 1, "accuracy": 20.0, "density": 0.9}, {"round": 2, "accuracy": 25.0, "density": 0.8}]}))
    out = tmp_path / "cmp" / "table"
    compare_run_groups.main(["--group", "ours", str(a), str(b), "--group", "theirs", str(auth),
                             "--rounds", "1", "2", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    ours_stats, theirs = result["groups"][0]["accuracy"], result["groups"][1]["accuracy"]
    assert ours_stats["1"] == {"n": 1, "mean": pytest.approx(30.0), "std": None}
    assert ours_stats["2"]["n"] == 2 and ours_stats["2"]["mean"] == pytest.approx(50.0)
    assert ours_stats["2"]["std"] == pytest.approx(200 ** 0.5)
    assert theirs["2"] == {"n": 1, "mean": 25.0, "std": None}
    table = out.with_suffix(".md").read_text()
    assert "| ours | 30.0 (1) | 50.0 ± 14.1 (2) |" in table and "| theirs | 20.0 (1) | 25.0 (1) |" in table
    with pytest.raises(FileNotFoundError, match="neither metrics.jsonl"):
        compare_run_groups.main(["--group", "empty", str(tmp_path / "cmp"), "--out", str(out)])


def test_run_throughput_leaves_out_the_first_row_and_sums_concurrent_runs(tmp_path):
    run_throughput = load_script("bench/run_throughput.py")

    def fake_run(name, rows):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(
            "".join(json.dumps(dict(round=r, seconds=s, total_client_steps=n)) + "\n" for r, s, n in rows))
        return folder

    # The first row carries the compile time (30 s for 100 steps); after it: 600 steps in 6 s.
    alone = fake_run("alone", [(5, 30.0, 100), (10, 33.0, 400), (15, 36.0, 700)])
    pinned_a = fake_run("a", [(5, 60.0, 100), (10, 70.0, 600)])     # 500 steps in 10 s
    pinned_b = fake_run("b", [(5, 50.0, 0), (10, 58.0, 400)])       # 400 steps in 8 s
    out = tmp_path / "t.json"
    assert run_throughput.main(["--sequential", "alone", str(alone), "--concurrent", "pinned", str(pinned_a),
                                str(pinned_b), "--out", str(out)]) == 0
    groups = json.loads(out.read_text())["groups"]
    assert groups[0]["client_steps_per_second"] == pytest.approx(100.0)
    assert groups[1]["client_steps_per_second"] == pytest.approx(50.0 + 50.0)
    assert groups[1]["vs_first_group"] == pytest.approx(1.0)
    # Two runs one after another: the mean rate, not the sum.
    assert run_throughput.group_throughput(groups[1]["runs"], concurrent=False) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="a rate needs two"):
        run_throughput.run_rate(fake_run("short", [(5, 30.0, 100)]))


def test_gpu_targets_verdicts_follow_the_issue_targets():
    gpu_targets = load_script("gpu_targets.py")

    def verdict(part, result, backend="gpu", smoke=False):
        return [t["met"] for t in gpu_targets.verdicts(part, result, backend, smoke)]

    assert verdict("eval_fmnist_100", {"personal_eval_seconds": 0.019}) == [True]
    assert verdict("eval_fmnist_100", {"personal_eval_seconds": 0.021}) == [False]
    assert verdict("eval_fmnist_100", {"personal_eval_seconds": 0.4}, backend="cpu") == [True]
    assert verdict("eval_mnist_1000", {"evaluate_seconds": 0.4}, backend="cpu") == []  # no CPU target
    # FSL: >= 10 rounds/s at 25 clients, and 250 clients in at most twice the 25-client round.
    fsl = {"rounds_per_second_at_smallest_cohort": 12.0, "time_ratio_largest_to_smallest_cohort": 1.9,
           "cohort_ratio": 10.0}
    assert verdict("fsl_cohort", fsl) == [True, True]
    assert verdict("fsl_cohort", dict(fsl, rounds_per_second_at_smallest_cohort=9.0,
                                      time_ratio_largest_to_smallest_cohort=2.1)) == [False, False]
    assert verdict("feddrop_100", {"seconds_per_round": 0.31}) == [False]
    # FedAvg FMNIST, 10 clients per round: <= 30 ms per round, and vmap no slower than map.
    # ... and no grouped convolution in the device's compiled vmap round (None: not counted, no verdict).
    fedavg = {"seconds_per_round": 0.029, "vmap_over_map": 0.9, "grouped_convolutions_vmap_auto": 0}
    assert verdict("fedavg_fmnist_10", fedavg) == [True, True, True]
    assert verdict("fedavg_fmnist_10", {"seconds_per_round": 0.031, "vmap_over_map": 1.1,
                                        "grouped_convolutions_vmap_auto": 2}) == [False, False, False]
    assert verdict("fedavg_fmnist_10", dict(fedavg, grouped_convolutions_vmap_auto=None))[2] is None
    assert verdict("fedavg_fmnist_10", {"seconds_per_round": 0.5, "vmap_over_map": 2.0}, backend="cpu") == []
    # Fewer rounds than the issue's 500, or a smoke run: measured, but no verdict.
    assert verdict("spafl_eval_every_1", {"total_seconds": 29.0, "whole_setting": True}) == [True]
    assert verdict("spafl_eval_every_1", {"total_seconds": 31.0, "whole_setting": True}) == [False]
    assert verdict("spafl_eval_every_25", {"total_seconds": 20.0, "whole_setting": False}) == [None]
    assert verdict("feddrop_100", {"seconds_per_round": 0.1}, smoke=True) == [None]


def test_gpu_targets_keeps_measured_parts_unless_told(tmp_path, monkeypatch):
    gpu_targets = load_script("gpu_targets.py")
    calls = []

    def fake_measure(part, args):
        calls.append(part)
        return {"result": {"n": len(calls)}, "targets": [], "backend": "cpu"}

    monkeypatch.setattr(gpu_targets, "measure", fake_measure)
    out = tmp_path / "targets.json"
    base = ["--in-process", "--out", str(out), "--parts"]
    assert gpu_targets.main(base + ["feddrop_100"]) == 0
    assert gpu_targets.main(base + ["feddrop_100", "fsl_cohort"]) == 0
    parts = json.loads(out.read_text())["parts"]
    assert calls == ["feddrop_100", "fsl_cohort"] and parts["feddrop_100"]["result"] == {"n": 1}
    assert gpu_targets.main(base + ["feddrop_100", "--overwrite"]) == 0
    assert json.loads(out.read_text())["parts"]["feddrop_100"]["result"] == {"n": 3}


def test_gpu_targets_budget_measures_what_fits_one_device_call(tmp_path, monkeypatch, capsys):
    gpu_targets = load_script("gpu_targets.py")
    # Every part has an expected time; the default parts fit one call with room to spare (the budget is
    # 7 of the call's 10 minutes, the parts at most 4/5 of the budget), issue 40's other two targets are
    # the second call, and a plan over every part skips, in order, what no longer fits.
    assert set(gpu_targets.EXPECTED_SECONDS) == set(gpu_targets.PARTS)
    assert gpu_targets.DEFAULT_PARTS == ("fedavg_fmnist_10", "eval_fmnist_100", "fsl_cohort", "feddrop_100")
    assert gpu_targets.SECOND_CALL_PARTS == ("sweep_3x3", "spafl_eval_every_1")
    assert gpu_targets.DEVICE_CALL_SECONDS <= 420
    assert gpu_targets.plan(list(gpu_targets.DEFAULT_PARTS), gpu_targets.DEVICE_CALL_SECONDS)[1] == []
    assert sum(gpu_targets.EXPECTED_SECONDS[p] for p in gpu_targets.DEFAULT_PARTS) <= 0.8 * 420
    assert gpu_targets.plan(list(gpu_targets.SECOND_CALL_PARTS), gpu_targets.DEVICE_CALL_SECONDS)[1] == []
    fits, skipped = gpu_targets.plan(list(gpu_targets.PARTS), gpu_targets.DEVICE_CALL_SECONDS)
    assert sum(gpu_targets.EXPECTED_SECONDS[p] for p in fits) <= 420 and "fedavg_fmnist_10" in fits and skipped
    assert gpu_targets.plan(["sweep_3x3", "feddrop_100"], 100) == (["sweep_3x3"], ["feddrop_100"])
    assert gpu_targets.plan(["spafl_eval_every_1", "feddrop_100"], 100) == (["feddrop_100"], ["spafl_eval_every_1"])
    assert gpu_targets.main(["--plan", "--parts", *gpu_targets.PARTS]) == 0
    assert "skipped: over the budget" in capsys.readouterr().out
    calls = []
    monkeypatch.setattr(gpu_targets, "measure", lambda part, args: calls.append(part) or
                        {"result": {}, "targets": [], "backend": "cpu"})
    assert gpu_targets.main(["--in-process", "--out", str(tmp_path / "t.json"), "--budget-seconds", "100",
                             "--parts", "spafl_eval_every_1", "feddrop_100", "eval_mnist_1000"]) == 0
    assert calls == ["feddrop_100", "eval_mnist_1000"]
    assert "--parts spafl_eval_every_1" in capsys.readouterr().out


def test_gpu_targets_survives_a_failing_and_a_hanging_part(tmp_path):
    """Issue 48 item 4, through real child processes: a part that raises and a part that hangs (with a
    child of its own) are recorded under ``failures`` and the next part still runs; the hung part's
    whole process group is ended; the parent never imports JAX; each record says what ran it."""
    out, pid_file = tmp_path / "targets.json", tmp_path / "pids"
    script = EXPERIMENTS / "gpu_targets.py"
    driver = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gpu_targets", {str(script)!r})
gpu_targets = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpu_targets)
gpu_targets.EXPECTED_SECONDS["feddrop_100"] = 4      # the hanging part's limit: 2.5 x 4 s, floored below
gpu_targets.PART_LIMIT_FLOOR = 4.0
code = gpu_targets.main(["--out", {str(out)!r}, "--budget-seconds", "0",
                         "--parts", "eval_fmnist_100", "feddrop_100", "fsl_cohort",
                         "--inject", "eval_fmnist_100:fail", "--inject", "feddrop_100:hang",
                         "--inject", "fsl_cohort:ok"])
print(json.dumps({{"code": code, "jax_in_parent": "jax" in sys.modules}}))
"""
    import os
    import subprocess
    import sys
    import time
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GPU_TARGETS_TEST_PIDS": str(pid_file)})
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict == {"code": 1, "jax_in_parent": False}
    report = json.loads(out.read_text())
    failures = report["failures"]
    assert sorted(failures) == ["eval_fmnist_100", "feddrop_100"]
    assert "injected failure of part eval_fmnist_100" in failures["eval_fmnist_100"]["error"]
    assert failures["eval_fmnist_100"]["returncode"] == 1
    assert "Traceback" in failures["eval_fmnist_100"]["output_tail"]
    assert failures["feddrop_100"]["timed_out"] and failures["feddrop_100"]["seconds"] < 60
    assert list(report["parts"]) == ["fsl_cohort"]   # measured after both failures
    record = report["parts"]["fsl_cohort"]
    assert record["result"] == {"injected": True}
    assert {"jax", "jaxlib"} <= set(record["software"]["versions"]) and len(record["software"]["source_hash"]) == 16
    assert record["device_kind"] and record["machine_facts"]["backend"] == "cpu"
    assert "next call: --parts eval_fmnist_100 feddrop_100" in done.stdout
    # The hung part's own child (a grandchild of the driver) was ended with its group.
    grandchild = int(pid_file.read_text().split()[-1])
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hung part's child {grandchild} outlived its process group's timeout")
    assert time.perf_counter() - started < 120


@pytest.mark.smoke
def test_gpu_targets_smoke_measures_on_the_real_settings(tmp_path, shared_data):
    gpu_targets = load_script("gpu_targets.py")
    out = tmp_path / "targets.json"
    assert gpu_targets.main(["--data-dir", str(shared_data), "--smoke", "--in-process", "--repeats", "1",
                             "--rounds-timed", "1", "--out", str(out),
                             "--parts", "eval_fmnist_100", "fsl_cohort", "fedavg_fmnist_10", "spafl_eval_every_25"]) == 0
    parts = json.loads(out.read_text())["parts"]
    evaluation = parts["eval_fmnist_100"]
    assert evaluation["result"]["clients"] == 100 and evaluation["result"]["test_examples"] == 10_000
    assert [r["clients_per_round"] for r in parts["fsl_cohort"]["result"]["cohorts"]] == [2, 4]
    # FedAvg FMNIST through the bench: the four schedule x convolution variants side by side on the
    # real data and model (on a CPU im2col stands in for XLA's convolution, ~40 s a round inside a scan
    # here), the same rounds in each, then the precisions of the fastest.
    fedavg = parts["fedavg_fmnist_10"]["result"]
    assert fedavg["model"] == "lenet5_caffe" and fedavg["local_epochs"] == 1 and fedavg["batch_size"] == 64
    assert [v["values"] for v in fedavg["variants"]] == [
        {"client_parallelism": m, "model_option.conv_impl": c} for m in ("map", "vmap", "packed")
        for c in ("im2col", "auto")]
    assert fedavg["grouped_convolutions_vmap_auto"] == 0
    assert fedavg["fastest"] in [v["name"] for v in fedavg["variants"]]
    assert fedavg["seconds_per_round"] == min(v["seconds_per_round"] for v in fedavg["variants"])
    assert fedavg["vmap_over_map"] == pytest.approx(fedavg["seconds_per_round_vmap"] / fedavg["seconds_per_round_map"])
    assert all(v["loss"] == pytest.approx(fedavg["variants"][0]["loss"], rel=1e-5) for v in fedavg["variants"])
    assert all(v["tflops"] > 0 and v["total_flops"] > 0 for v in fedavg["variants"])
    assert all(v["local_step"]["kernels"] > 0 for v in fedavg["variants"])   # kernels per local step counted
    assert sorted(fedavg["seconds_per_round_by_precision"]) == ["default", "highest"]
    assert [t["quantity"] for t in parts["fedavg_fmnist_10"]["targets"]] == []   # no CPU target
    spafl = parts["spafl_eval_every_25"]["result"]
    assert spafl["run_rounds"] == 3 and spafl["whole_setting"] is False and 0 < spafl["run_final_accuracy"] <= 1
    assert all(t["met"] is None for p in parts.values() for t in p["targets"])  # smoke: no verdicts


# ---------------------------------------------------------------------------- no script imports a script
# Drivers of the authors' code put the authors' repositories on sys.path to import their modules.
SIDE_BY_SIDE = EXPERIMENTS / "tools" / "sidebyside"
LOADERS = {"spec_from_file_location", "run_path", "run_module", "SourceFileLoader", "load_source", "addsitedir"}


def script_import_problems(source: str, scripts: set[str], may_use_sys_path: bool = False) -> list[str]:
    """What in ``source`` reaches another experiment script: an import (plain, relative, or through
    ``importlib.import_module`` / ``__import__``) of a module named like a script in ``scripts``, a
    file loaded as a module (``importlib.util.spec_from_file_location``, ``runpy``), or ``sys.path``
    touched at all (how a script reaches its neighbours)."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                problems.append(f"line {node.lineno}: relative import (a script belongs to no package)")
            names = [node.module or ""]
            if node.module == "sys" and any(alias.name == "path" for alias in node.names) and not may_use_sys_path:
                problems.append(f"line {node.lineno}: imports sys.path")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names = [str(node.args[0].value)]
            elif called in LOADERS:
                problems.append(f"line {node.lineno}: loads a file as a module ({called})")
        elif (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
              and node.value.id == "sys" and not may_use_sys_path):
            problems.append(f"line {node.lineno}: touches sys.path")
        problems += [f"line {node.lineno}: imports the script {name}" for name in names
                     if name.split(".")[0] in scripts]
    return problems


def test_the_script_import_check_finds_each_way_of_reaching_a_script():
    scripts = {"spafl_fmnist", "bench_rounds"}
    assert script_import_problems("import json\nimport fedjax_sparse as fjs\nfrom fedjax_sparse import papers\n"
                                  "importlib.import_module('fedjax_sparse.algorithms.spafl_family')", scripts) == []
    for source in ("import spafl_fmnist", "from spafl_fmnist import FMNIST_BASE", "import bench_rounds as b",
                   "from . import spafl_fmnist", "importlib.import_module('spafl_fmnist')",
                   "sys.path.insert(0, str(HERE))", "sys.path.append('..')", "from sys import path",
                   "importlib.util.spec_from_file_location('x', HERE / 'spafl_fmnist.py')",
                   "runpy.run_path('experiments/reproduce/spafl_fmnist.py')"):
        assert script_import_problems(source, scripts), source
    # the authors'-code drivers may put the authors' repositories on sys.path, but not reach a script
    assert script_import_problems("sys.path.insert(0, AUTH)\nimport models", scripts, may_use_sys_path=True) == []
    assert script_import_problems("import spafl_fmnist", scripts, may_use_sys_path=True)


def test_no_experiment_script_imports_another_script():
    """Code two scripts share lives in the package (fedjax_sparse.papers, studies, sidebyside), so each
    script runs from any working directory and moving one breaks no other (experiments/README.md)."""
    paths = sorted(p for p in EXPERIMENTS.rglob("*.py") if "results" not in p.relative_to(EXPERIMENTS).parts)
    scripts = {p.stem for p in paths}
    assert {"spafl_fmnist", "bench_rounds", "torch_spafl", "gpu_targets", "run_authors"} <= scripts
    problems = {str(p.relative_to(EXPERIMENTS)): script_import_problems(p.read_text(), scripts,
                                                                        may_use_sys_path=SIDE_BY_SIDE in p.parents)
                for p in paths}
    assert {path: found for path, found in problems.items() if found} == {}


def test_privacy_tradeoff_table_by_hand(tmp_path):
    """A DP sweep with one point whose seeds all diverged (said so, never an accuracy) and one with
    two finished seeds (mean and sample std of their final accuracies, the calibrated z from
    config.json, the mean clipped fraction and median update norm over the rows); a non-DP reference."""
    tool = load_script("tools/plot_privacy_tradeoff.py")
    sweep = tmp_path / "dp"

    def member(point, seed, z, acc=None, rows=()):
        folder = sweep / point / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"config": {"dp_clip": 0.5},
                                                        "algorithm_options": {"dp_noise_multiplier": z}}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if acc is not None:
            (folder / "summary.json").write_text(json.dumps({"final_accuracy": acc, "dp_epsilon": 3.9}))

    member("dp_target_epsilon=1", 0, 9.0, rows=[{"round": 1, "dp_clipped_fraction": 1.0}])
    member("dp_target_epsilon=4", 0, 2.5, 0.5, [{"round": 1, "dp_clipped_fraction": 0.2,
                                                 "server_dp_update_norm": 1.0}])
    member("dp_target_epsilon=4", 1, 2.5, 0.7, [{"round": 1, "dp_clipped_fraction": 0.4,
                                                 "server_dp_update_norm": 3.0}])
    (sweep / "sweep.json").write_text(json.dumps({"algorithm": "fedavg", "points": [
        {"point": "dp_target_epsilon=1", "values": {"dp_target_epsilon": 1}, "seeds": [0], "diverged": [0]},
        {"point": "dp_target_epsilon=4", "values": {"dp_target_epsilon": 4}, "seeds": [0, 1], "diverged": []}]}))
    ref = tmp_path / "plain"
    for seed, acc in ((0, 0.8), (1, 0.9)):
        (ref / f"seed{seed}").mkdir(parents=True)
        (ref / f"seed{seed}" / "summary.json").write_text(json.dumps({"final_accuracy": acc}))
    tool.main([str(sweep), "--reference", f"fedavg={ref}", "--out", str(tmp_path / "fig.png")])
    table = (tmp_path / "fig.md").read_text()
    assert "| DP-fedavg | 1 | n/a | 9.000 | 0.5 | 0/1 (diverged: [0]) | n/a | 1.00 | n/a |" in table
    assert "| DP-fedavg | 4 | 3.900 | 2.500 | 0.5 | 2/2 | 60.00 ± 14.14 | 0.30 | 2 |" in table
    assert "| fedavg, no DP | ∞ | – | – | – | 2/2 | 85.00 ± 7.07 | – | – |" in table
    assert (tmp_path / "fig.png").stat().st_size > 0
