"""SpaFL on Fashion-MNIST in plain PyTorch (CPU): the reference loop for
``experiments/bench/bench_vs_pytorch.py``. Standalone: imports only torch, numpy and
the standard library, so it runs in any environment with torch.

    python experiments/tools/torch_spafl.py --inputs DIR --rounds 6 --threads 2 > result.json

One round, as in this project's ``spafl`` with the FMNIST options (and the
authors' FMNIST code, news-vt/SpaFL_NeruIPS_2024 ``main/fmnist``):

* every client owns a persistent LeNet-5-Caffe (conv 1->20 5x5, relu, maxpool 2,
  conv 20->50 5x5, relu, maxpool 2, fc 800->500, relu, fc 500->10, no biases),
  one threshold per output row of every layer, and a persistent
  ``torch.optim.SGD(lr, momentum=0.9)`` over weights and thresholds;
* the server broadcasts the global thresholds to the sampled clients, which
  first apply eq. (13) with the last global change ``dtau``
  (``w_i -= sign(sum_j w_ij) * dtau_i / D``, D = fan_in = c_in*kh*kw, or
  ``--eq13-divisor kernel_area``: kh*kw for convs as in the authors' code);
* local training: ``--epochs`` passes over the client's samples in shuffled
  minibatches of ``--batch-size`` (last batch partial, as ``DataLoader(shuffle=
  True, drop_last=False)``; batches are gathered by index from a pre-converted
  float tensor instead of collated sample by sample); row i of a layer is kept
  iff ``mean_j |w_ij| > tau_i`` (unit step, identity straight-through gradient
  to weights and thresholds); before every training forward a layer that kept
  <= 1 % of its rows in its previous forward gets its thresholds reset to 0;
  loss = CE + alpha * sigmoid(10 t - 5) * sum exp(-tau);
* the server's new thresholds are the uniform mean over the cohort; dtau = new - old;
* evaluation: every client on its own test set with its own masked model (its
  own thresholds, the reset rule applied without writing it back).

Inputs (``--inputs DIR``, written by ``bench_vs_pytorch.py``; the layouts of
``fedjax_sparse/driver/pinning.py``): ``data.npz`` (``train_x`` uint8 [n, 28, 28],
``train_y``, ``test_x``, ``test_y``), ``partition.json``
(``fedjax_sparse.partition/1``), ``cohorts.json`` (``fedjax_sparse.cohorts/1``),
``init_params.npz`` (``params/<layer>/kernel``, conv HWIO, dense [in, out] with
the (h, w, c) flattening). ``--partition``/``--cohorts``/``--init`` override the
last three (e.g. the files the authors' driver exports).

Output: one JSON object on stdout: per round the seconds of training (broadcast,
eq. 13, local training of the cohort, aggregation), of evaluating all clients,
and of the whole round; the cohort's mean training cross-entropy (weighted by
examples, over all local epochs), mean accuracy over clients, density, and the
initial model's logits on the first test images (a layout check), and the cross-entropy of
``--fixed-batch-steps`` SpaFL steps on client 0's first samples in fixed batches (no shuffling,
so the JAX side must reproduce it to float precision).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

RESET_KEPT_FRACTION = 0.01


class BinaryStep(torch.autograd.Function):
    """Unit step forward, identity gradient backward (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


class MaskedLayer(nn.Module):
    """A bias-free conv or linear layer whose output rows are masked by thresholds (SpaFL eq. 1)."""

    def __init__(self, weight_shape, kind: str, eq13_divisor: str = "fan_in"):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.empty(weight_shape))
        self.threshold = nn.Parameter(torch.zeros(weight_shape[0]))
        # D of eq. (13): fan_in = c_in*kh*kw (paper); kernel_area = kh*kw for convs (authors' code).
        fan_in = math.prod(weight_shape[1:])
        self.eq13_divisor = float(math.prod(weight_shape[2:]) if kind == "conv" and eq13_divisor == "kernel_area"
                                  else fan_in)
        self.kept = 1.0   # kept fraction of the previous training forward (for the reset rule)

    def row_mask(self, tau: torch.Tensor) -> torch.Tensor:
        score = self.weight.abs().flatten(1).mean(1) - tau
        return BinaryStep.apply(score)

    def masked_weight(self) -> torch.Tensor:
        if self.training:
            if self.kept <= RESET_KEPT_FRACTION:
                with torch.no_grad():
                    self.threshold.zero_()
            mask = self.row_mask(self.threshold)
            self.kept = float(mask.detach().mean())
        else:   # evaluation: the reset rule applies but is not written back
            tau = torch.zeros_like(self.threshold) if self.kept <= RESET_KEPT_FRACTION else self.threshold
            mask = self.row_mask(tau)
        return self.weight * mask.view(-1, *([1] * (self.weight.dim() - 1)))

    @torch.no_grad()
    def eval_density(self) -> float:
        tau = torch.zeros_like(self.threshold) if self.kept <= RESET_KEPT_FRACTION else self.threshold
        return float(self.row_mask(tau.detach()).mean())

    def forward(self, x):
        w = self.masked_weight()
        return F.conv2d(x, w) if self.kind == "conv" else F.linear(x, w)

    @torch.no_grad()
    def eq13_(self, dtau: torch.Tensor) -> None:
        """w_i -= sign(sum_j w_ij) * dtau_i / D, one sign per row."""
        sign = torch.sign(self.weight.flatten(1).sum(1))
        self.weight.sub_((sign * dtau / self.eq13_divisor).view(-1, *([1] * (self.weight.dim() - 1))))


