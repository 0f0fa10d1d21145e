"""Communication of SpaFL's Table 2 baselines on FMNIST, computed without training.

    python experiments/baseline_costs.py

SpaFL's FMNIST setting (experiments/spafl_fmnist.py): LeNet-5-Caffe (430,500
weights), 10 of 100 clients per round, 500 rounds = 5,000 client-rounds.
Prints, per method, our exact count (the same functions the algorithms report
with), the paper's Table 2 Gbit, and "p x dense" (the fraction of the dense
model's weights the paper's numbers match). See docs/baselines.md.
"""
from __future__ import annotations

import jax

from fedjax_sparse.algorithms.heterofl import WidthLayout
from fedjax_sparse.models import make_model

CLIENT_ROUNDS = 10 * 500
PAPER_GBIT = {"fedavg": 133.8, "fedpm": 66.554, "heterofl": 68.88, "fjord": 64.21}


def costs() -> dict:
    """{method: (our Gbit, paper Gbit, p x dense Gbit, note)} for the FMNIST setting."""
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    layout = WidthLayout.from_model(model, model.init(jax.random.PRNGKey(0)))
    n = layout.num_values(layout.out_channels)
    half, wide = (layout.num_values(layout.static_counts(p)) for p in (0.5, 0.6))
    per_round = {
        "fedavg": (64 * n, "32 bits x 430,500 both ways"),
        "fedpm": (33 * n, "1 bit up + 32 bits down per weight"),
        "heterofl": (64 * half, f"p=0.5 sub-model, {half:,} values, both ways"),
        # download p_max; upload the widest sampled width (~p_max after ~50 local steps): upper bound
        "fjord": (64 * wide, f"p_max=0.6 sub-model, {wide:,} values, both ways (upper bound)"),
    }
    dense_fraction = {"fedavg": 1.0, "fedpm": 0.5, "heterofl": 0.5, "fjord": 0.5}
    return {m: (bits * CLIENT_ROUNDS / 1e9, PAPER_GBIT[m], dense_fraction[m] * 64 * n * CLIENT_ROUNDS / 1e9, note)
            for m, (bits, note) in per_round.items()}


def main() -> int:
    print("| method | ours (Gbit) | paper (Gbit) | ours / paper | p x dense (Gbit) | paper / (p x dense) | count |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, (ours, paper, scaled, note) in costs().items():
        print(f"| {method} | {ours:.3f} | {paper} | {ours / paper:.3f} | {scaled:.2f} | {paper / scaled:.4f} "
              f"| {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
