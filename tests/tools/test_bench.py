"""``python -m fedjax_sparse bench``: the JSON it writes, its numbers against the rounds' own metrics,
one-line refusals, and variants that compute the same rounds."""
import json
import math

import jax
import jax.numpy as jnp
import pytest

import fedjax_sparse as fjs
from fedjax_sparse.core import accounting
from fedjax_sparse.tools import bench
from fedjax_sparse.cli import main
from fedjax_sparse.driver.config import typed_axes
from fedjax_sparse.models import make_model

QUICK = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1",
         "--batch-size", "32", "--lr", "0.1", "--partition", "iid"]
QUICK_CONFIG = dict(dataset="digits", num_clients=6, clients_per_round=3, local_epochs=1, batch_size=32, lr=0.1,
                    partition="iid")
RECORD_KEYS = {"name", "values", "client_parallelism", "matmul_precision", "round_seconds", "seconds_per_round",
               "seconds_per_round_min", "seconds_per_round_max", "seconds_per_round_q1", "seconds_per_round_q3",
               "rounds_per_second", "client_steps_per_second", "client_steps_executed_per_second", "total_flops",
               "tflops", "matmul_tflops", "tflops_share_of_matmul", "first_round_seconds", "compile_seconds",
               "build_seconds", "peak_device_memory_mib", "peak_host_memory_mib", "memory_estimate_device_mib",
               "process", "metrics"}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.fast
