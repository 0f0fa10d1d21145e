"""Multiply-accumulates read from a traced program: every ``dot_general`` and ``conv_general_dilated``.

``program_macs(fn, *args)`` traces ``fn`` (no FLOPs spent) and counts each product's MACs from its
shapes, recursing into sub-programs (``pjit``, ``custom_jvp``/``custom_vjp``, ``remat``, ``cond``: the
largest branch) and multiplying a ``scan``'s body by its length. A ``while`` loop's trip count is not in
the program: its products are refused (``ValueError``), as reverse-mode training could not run it anyway.

Products are attributed to the innermost ``jax.named_scope`` whose name starts with :data:`TAG` (the
Flax adapter wraps each weight layer's call in :func:`layer_scope`); the rest go to ``None``.

* ``dot_general``: prod(lhs shape) x prod(rhs dims neither contracted nor batch);
* ``conv_general_dilated``: prod(output shape) x prod(kernel shape) / (output features), i.e.
  output positions x kh x kw x in/groups (grouped and depthwise convolutions included).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Callable

import jax
import jax.extend  # noqa: F401  (jax.extend.core.ClosedJaxpr: not imported by `import jax`)

TAG = "fjs_layer:"


def dot_macs(eqn) -> int:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rc), (_, rb) = eqn.params["dimension_numbers"]
    free = [d for i, d in enumerate(rhs) if i not in tuple(rc) + tuple(rb)]
    return int(math.prod(lhs)) * int(math.prod(free))


def conv_macs(eqn) -> int:
    rhs = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    return int(math.prod(out)) * (int(math.prod(rhs)) // int(rhs[out_feature_dim]))


def layer_scope(name: str):
    """The ``jax.named_scope`` that attributes the products traced inside it to the layer ``name``
    (whose ``/`` are written ``::``: the name stack joins scopes with ``/``)."""
    return jax.named_scope(TAG + name.replace("/", "::"))


_TAGGED = re.compile(re.escape(TAG) + r"([^/()\s]+)")


def layer_of(eqn, inherited: str | None) -> str | None:
    """The innermost layer tag on the equation's name stack (a transform writes its scopes inside
    its own name, ``vmap(fjs_layer:conv1)``: ``nn.vmap``), else ``inherited``."""
    found = _TAGGED.findall(str(eqn.source_info.name_stack))
    return found[-1].replace("::", "/") if found else inherited


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def jaxpr_macs(jaxpr, counts: Counter | None = None, scale: int = 1, layer: str | None = None) -> Counter:
    """{layer tag (None: untagged): MACs} of one jaxpr (see the module docstring)."""
    counts = Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        where = layer_of(eqn, layer)
        if name == "dot_general":
            counts[where] += scale * dot_macs(eqn)
            continue
        if name == "conv_general_dilated":
            counts[where] += scale * conv_macs(eqn)
            continue
        if name == "while":
            inner: Counter = Counter()
            for sub in _sub_jaxprs([eqn.params.get("cond_jaxpr"), eqn.params.get("body_jaxpr")]):
                jaxpr_macs(sub, inner, 1, where)
            if sum(inner.values()):
                raise ValueError("the forward pass runs products inside a while loop, whose number of "
                                 "iterations the program does not say (and reverse-mode training cannot "
                                 "differentiate); use a scan (lax.scan, nn.scan, a fori_loop with static bounds)")
            continue
        if name == "cond":
            branches = [jaxpr_macs(b, Counter(), scale, where) for b in _sub_jaxprs(eqn.params["branches"])]
            if branches:
                counts.update(max(branches, key=lambda c: sum(c.values())))
            continue
        factor = int(eqn.params["length"]) if name == "scan" else 1
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                jaxpr_macs(sub, counts, scale * factor, where)
    return counts


def program_macs(fn: Callable, *args) -> Counter:
    """{layer tag or None: MACs} of ``fn(*args)``'s traced program (args may be ShapeDtypeStructs)."""
    return jaxpr_macs(jax.make_jaxpr(fn)(*args).jaxpr)


__all__ = ["TAG", "jaxpr_macs", "layer_scope", "program_macs"]