class MaskedLeNet5(nn.Module):
    """LeNet-5-Caffe for 28x28x1 inputs with SpaFL thresholds on all four layers."""

    LAYERS = ("conv1", "conv2", "fc1", "fc2")

    def __init__(self, eq13_divisor: str = "fan_in"):
        super().__init__()
        self.conv1 = MaskedLayer((20, 1, 5, 5), "conv", eq13_divisor)
        self.conv2 = MaskedLayer((50, 20, 5, 5), "conv", eq13_divisor)
        self.fc1 = MaskedLayer((500, 800), "linear", eq13_divisor)
        self.fc2 = MaskedLayer((10, 500), "linear", eq13_divisor)

    def masked_layers(self):
        return [self.conv1, self.conv2, self.fc1, self.fc2]

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)

    def regulariser(self) -> torch.Tensor:
        return sum(torch.exp(-layer.threshold).sum() for layer in self.masked_layers())

    def density(self) -> float:
        return float(np.mean([layer.eval_density() for layer in self.masked_layers()]))


def load_init_params(path) -> dict[str, np.ndarray]:
    """``params/<layer>/kernel`` (project layouts) -> {layer: PyTorch weight} (OIHW, [out, in] with
    fc1's inputs in PyTorch's (c, h, w) flattening order)."""
    with np.load(path) as f:
        k = {name: f[f"params/{name}/kernel"] for name in MaskedLeNet5.LAYERS}
    return {"conv1": k["conv1"].transpose(3, 2, 0, 1), "conv2": k["conv2"].transpose(3, 2, 0, 1),
            "fc1": k["fc1"].reshape(4, 4, 50, 500).transpose(3, 2, 0, 1).reshape(500, 800),
            "fc2": k["fc2"].T}


def make_model(init: dict[str, np.ndarray], eq13_divisor: str) -> MaskedLeNet5:
    model = MaskedLeNet5(eq13_divisor)
    with torch.no_grad():
        for name, layer in zip(MaskedLeNet5.LAYERS, model.masked_layers()):
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(init[name], np.float32)))
    return model


class Client:
    def __init__(self, model: MaskedLeNet5, x, y, x_test, y_test, lr: float, momentum: float):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        self.x, self.y, self.x_test, self.y_test = x, y, x_test, y_test

    def train(self, epochs: int, batch_size: int, reg_coeff: float, generator: torch.Generator) -> float:
        """Local epochs; returns the sum over steps of (batch CE x batch size)."""
        model, opt = self.model, self.optimizer
        model.train()
        ce_sum = torch.zeros(())
        n = len(self.y)
        for _ in range(epochs):
            for idx in torch.randperm(n, generator=generator).split(batch_size):
                ce = F.cross_entropy(model(self.x[idx]), self.y[idx])
                loss = ce + reg_coeff * model.regulariser()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                ce_sum += ce.detach() * len(idx)
        return float(ce_sum)

    @torch.inference_mode()
    def evaluate(self, batch_size: int) -> tuple[int, float, int]:
        """(correct, summed CE, count) on the client's test set with its own masked model."""
        model = self.model
        model.eval()
        correct, loss = 0, 0.0
        for xb, yb in zip(self.x_test.split(batch_size), self.y_test.split(batch_size)):
            logits = model(xb)
            correct += int((logits.argmax(1) == yb).sum())
            loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        return correct, loss, len(self.y_test)


def ramp(round_index: int) -> float:
    """c(t) = sigmoid(10 t - 5) (the FMNIST code's regulariser schedule)."""
    return 1.0 / (1.0 + math.exp(5.0 - 10.0 * round_index))


