"""The FSL paper's models (seed 003, Table 3; Ramanujan et al. 2020 / Wortsman et al. 2020).

No biases and no BatchNorm anywhere (every weight is an edge of the
supernetwork); 3x3 convolutions are padded ("SAME", PyTorch padding=1).
Edges per layer (Table 3):

* ``fsl_lenet`` (MNIST, 28x28x1, 10 classes): conv 32 (288), conv 64 (18,432),
  max-pool 2, fc 128 (1,605,632), fc 10 (1,280); with 62 classes (FEMNIST)
  the last layer has 7,936.
* ``conv8`` (CIFAR-10, 32x32x3): convs 64, 64, M, 128, 128, M, 256, 256, M,
  512, 512, M, then fc 256, fc 256, fc 10: 5,275,840 weights.
"""
from __future__ import annotations

from fedjax_sparse.models.base import Conv, Dense, Flatten, sequential
from fedjax_sparse.models.registry import register_model


@register_model("fsl_lenet")
def fsl_lenet(input_shape, num_classes, **options):
    """FSL's LeNet: conv 32 3x3, conv 64 3x3, max-pool 2, fc 128, fc classes."""
    return sequential("fsl_lenet", input_shape, num_classes, [
        Conv("conv1", 32, 3, padding="SAME"),
        Conv("conv2", 64, 3, padding="SAME", pool=2),
        Flatten(),
        Dense("fc1", 128),
        Dense("fc2", num_classes, relu=False),
    ], **options)


@register_model("conv8")
def conv8(input_shape, num_classes, **options):
    """Conv8 (Ramanujan et al. 2020), FSL's CIFAR-10 model."""
    widths = [64, 64, 128, 128, 256, 256, 512, 512]
    blocks = [Conv(f"conv{i + 1}", w, 3, padding="SAME", pool=2 if i % 2 else None)
              for i, w in enumerate(widths)]
    return sequential("conv8", input_shape, num_classes, blocks + [
        Flatten(),
        Dense("fc1", 256),
        Dense("fc2", 256),
        Dense("fc3", num_classes, relu=False),
    ], **options)
