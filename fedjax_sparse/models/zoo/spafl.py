"""The SpaFL paper's CIFAR models (Kim et al., NeurIPS 2024, Appendix A.1).

LeNet-5-Caffe (FMNIST) is ``lenet5_caffe`` in :mod:`fedjax_sparse.models.zoo.generic`.

* ``cnn7``: the CIFAR-10 "7-layer CNN" of the reference code: four 5x5 VALID
  convs (64, 64, 128, 128) each with BatchNorm + ReLU, max-pool after conv2
  and conv4, fc 512->128 (BN), fc 128->128 (BN), fc 128->classes; no biases;
  every weight layer is thresholded.
* ``resnet18_narrow``: the reference code's CIFAR-100 ResNet-18: 3x3 stem conv
  (+BN, ReLU), four stages of two WideResNet-style pre-activation basic
  blocks (BN-ReLU-conv-BN-ReLU-conv), stage widths ``width * (1, 2, 4, 8)``
  (``width=32`` in the code), 1x1 shortcut convs only where the channel count
  changes, 4x4 average pool, an unthresholded linear classifier with bias.
  ``width=64`` is the standard ResNet-18 whose counts the paper reports.
* ``vit_small``: the appendix's ViT (lucidrains' vit-pytorch as used by the
  reference code): patch 4, dim 128, depth 6, 8 heads of 64, MLP 256 (GELU),
  pre-LayerNorm, CLS pooling, no dropout. qkv, attention-out and both MLP
  linears are thresholded; patch embedding, embeddings, LayerNorms and the
  head are not.

The ResNet's pre-activation BatchNorms have entries of their own (``"<block>_preact"``,
``Model.channel_entries``), and it calls ``hooks.activation`` where each layer's output leaves it
(docs/baselines.md has where and why); the ViT does not call it. Both are ``sequential=False``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.base import (INITIALIZERS, Conv, Dense, Flatten, LayerInfo, Model,
                                       sequential, torch_default_init)
from fedjax_sparse.models.registry import register_model


# ---------------------------------------------------------------------------- CNN-7
@register_model("cnn7")
def cnn7(input_shape, num_classes, **options):
    """SpaFL's CIFAR-10 CNN (reference code ``masked_Conv4``), 650 thresholded
    rows on 32x32x3 inputs: 804,800 kernel weights plus 2x640 BatchNorm
    parameters and 2x640 running statistics."""
    return sequential("cnn7", input_shape, num_classes, [
        Conv("conv1", 64, 5, batch_norm=True),
        Conv("conv2", 64, 5, batch_norm=True, pool=2),
        Conv("conv3", 128, 5, batch_norm=True),
        Conv("conv4", 128, 5, batch_norm=True, pool=2),
        Flatten(),
        Dense("fc1", 128, batch_norm=True),
        Dense("fc2", 128, batch_norm=True),
        Dense("fc3", num_classes, relu=False),
    ], **options)


# ---------------------------------------------------------------------------- ResNet-18
def _conv_pt(x, kernel, stride: int, impl: str):
    """PyTorch-style conv: symmetric zero padding (k-1)/2, then VALID.

    (XLA's "SAME" pads stride-2 convs asymmetrically, which samples other pixels.)"""
    pad = (kernel.shape[0] - 1) // 2
    if pad:
        x = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    return L.conv2d(x, kernel, stride=stride, padding="VALID", impl=impl)


@register_model("resnet18_narrow")
def resnet18_narrow(input_shape, num_classes, *, width: int = 32, init: str = "torch",
                    conv_impl: str = "auto"):
    """Pre-activation ResNet-18 of SpaFL's CIFAR-100 code (see module docstring).

    ``width=32`` (code): 2,400 thresholded rows, 2,790,240 thresholded weights.
    ``width=64``: 4,800 rows and 11,159,232 weights, the paper's Appendix A.1 counts.
    """
    if init not in INITIALIZERS:
        raise ValueError(f"unknown init {init!r}; valid: {sorted(INITIALIZERS)}")
    init_w = INITIALIZERS[init]
    h, w, c_in = (int(s) for s in input_shape)
    widths = [width, 2 * width, 4 * width, 8 * width]
    infos: list[LayerInfo] = []
    infos.append(LayerInfo("conv1", "conv", (3, 3, c_in, width), c_in, width, h * w * 9 * c_in * width, None))
    blocks = []  # (prefix, in_planes, out_planes, stride)
    in_planes, size, previous = width, (h, w), "conv1"
    preacts = []  # (entry, weight layer whose output channels the stream carries)
    for stage, planes in enumerate(widths, start=1):
        for b in range(2):
            stride = 2 if (stage > 1 and b == 0) else 1
            prefix = f"layer{stage}_{b}"
            ho, wo = (size[0] - 1) // stride + 1, (size[1] - 1) // stride + 1
            infos.append(LayerInfo(f"{prefix}_conv1", "conv", (3, 3, in_planes, planes), in_planes, planes,
                                   ho * wo * 9 * in_planes * planes, previous))
            infos.append(LayerInfo(f"{prefix}_conv2", "conv", (3, 3, planes, planes), planes, planes,
                                   ho * wo * 9 * planes * planes, f"{prefix}_conv1"))
            if in_planes != planes:
                infos.append(LayerInfo(f"{prefix}_shortcut", "conv", (1, 1, in_planes, planes), in_planes,
                                       planes, ho * wo * in_planes * planes, previous))
            blocks.append((prefix, in_planes, planes, stride))
            preacts.append((f"{prefix}_preact", previous))
            in_planes, size, previous = planes, (ho, wo), f"{prefix}_conv2"
    if size[0] < 4 or size[1] < 4:
        raise ValueError(f"resnet18_narrow needs inputs of at least 32x32 (got {h}x{w})")
    pooled = (size[0] // 4) * (size[1] // 4) * in_planes  # F.avg_pool2d(out, 4), then flatten
    infos.append(LayerInfo("linear", "dense", (pooled, num_classes), pooled, num_classes,
                           pooled * num_classes, previous))

    def init_fn(key):
        params, stats = {}, {}
        keys = iter(jax.random.split(key, len(infos) + 1))
        for info in infos:
            params[info.name] = {"kernel": init_w(next(keys), info.kernel_shape, info.fan_in)}
        params["linear"]["bias"] = torch_default_init(next(keys), (num_classes,), pooled)
        bn, stats["conv1"] = L.batch_norm_variables(width)
        params["conv1"].update(bn)
        for prefix, cin, planes, _ in blocks:
            params[f"{prefix}_preact"], stats[f"{prefix}_preact"] = L.batch_norm_variables(cin)
            bn, stats[f"{prefix}_conv1"] = L.batch_norm_variables(planes)  # the BN between the two convs
            params[f"{prefix}_conv1"].update(bn)
        return {"params": params, "batch_stats": stats}

    def apply_fn(variables, x, *, train, hooks, sample_mask, rng):
        del rng
        params, stats = variables["params"], variables.get("batch_stats", {})
        new_stats = dict(stats)

        def bn_relu(name, h):
            p = params[name]
            h, new_stats[name] = L.batch_norm(h, p["bn_scale"], p["bn_bias"], stats[name],
                                              train=train, sample_mask=sample_mask)
            return jax.nn.relu(h)

        def conv(name, h, stride):
            return _conv_pt(h, hooks.kernel(name, params[name]["kernel"]), stride, conv_impl)

        out = hooks.activation("conv1", bn_relu("conv1", conv("conv1", x, 1)))
        for prefix, cin, planes, stride in blocks:
            # WideResNet BasicBlock: with a channel change the shortcut also sees the
            # pre-activated input; otherwise it is the identity on the raw input.
            # The pre-activation needs its own hook: BN + ReLU of a zeroed channel is
            # relu(bn_bias), not 0.
            act = hooks.activation(f"{prefix}_preact", bn_relu(f"{prefix}_preact", out))
            h = bn_relu(f"{prefix}_conv1", conv(f"{prefix}_conv1", act, stride))
            h = hooks.activation(f"{prefix}_conv1", h)
            h = hooks.activation(f"{prefix}_conv2", conv(f"{prefix}_conv2", h, 1))
            if cin != planes:
                shortcut = hooks.activation(f"{prefix}_shortcut", conv(f"{prefix}_shortcut", act, stride))
            else:
                shortcut = out
            out = shortcut + h
        out = L.avg_pool(out, 4).reshape(out.shape[0], -1)
        logits = L.dense(out, params["linear"]["kernel"]) + params["linear"]["bias"]
        return logits, new_stats

    return Model("resnet18_narrow", (h, w, c_in), int(num_classes), tuple(infos), init_fn, apply_fn,
                 sequential=False, channel_entries=tuple(preacts))


# ---------------------------------------------------------------------------- ViT
def patchify(x: jax.Array, patch: int) -> jax.Array:
    """[B, H, W, C] -> [B, (H/p)*(W/p), p*p*C]: patches in row-major order, each
    flattened as (p1, p2, c) -- einops 'b (h p1) (w p2) c -> b (h w) (p1 p2 c)',
    the layout of the reference code's patch embedding."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


@register_model("vit_small")
def vit_small(input_shape, num_classes, *, patch: int = 4, dim: int = 128, depth: int = 6,
              heads: int = 8, dim_head: int = 64, mlp_dim: int = 256, pool: str = "cls"):
    """SpaFL's ViT for CIFAR-10 (see module docstring). On 32x32x3 inputs:
    65 tokens, ``depth * (3*heads*dim_head + dim + mlp_dim + dim)`` = 12,288
    thresholded rows and 1,966,080 thresholded weights."""
    if pool not in ("cls", "mean"):
        raise ValueError(f"pool must be 'cls' or 'mean', got {pool!r}")
    h, w, c = (int(s) for s in input_shape)
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not divisible by the patch size {patch}")
    num_patches = (h // patch) * (w // patch)
    tokens = num_patches + 1
    patch_dim = c * patch * patch
    inner = heads * dim_head
    infos = [LayerInfo("patch_embed", "dense", (patch_dim, dim), patch_dim, dim, num_patches * patch_dim * dim)]
    previous = "patch_embed"
    for i in range(depth):
        for name, fan_in, fan_out in ((f"block{i}_qkv", dim, 3 * inner), (f"block{i}_attn_out", inner, dim),
                                      (f"block{i}_mlp1", dim, mlp_dim), (f"block{i}_mlp2", mlp_dim, dim)):
            infos.append(LayerInfo(name, "dense", (fan_in, fan_out), fan_in, fan_out,
                                   tokens * fan_in * fan_out, previous))
            previous = name
    infos.append(LayerInfo("head", "dense", (dim, num_classes), dim, num_classes, dim * num_classes, previous))

    def ln_entry():
        return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}

    def init_fn(key):
        keys = iter(jax.random.split(key, len(infos) + 4))
        params = {}
        for info in infos:
            params[info.name] = {"kernel": torch_default_init(next(keys), info.kernel_shape, info.fan_in)}
        params["patch_embed"]["bias"] = torch_default_init(next(keys), (dim,), patch_dim)
        params["head"]["bias"] = torch_default_init(next(keys), (num_classes,), dim)
        params["embedding"] = {"cls": jax.random.normal(next(keys), (dim,), jnp.float32),
                               "pos": jax.random.normal(next(keys), (tokens, dim), jnp.float32)}
        for i in range(depth):
            params[f"block{i}_ln1"], params[f"block{i}_ln2"] = ln_entry(), ln_entry()
        params["head_ln"] = ln_entry()
        return {"params": params, "batch_stats": {}}

    scale = dim_head ** -0.5

    def apply_fn(variables, x, *, train, hooks, sample_mask, rng):
        del train, sample_mask, rng
        params = variables["params"]
        b = x.shape[0]

        def linear(name, h):
            return L.dense(h, hooks.kernel(name, params[name]["kernel"]))

        def norm(name, h):
            return L.layer_norm(h, params[name]["scale"], params[name]["bias"])

        z = L.dense(patchify(x, patch), params["patch_embed"]["kernel"]) + params["patch_embed"]["bias"]
        cls = jnp.broadcast_to(params["embedding"]["cls"], (b, 1, dim))
        z = jnp.concatenate([cls, z], axis=1) + params["embedding"]["pos"]
        for i in range(depth):
            qkv = linear(f"block{i}_qkv", norm(f"block{i}_ln1", z))
            q, k, v = (t.reshape(b, tokens, heads, dim_head) for t in jnp.split(qkv, 3, axis=-1))
            attn = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale, axis=-1)
            out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, tokens, inner)
            z = z + linear(f"block{i}_attn_out", out)
            hidden = jax.nn.gelu(linear(f"block{i}_mlp1", norm(f"block{i}_ln2", z)), approximate=False)
            z = z + linear(f"block{i}_mlp2", hidden)
        pooled = z[:, 0] if pool == "cls" else z.mean(axis=1)
        pooled = norm("head_ln", pooled)
        logits = L.dense(pooled, params["head"]["kernel"]) + params["head"]["bias"]
        return logits, {}

    # Attention's score (q.k) and value (attn.v) products: tokens^2 x inner each per block, in no layer.
    attention_macs = depth * 2 * tokens * tokens * inner
    return Model("vit_small", (h, w, c), int(num_classes), tuple(infos), init_fn, apply_fn, sequential=False,
                 other_macs=attention_macs)