def fixed_batch_check(init, x, y, steps: int, batch_size: int, lr: float, momentum: float, alpha: float,
                      eq13_divisor: str) -> list[float]:
    """Cross-entropy of ``steps`` SpaFL steps from ``init`` on the fixed batches
    ``x[b*B:(b+1)*B]`` (b cycling over the whole batches of x, no shuffling): an RNG-free
    sequence the JAX side reproduces to float precision."""
    model = make_model(init, eq13_divisor)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    num_batches = max(len(y) // batch_size, 1)
    out = []
    for s in range(steps):
        sl = slice((s % num_batches) * batch_size, (s % num_batches + 1) * batch_size)
        ce = F.cross_entropy(model(x[sl]), y[sl])
        loss = ce + alpha * model.regulariser()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out.append(float(ce.detach()))
    return out


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    inputs = Path(args.inputs)
    with np.load(inputs / "data.npz") as f:
        train_x = torch.from_numpy(f["train_x"].astype(np.float32)).reshape(-1, 1, 28, 28)   # raw 0-255
        train_y = torch.from_numpy(f["train_y"].astype(np.int64))
        test_x = torch.from_numpy(f["test_x"].astype(np.float32)).reshape(-1, 1, 28, 28)
        test_y = torch.from_numpy(f["test_y"].astype(np.int64))
    partition = json.loads(Path(args.partition or inputs / "partition.json").read_text())
    cohorts = json.loads(Path(args.cohorts or inputs / "cohorts.json").read_text())["rounds"]
    init = load_init_params(args.init or inputs / "init_params.npz")
    if len(cohorts) < args.rounds:
        raise SystemExit(f"the cohort schedule lists {len(cohorts)} rounds, --rounds is {args.rounds}")
    if partition.get("test_from_train"):
        test_x, test_y = train_x, train_y

    template = make_model(init, args.eq13_divisor)
    with torch.inference_mode():
        template.eval()
        init_logits = template(test_x[:8]).tolist()
    clients = []
    for c in partition["clients"]:
        tr = torch.as_tensor(c["train_indices"], dtype=torch.int64)
        te = torch.as_tensor(c["test_indices"], dtype=torch.int64)
        model = make_model(init, args.eq13_divisor)
        clients.append(Client(model, train_x[tr].contiguous(), train_y[tr].contiguous(),
                              test_x[te].contiguous(), test_y[te].contiguous(), args.lr, args.momentum))
    del train_x, test_x
    check = fixed_batch_check(init, clients[0].x[:640], clients[0].y[:640], args.fixed_batch_steps, args.batch_size,
                              args.lr, args.momentum, args.alpha, args.eq13_divisor)

    tau = [torch.zeros(layer.threshold.shape) for layer in template.masked_layers()]
    dtau = [torch.zeros_like(t) for t in tau]
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    for r in range(args.rounds):
        cohort = [int(c) for c in cohorts[r]]
        t0 = time.perf_counter()
        ce_sum, examples = 0.0, 0
        coeff = args.alpha * (ramp(r) if args.ramp else 1.0)
        for cid in cohort:
            client = clients[cid]
            with torch.no_grad():
                for layer, t, d in zip(client.model.masked_layers(), tau, dtau):
                    layer.threshold.copy_(t)
                    if args.eq13:
                        layer.eq13_(d)
            ce_sum += client.train(args.epochs, args.batch_size, coeff, generator)
            examples += args.epochs * len(client.y)
        with torch.no_grad():
            new_tau = [torch.stack([clients[c].model.masked_layers()[i].threshold.detach() for c in cohort]).mean(0)
                       for i in range(len(tau))]
        dtau = [n - o for n, o in zip(new_tau, tau)]
        tau = new_tau
        t1 = time.perf_counter()
        stats = [client.evaluate(args.eval_batch_size) for client in clients]
        t2 = time.perf_counter()
        density = float(np.mean([client.model.density() for client in clients]))
        acc = [c / n for c, _, n in stats if n > 0]
        rows.append({"round": r + 1, "train_seconds": t1 - t0, "eval_seconds": t2 - t1, "round_seconds": t2 - t0,
                     "loss": ce_sum / max(examples, 1), "examples": examples, "accuracy": float(np.mean(acc)),
                     "test_loss": sum(s[1] for s in stats) / max(sum(s[2] for s in stats), 1),
                     "density_all_clients": density, "global_tau_mean": float(torch.cat(tau).mean())})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"torch": torch.__version__, "numpy": np.__version__, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "config": vars(args), "rounds": rows,
            "init_logits": init_logits, "fixed_batch_ce": check}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", required=True, help="folder with data.npz, partition.json, cohorts.json, "
                                                   "init_params.npz")
    p.add_argument("--partition", default=None)
    p.add_argument("--cohorts", default=None)
    p.add_argument("--init", default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--alpha", type=float, default=0.002)
    p.add_argument("--no-ramp", dest="ramp", action="store_false")
    p.add_argument("--no-eq13", dest="eq13", action="store_false")
    p.add_argument("--eq13-divisor", default="fan_in", choices=["fan_in", "kernel_area"])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0, help="torch seed (shuffling)")
    p.add_argument("--fixed-batch-steps", type=int, default=20,
                   help="steps of the RNG-free semantics check on client 0's first samples")
    return p.parse_args(argv)


def main(argv=None) -> int:
    print(json.dumps(run(parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