def test_bench_cli_times_variants_side_by_side_and_writes_the_json(tmp_path, capsys):
    result_file, run_dir = tmp_path / "bench.json", tmp_path / "run"
    # A run command line with `run` replaced by `bench`: --out is ignored (nothing written there).
    code = main(["bench", *QUICK, "--out", str(run_dir), "--rounds-timed", "2", "--matmul-size", "128",
                 "--compare", "client_parallelism=map,vmap", "--json", str(result_file), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "--out" in captured.err and "ignored" in captured.err and not run_dir.exists()
    result = json.loads(result_file.read_text())
    assert result["schema"] == bench.SCHEMA and result["rounds_timed"] == 2
    assert result["compare"] == {"client_parallelism": ["map", "vmap"]}
    assert {"backend", "device_kind", "jax"} <= set(result["device"]) and result["device"]["backend"] == "cpu"
    assert result["command"].startswith("python -m fedjax_sparse bench --dataset digits")
    assert result["matmul"]["size"] == 128 and positive(result["matmul"]["tflops"]["default"])
    names = [v["name"] for v in result["variants"]]
    assert names == ["client_parallelism=map", "client_parallelism=vmap"] and result["fastest"] in names
    for name, line in zip(names, captured.out.splitlines()[3:5]):   # the table: one row per variant
        assert line.startswith(name)
    # The model's exact training FLOPs per example (3 x 2 x MACs): FedAvg trains densely.
    model = make_model("cnn_small", (8, 8, 1), 10)
    per_example = accounting.training_flops_per_example(model)
    for record, mode in zip(result["variants"], ["map", "vmap"]):
        assert RECORD_KEYS <= set(record) and record["client_parallelism"] == mode
        seconds, metrics = record["round_seconds"], record["metrics"]
        assert len(seconds) == 2 and all(positive(s) for s in seconds)
        assert all(len(values) == 3 for values in metrics.values())   # the compiling round + 2 timed
        assert record["seconds_per_round_min"] <= record["seconds_per_round"] <= record["seconds_per_round_max"]
        for key in ("rounds_per_second", "client_steps_per_second", "tflops", "matmul_tflops",
                    "tflops_share_of_matmul", "first_round_seconds", "peak_host_memory_mib"):
            assert positive(record[key]), key
        assert record["peak_device_memory_mib"] is None   # XLA:CPU keeps no allocator statistics
        # Achieved TFLOP/s = the timed rounds' FLOPs over their seconds, FLOPs counted here from the
        # examples each round trained (not from the bench's own sums).
        flops = [per_example * n for n in metrics["num_examples"][1:]]
        assert metrics["flops"][1:] == flops and record["total_flops"] == sum(flops)
        assert record["tflops"] == pytest.approx(sum(flops) / sum(seconds) / 1e12, rel=1e-9)
        assert record["tflops_share_of_matmul"] == pytest.approx(record["tflops"] / record["matmul_tflops"])
        steps = sum(metrics["client_steps"][1:])
        assert record["client_steps_per_second"] == pytest.approx(steps / sum(seconds), rel=1e-9)
        assert record["rounds_per_second"] == pytest.approx(2 / sum(seconds), rel=1e-9)
    # The file is not replaced unless asked.
    code = main(["bench", *QUICK, "--json", str(result_file), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "--overwrite" in err and len(err.strip().splitlines()) == 1


@pytest.mark.fast
@pytest.mark.parametrize("compare, named", [
    ("colour=red,blue", "unknown --compare key 'colour'"),
    ("client_parallelism=", "client_parallelism"),
    ("client_parallelism", "client_parallelism=VALUE"),
    ("client_parallelism=map,,vmap", "empty value"),
    ("client_parallelism=map,bogus", "client_parallelism=bogus"),
    ("matmul_precision=default,fastest", "'fastest'"),
    ("clients_per_round=3,many", "clients_per_round='many': expected an integer"),
])
def test_bench_refuses_a_bad_compare_in_one_line(compare, named, capsys):
    code = main(["bench", *QUICK, "--compare", compare, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and named in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bench_refuses_what_a_benchmark_cannot_time(capsys):
    for extra, named in ((["--seeds", "0", "1"], "--seeds"), (["--sweep", "lr=0.1,0.2"], "compare"),
                         (["--rounds-timed", "0"], "--rounds-timed")):
        code = main(["bench", *QUICK, *extra, "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and named in err and len(err.strip().splitlines()) == 1


def test_bench_variants_of_the_same_rounds_compute_the_same_numbers():
    """Convolution forms and matmul precisions change how, not what: the same losses (to float
    rounding: im2col and XLA's convolution sum in another order) and exactly the same costs."""
    result = bench.bench(fjs.RunConfig(**QUICK_CONFIG),
                         {"model_option.conv_impl": ["im2col", "xla"], "matmul_precision": ["default", "highest"]},
                         rounds_timed=1, matmul_size=64)
    variants = result["variants"]
    assert [v["values"] for v in variants] == [
        {"model_option.conv_impl": c, "matmul_precision": p} for c in ("im2col", "xla") for p in ("default", "highest")]
    assert set(result["matmul"]["tflops"]) == {"default", "highest"}
    reference = variants[0]["metrics"]
    for record in variants[1:]:
        assert record["metrics"]["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        for key in ("flops", "uplink_bits", "downlink_bits", "num_examples", "client_steps"):
            assert record["metrics"][key] == reference[key], key
    assert "model_option.conv_impl=xla matmul_precision=highest" in bench.format_table(result)


def test_bench_xla_flags_variants_run_in_child_processes(tmp_path):
    flag = "--xla_cpu_enable_fast_math=false"
    result = bench.bench(fjs.RunConfig(**QUICK_CONFIG), bench.parse_compare([f"xla_flags=none;{flag}"]),
                         rounds_timed=1, matmul_size=64)
    assert [v["name"] for v in result["variants"]] == ["xla_flags=none", f"xla_flags={flag}"]
    plain, flagged = result["variants"]
    assert flag not in plain["process"]["xla_flags"] and flagged["process"]["xla_flags"].endswith(flag)
    assert flagged["values"] == {"xla_flags": flag} and positive(flagged["seconds_per_round"])
    assert result["matmul"]["per_process"] is True and positive(flagged["matmul_tflops"])


def test_parse_compare_reads_values_and_xla_flag_lists():
    # Text (xla_flags' "none": no flag), typed for the configuration compared (config.typed_axes).
    spafl = fjs.RunConfig(algorithm="spafl")
    texts = bench.parse_compare(["lr=0.1,1", "option.ramp=true,false", "eval_batch_size=none,64",
                                 "xla_flags=none;--a=1,2 --b=x"])
    assert texts["xla_flags"] == ["", "--a=1,2 --b=x"]
    assert typed_axes(spafl, {k: v for k, v in texts.items() if k != "xla_flags"}, "compare") == {
        "lr": [0.1, 1], "option.ramp": [True, False], "eval_batch_size": [None, 64]}
    # The children's command line reads back to the same axes.
    axes = {"lr": [0.1, 1], "option.ramp": [True, False]}
    assert typed_axes(spafl, bench.parse_compare([bench.compare_spec(k, v) for k, v in axes.items()]),
                      "compare") == axes
    assert bench.parse_compare([bench.compare_spec("xla_flags", ["", "--a=1,2 --b=x"])]) == {
        "xla_flags": ["", "--a=1,2 --b=x"]}
    with pytest.raises(fjs.RunError, match="twice"):
        bench.parse_compare(["lr=0.1", "lr=0.2"])


def test_bench_counts_the_kernels_of_a_local_step():
    """--count-kernels: each variant's local step, read from its compiled round program (the step's
    matrix products among the ops); absent unless asked."""
    config = fjs.RunConfig(**QUICK_CONFIG)
    result = bench.bench(config, {"client_parallelism": ["map", "vmap"]}, rounds_timed=1, matmul_size=64,
                         count_kernels=True)
    for variant in result["variants"]:
        step = variant["local_step"]
        assert step["kernels"] > 0 and step["loops_inside"] == step["ops"].get("while", 0)
        # Every fusion and library matmul launches; tuples, constants and views do not.
        launched = step["ops"].get("fusion", 0) + step["ops"].get("dot", 0)
        assert launched <= step["kernels"] <= sum(step["ops"].values()) - step["ops"].get("get-tuple-element", 0)
        assert step["ops"].get("dot", 0) + step["ops"].get("fusion", 0) >= 3   # 2 dense layers + a conv at least
    assert "kernels/step" in bench.format_table(result)
    plain = bench.bench(config, rounds_timed=1, matmul_size=64)
    assert "local_step" not in plain["variants"][0] and "kernels/step" not in bench.format_table(plain)


def test_local_step_cost_is_one_iteration_of_the_step_loop():
    """programs.local_step_cost on a hand-made round: each step multiplies a [B, d] batch by a [d, h]
    matrix (2 B d h FLOPs), whatever the trip count; K clients in lockstep (vmap) cost K times that."""
    from fedjax_sparse.tools import programs
    from fedjax_sparse.data.federated import ClientData
    from fedjax_sparse.core.training import run_local_epochs
    batch, d, h, n, clients = 16, 64, 128, 80, 3
    x = jnp.ones((n, d))
    w = jnp.ones((d, h))

    def client(count, key):
        data = ClientData(x, jnp.zeros((n,), jnp.int32), jnp.arange(n, dtype=jnp.int32), count)

        def step(carry, b, i, total, k):
            return carry + (b.x @ w).sum(), jnp.zeros(())
        return run_local_epochs(step, jnp.zeros(()), data, key, epochs=2, batch_size=batch,
                                preprocess=lambda v: v)[0]

    keys = jax.random.split(jax.random.PRNGKey(0), clients)
    counts = jnp.asarray([80, 9, 33], jnp.int32)
    one = programs.local_step_cost(lambda c, k: client(c[0], k[0]), counts, keys)
    lockstep = programs.local_step_cost(lambda c, k: jax.vmap(client)(c, k), counts, keys)
    for platform in ("cpu", "cuda"):
        # the product, its sum and the loop's few scalar ops: within 10 % of the product's own FLOPs
        assert one[platform]["flops"] == pytest.approx(2 * batch * d * h, rel=0.1), platform
        assert lockstep[platform]["flops"] == pytest.approx(clients * 2 * batch * d * h, rel=0.1), platform
        assert one[platform]["bytes_accessed"] > 0
    assert one["cpu"]["compiled"] and not one["cuda"]["compiled"]


def test_step_cost_records_none_where_xla_gives_no_cost_analysis(monkeypatch):
    """On a GPU host XLA gives no cost analysis for the program lowered for the CPU (None): that platform's
    cost is None and the bench, its per-client-step cost and its table go on (it raised, and the device
    script lost its fedavg_fmnist_10 part on an H200). Here the CUDA lowering plays that part."""
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    result = bench.bench(fjs.RunConfig(**QUICK_CONFIG), rounds_timed=1, matmul_size=64, count_kernels=True)
    step = result["variants"][0]["local_step"]
    assert step["cost"]["cuda"] is None and step["cost_per_client_step"]["cuda"] is None
    assert step["cost"]["cpu"]["compiled"] and step["cost_per_client_step"]["cpu"]["flops"] > 0
    assert "kernels/step" in bench.format_table(result)


def test_bench_reports_step_cost_and_padding_per_schedule():
    """--count-kernels also gives each variant's step cost per client-step (about the same work under
    every schedule) and the schedule's executed / useful client-steps (map 1, vmap the most)."""
    config = fjs.RunConfig(**dict(QUICK_CONFIG, partition="dirichlet:0.3"))
    result = bench.bench(config, {"client_parallelism": ["map", "vmap", "packed"]}, rounds_timed=1, matmul_size=64,
                         count_kernels=True)
    steps = {v["client_parallelism"]: v["local_step"] for v in result["variants"]}
    ratios = {mode: step["padding"]["executed_per_useful"] for mode, step in steps.items()}
    assert ratios["map"] == 1.0 and ratios["vmap"] > 1.0 and 1.0 <= ratios["packed"] <= ratios["vmap"]
    assert steps["packed"]["padding"]["useful_client_steps"] == steps["map"]["padding"]["useful_client_steps"]
    flops = {mode: step["cost_per_client_step"]["cuda"]["flops"] for mode, step in steps.items()}
    # the same products per client-step; lockstep adds the selects that freeze finished clients
    assert flops["map"] <= flops["vmap"] <= 1.3 * flops["map"] and flops["map"] <= flops["packed"] <= 1.3 * flops["map"]
    assert steps["vmap"]["lockstep_clients"] == config.clients_per_round and steps["map"]["lockstep_clients"] == 1
    assert "executed/useful" in bench.format_table(result)


def test_bench_checks_each_variant_once(monkeypatch, capsys):
    """On the CLI's path and bench.bench's: one validation per variant (before any is built), none
    again when the variant is built."""
    import sys
    from fedjax_sparse.driver import config as config_module
    calls = []
    original = config_module.validate

    def counted(config, *args, **kwargs):
        calls.append(config.execution.client_parallelism)
        return original(config, *args, **kwargs)
    for module in [m for key, m in list(sys.modules.items()) if key.startswith("fedjax_sparse")]:
        if getattr(module, "validate", None) is original:
            monkeypatch.setattr(module, "validate", counted)
    assert main(["bench", *QUICK, "--rounds-timed", "1", "--matmul-size", "64", "--compare",
                 "client_parallelism=map,vmap", "--quiet"]) == 0, capsys.readouterr().err
    assert calls == ["map", "vmap"]
    calls.clear()
    bench.bench(fjs.RunConfig(**QUICK_CONFIG), {"client_parallelism": ["map"]}, rounds_timed=1, matmul_size=64)
    assert calls == ["map"]
