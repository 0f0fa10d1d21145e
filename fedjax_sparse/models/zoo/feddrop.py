"""The FedDrop paper's CNNs (App. E, Tables 6-8): every layer with a bias, no BatchNorm; FedDrop places a
SyncDrop layer after every conv+ReLU (:mod:`fedjax_sparse.mechanisms.syncdrop`). The tables' average pool
to 2x2 is PyTorch's ``AdaptiveAvgPool2d(2)`` (docs/feddrop.md, "Models", says why).
"""
from __future__ import annotations

from fedjax_sparse.models.base import AvgPool, Conv, Dense, Flatten, GlobalAvgPool, sequential
from fedjax_sparse.models.registry import register_model


@register_model("feddrop_fmnist_cnn")
def feddrop_fmnist_cnn(input_shape, num_classes, **options):
    """Table 6 (28x28x1): conv 32 5x5 SAME, maxpool 2, conv 64 5x5 SAME, maxpool 2,
    conv 64 3x3 VALID (7->5), adaptive avg-pool to 2x2, fc 512, fc classes.
    226k parameters and 11.7M forward MACs per image."""
    return sequential("feddrop_fmnist_cnn", input_shape, num_classes, [
        Conv("conv1", 32, 5, padding="SAME", bias=True, pool=2),
        Conv("conv2", 64, 5, padding="SAME", bias=True, pool=2),
        Conv("conv3", 64, 3, padding="VALID", bias=True),
        AvgPool(3, 2),
        Flatten(),
        Dense("fc1", 512, bias=True),
        Dense("fc2", num_classes, bias=True, relu=False),
    ], **options)


@register_model("feddrop_svhn_cnn")
def feddrop_svhn_cnn(input_shape, num_classes, **options):
    """Table 7 (32x32x3): conv 32 5x5 VALID (->28), maxpool 2, conv 64 5x5 VALID
    (->10), maxpool 2, conv 64 3x3 VALID (->3), avg-pool 2x2 stride 1 (->2),
    fc 512, fc classes. 227k parameters."""
    return sequential("feddrop_svhn_cnn", input_shape, num_classes, [
        Conv("conv1", 32, 5, padding="VALID", bias=True, pool=2),
        Conv("conv2", 64, 5, padding="VALID", bias=True, pool=2),
        Conv("conv3", 64, 3, padding="VALID", bias=True),
        AvgPool(2, 1),
        Flatten(),
        Dense("fc1", 512, bias=True),
        Dense("fc2", num_classes, bias=True, relu=False),
    ], **options)


@register_model("feddrop_vgg9")
def feddrop_vgg9(input_shape, num_classes, **options):
    """Table 8 (32x32x3): 3x3 SAME convs 32, 64, M, 128, 128, M, 256, 256, then an
    8x8 average pool (= global average pooling), fc 512, fc 512, fc classes; no
    BatchNorm. 1.53M parameters, 134M forward MACs. The reference notes write a
    third max-pool before the global pool; Table 8 (shapes and FLOPs: conv5/6
    run on 8x8 maps) has none, and we follow the table."""
    return sequential("feddrop_vgg9", input_shape, num_classes, [
        Conv("conv1", 32, 3, padding="SAME", bias=True),
        Conv("conv2", 64, 3, padding="SAME", bias=True, pool=2),
        Conv("conv3", 128, 3, padding="SAME", bias=True),
        Conv("conv4", 128, 3, padding="SAME", bias=True, pool=2),
        Conv("conv5", 256, 3, padding="SAME", bias=True),
        Conv("conv6", 256, 3, padding="SAME", bias=True),
        GlobalAvgPool(),
        Dense("fc1", 512, bias=True),
        Dense("fc2", 512, bias=True),
        Dense("fc3", num_classes, bias=True, relu=False),
    ], **options)


__all__ = ["feddrop_fmnist_cnn", "feddrop_svhn_cnn", "feddrop_vgg9"]
