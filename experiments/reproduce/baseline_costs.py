"""Communication of SpaFL's Table 2 baselines, computed without training.

    python experiments/reproduce/baseline_costs.py                      # FMNIST column
    python experiments/reproduce/baseline_costs.py --study cifar10      # 7-layer CNN
    python experiments/reproduce/baseline_costs.py --study cifar100     # ResNet-18 (width 64, the paper's counts)

Each column's setting (experiments/reproduce/spafl_fmnist.py, spafl_cifar.py): 10 of 100
clients per round; FMNIST and CIFAR-10 500 rounds (5,000 client-rounds),
CIFAR-100 1,500 (15,000). Prints, per method, our exact count (the same
functions the algorithms report with), the paper's Table 2 Gbit, and "p x
dense" (the fraction of FedAvg's count the paper's numbers match). See
docs/baselines.md.
"""
from __future__ import annotations

import argparse

import jax

from fedjax_sparse.core import accounting
from fedjax_sparse.algorithms.heterofl_family import WidthLayout
from fedjax_sparse.models import make_model

# (model, input shape, classes, model options, client-rounds, paper Gbit of Table 2)
STUDIES = {
    "fmnist": ("lenet5_caffe", (28, 28, 1), 10, {}, 10 * 500,
               {"fedavg": 133.8, "fedpm": 66.554, "heterofl": 68.88, "fjord": 64.21}),
    "cifar10": ("cnn7", (32, 32, 3), 10, {}, 10 * 500,
                {"fedavg": 258.36, "fedpm": 133.19, "heterofl": 129.178, "fjord": 128.638}),
    "cifar100": ("resnet18_narrow", (32, 32, 3), 100, {"width": 64}, 10 * 1500,
                 {"fedavg": 10712, "fedpm": 5506.1, "heterofl": 5356.4, "fjord": 5251.4}),
}
CLIENT_ROUNDS = STUDIES["fmnist"][4]


def costs(study: str = "fmnist") -> dict:
    """{method: (our Gbit, paper Gbit, p x dense Gbit, note)} over the study's client-rounds."""
    name, shape, classes, options, client_rounds, paper = STUDIES[study]
    model = make_model(name, shape, classes, **options)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0))   # shapes are all a count needs
    layout = WidthLayout.from_model(model, variables)
    dense = accounting.tree_bits(variables)          # every value at 32 bits (FedAvg's message)
    n = dense // accounting.FLOAT_BITS
    weights = sum(layer.num_weights for layer in model.layers)
    stats = accounting.tree_bits(variables.get("batch_stats", {}))
    half, wide = (layout.num_values(layout.static_counts(p)) for p in (0.5, 0.6))
    assert layout.num_values(layout.out_channels) == n
    per_round = {
        "fedavg": (2 * dense, f"32 bits x {n:,} values both ways"),
        # fedpm.py: 1 bit up / 32 bits down per kernel entry, running statistics at 32 bits both ways
        "fedpm": (33 * weights + 2 * stats, f"1 bit up + 32 bits down per kernel entry ({weights:,})"
                  + (f", BN running stats ({stats // 32:,}) both ways" if stats else "")),
        "heterofl": (64 * half, f"p=0.5 sub-model, {half:,} values, both ways"),
        # download p_max; upload the widest sampled width (~p_max after ~50 local steps): upper bound
        "fjord": (64 * wide, f"p_max=0.6 sub-model, {wide:,} values, both ways (upper bound)"),
    }
    dense_fraction = {"fedavg": 1.0, "fedpm": 0.5, "heterofl": 0.5, "fjord": 0.5}
    return {m: (bits * client_rounds / 1e9, paper[m], dense_fraction[m] * 2 * dense * client_rounds / 1e9, note)
            for m, (bits, note) in per_round.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="fmnist", choices=sorted(STUDIES))
    args = parser.parse_args(argv)
    print("| method | ours (Gbit) | paper (Gbit) | ours / paper | p x dense (Gbit) | paper / (p x dense) | count |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, (ours, paper, scaled, note) in costs(args.study).items():
        print(f"| {method} | {ours:.3f} | {paper} | {ours / paper:.3f} | {scaled:.2f} | {paper / scaled:.4f} "
              f"| {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
