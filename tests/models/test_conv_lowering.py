"""What a GPU would run, checked on this CPU: programs lowered for CUDA (``jax.export``) hold no grouped
convolution wherever a convolution's kernel carries a client, seed or sweep-member axis (JAX's
batching rule folds such clients into ``feature_group_count`` / ``batch_group_count`` groups, which
cuDNN runs about group by group), and the batched form computes the native convolution's numbers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_script, make_task, tiny_federated

from fedjax_sparse.tools import programs
from fedjax_sparse.algorithms import make_algorithm
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import from_flax, make_model
from fedjax_sparse.models import layers as L
from fedjax_sparse.models.flax_examples import LeNet5Caffe

ALGORITHMS = ("fedavg", "spafl", "feddrop", "fsl", "fedpm")


@pytest.fixture(scope="module")
def lenet_data():
    return tiny_federated(sizes=(12, 20, 9, 16), shape=(28, 28, 1))[1]


def _vmapped_engine(data, name, model, clients=3):
    algorithm = make_algorithm(name, make_task(data, model=model, clients_per_round=clients), {})
    engine = Engine(algorithm, data.num_clients, clients, client_parallelism="vmap")
    return engine, engine.init(jax.random.PRNGKey(0))


def _round_for_cuda(engine, state, data) -> str:
    return programs.lowered_text(lambda s, d: engine.round_step(s, d), state, data, platform="cuda")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_vmapped_round_for_cuda_has_no_grouped_convolution(lenet_data, name):
    model = make_model("lenet5_caffe", lenet_data.input_shape, lenet_data.num_classes)
    engine, state = _vmapped_engine(lenet_data, name, model)
    text = _round_for_cuda(engine, state, lenet_data)
    assert programs.grouped_convolutions(text) == []
    # The clients' convolutions became batched matmuls (2 forward + 3 gradient products at least).
    assert programs.stablehlo_op_counts(text)["dot_general"] >= 5


def test_the_native_form_is_what_the_check_catches(lenet_data):
    """``conv_impl="xla"`` (the choice a GPU process made before): every LeNet convolution of the
    vmapped FedAvg round is grouped by the 3 clients (forward, input and kernel gradients)."""
    model = make_model("lenet5_caffe", lenet_data.input_shape, lenet_data.num_classes, conv_impl="xla")
    engine, state = _vmapped_engine(lenet_data, "fedavg", model)
    grouped = programs.grouped_convolutions(_round_for_cuda(engine, state, lenet_data))
    assert len(grouped) == 5
    assert {max(c["feature_group_count"], c["batch_group_count"]) for c in grouped} == {3}


def test_flax_model_round_and_replicas_for_cuda_have_no_grouped_convolution(lenet_data):
    model = from_flax(LeNet5Caffe(num_classes=lenet_data.num_classes), input_shape=lenet_data.input_shape)
    engine, state = _vmapped_engine(lenet_data, "fedavg", model)
    assert programs.grouped_convolutions(_round_for_cuda(engine, state, lenet_data)) == []
    # Seeds around clients (replicas, vmapped sweeps): two vmaps over the kernels.
    states = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    replicated = lenet_data.replace(train_idx=jnp.stack([lenet_data.train_idx] * 2),
                                     train_count=jnp.stack([lenet_data.train_count] * 2))
    text = programs.lowered_text(lambda s, d: engine.run_replica_rounds(s, d, 1), states, replicated)
    assert programs.grouped_convolutions(text) == []


def test_personal_evaluation_for_cuda_has_no_grouped_convolution(lenet_data):
    model = make_model("lenet5_caffe", lenet_data.input_shape, lenet_data.num_classes)
    engine, state = _vmapped_engine(lenet_data, "spafl", model)
    evaluator = engine.evaluator
    width = int(lenet_data.test_idx.shape[1])
    ids = jnp.arange(lenet_data.num_clients, dtype=jnp.int32)
    # The vmapped reference experiments/bench/bench_eval.py times next to it.
    chunk = load_script("bench/bench_eval.py").batched_chunk(evaluator)
    batched = programs.lowered_text(lambda s, d, i: chunk(s, d, i, width), state, lenet_data, ids)
    per_client = programs.lowered_text(lambda s, d, c: evaluator._per_client_fn.__wrapped__(s, d, c, width),
                                       state, lenet_data, jnp.int32(1))
    assert programs.grouped_convolutions(batched) == []
    # One client at a time: its kernel is shared by its examples, so XLA's convolution stays.
    assert programs.convolutions(per_client) and programs.grouped_convolutions(per_client) == []


@pytest.mark.fast
def test_auto_is_chosen_where_the_program_is_lowered():
    x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
    ws = jnp.stack([w, w])

    def convolutions(platform, per_client=False):
        # A new function per call: jit caches a trace per function, and the choice is made at trace time.
        def one_client(x, w):
            return L.conv2d(x, w)
        fn = jax.vmap(one_client, in_axes=(None, 0)) if per_client else one_client
        return programs.convolutions(programs.lowered_text(fn, x, ws if per_client else w, platform=platform))
    # CPU inside the engine's loops: im2col (no convolution); outside them: XLA's convolution.
    assert convolutions("cpu") == []
    with L.outside_loops():
        assert convolutions("cpu")
        assert convolutions("cpu", per_client=True) == []
    # GPU: XLA's convolution for a shared kernel, batched matmuls for per-client kernels.
    assert convolutions("cuda")
    assert convolutions("cuda", per_client=True) == []
    assert L.resolve_conv_impl("auto", "cuda") == "batched_im2col"


def _loss(impl, stride, padding):
    return lambda w, x: jnp.sum(jnp.tanh(L.conv2d(x, w, stride=stride, padding=padding, impl=impl)) ** 2)


@pytest.mark.fast
@pytest.mark.parametrize("padding,stride,k", [("VALID", 1, 5), ("SAME", 2, 3)])
def test_batched_form_equals_the_native_convolution_under_vmap_and_grad(padding, stride, k):
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    ws = jax.random.normal(keys[0], (2, 3, k, k, 3, 4))   # [seeds, clients, ...]
    xs = jax.random.normal(keys[1], (2, 3, 5, 11, 10, 3))

    def both_grads(impl):
        return jax.grad(_loss(impl, stride, padding), argnums=(0, 1))
    for in_axes in ((0, 0), (0, None), (None, 0)):   # kernel and input / kernel only / input only
        w = ws if in_axes[0] == 0 else ws[0, 0]
        x = xs if in_axes[1] == 0 else xs[0, 0]
        ref, got = (jax.jit(jax.vmap(jax.vmap(both_grads(impl), in_axes=in_axes), in_axes=in_axes))(w, x)
                    for impl in ("xla", "batched_im2col"))
        for a, b in zip(ref, got):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(jnp.abs(a).max()))
    y_native = jax.vmap(lambda w: L.conv2d(xs[0, 0], w, stride=stride, padding=padding, impl="xla"))(ws[0])
    y_batched = jax.vmap(lambda w: L.conv2d(xs[0, 0], w, stride=stride, padding=padding, impl="batched_im2col"))(ws[0])
    np.testing.assert_allclose(y_batched, y_native, rtol=1e-5, atol=1e-4)


def test_vmapped_round_numbers_equal_the_native_convolution(lenet_data):
    metrics, servers = {}, {}
    for impl in ("xla", "batched_im2col"):
        model = make_model("lenet5_caffe", lenet_data.input_shape, lenet_data.num_classes, conv_impl=impl)
        engine, state = _vmapped_engine(lenet_data, "fedavg", model)
        state, metrics[impl] = engine.run_rounds(state, lenet_data, 2)
        servers[impl] = state.server
    np.testing.assert_allclose(metrics["batched_im2col"]["loss"], metrics["xla"]["loss"], rtol=1e-4)
    for a, b in zip(jax.tree_util.tree_leaves(servers["xla"]), jax.tree_util.tree_leaves(servers["batched_im2col"])):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5)


@pytest.mark.fast
def test_program_reader_finds_the_local_step_loop_and_its_ops():
    """A hand-made program: a loop (one sort) around a "local step" loop of exactly 3 matmuls and a tanh
    (the matmuls in a jitted function, which the lowering outlines), which itself runs a small loop
    of one subtraction; only the step is traced under the local-step scope."""
    @jax.jit
    def matmuls(a, b):
        return a @ b @ b @ b

    def program(a, b):
        def step(j, a):
            with jax.named_scope(programs.LOCAL_STEP_SCOPE):
                a = jnp.tanh(matmuls(a, b))
                return jax.lax.fori_loop(0, j % 3, lambda i, a: a - 1.0, a)

        def outer(i, a):
            a = jnp.sort(a, axis=-1)
            return jax.lax.fori_loop(0, a.shape[0] + i, step, a)
        return jax.lax.fori_loop(0, 2 + a.shape[0] % 3, outer, a)
    a, b = jnp.ones((4, 4)), jnp.eye(4)
    lowered = programs.stablehlo_loop_op_counts(programs.lowered_text(program, a, b, platform="cuda"))
    assert len(lowered) == 3 and lowered[0]["in_scope"] > max(lowered[1]["in_scope"], lowered[2]["in_scope"])
    step = lowered[0]["ops"]
    assert step["dot_general"] == 3 and step["tanh"] == 1 and step["while"] == 1
    assert "sort" not in step and "subtract" not in step     # the outer loop's, the inner loop's
    compiled = programs.loop_op_counts(jax.jit(program).lower(a, b).compile().as_text())
    assert len(compiled) == 3 and compiled[0]["in_scope"] > 0
    assert compiled[0]["kernels"] >= 2 and compiled[0]["ops"].get("while") == 1 and "sort" not in compiled[0]["ops"]


def test_batched_im2col_second_order_and_forward_mode():
    """Issue 48 item 5: jax.hessian through ``batched_im2col`` (a vmap over tangents batches neither
    operand) equals XLA's, per client under vmap too; plain forward mode is refused in one line that
    names the layer and conv_impl='xla'."""
    from fedjax_sparse.models import layers
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 6, 3))
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 3, 4))

    def loss(impl, of="kernel"):
        if of == "kernel":
            return lambda k: (layers.conv2d(x, k, impl=impl, name="conv1") ** 2).sum()
        return lambda v: (layers.conv2d(v, w, impl=impl, name="conv1") ** 2).sum()
    for of, arg in (("kernel", w), ("input", x)):
        want = jax.hessian(loss("xla", of))(arg)
        np.testing.assert_allclose(jax.hessian(loss("batched_im2col", of))(arg), want, rtol=1e-4, atol=1e-3)
    clients = jnp.stack([w, 2 * w])
    np.testing.assert_allclose(jax.vmap(jax.hessian(loss("batched_im2col")))(clients),
                               jax.vmap(jax.hessian(loss("xla")))(clients), rtol=1e-4, atol=1e-3)
    with pytest.raises(TypeError, match=r"layer conv1.*conv_impl='xla'") as info:
        jax.jvp(loss("batched_im2col"), (w,), (w,))
    assert "\n" not in str(info.value)
    jax.jvp(loss("xla"), (w,), (w,))   # the fix it names works
