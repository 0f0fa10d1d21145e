"""What a traced forward pass says about each weight layer: its inputs, its products, their contraction.

``from_flax`` runs the module's own code with each weight layer's call in a scope tagged with its name
(:func:`layer_scope`) and reads the jaxpr once (:func:`program_flow`), following every value through
sub-programs (``cond``: sources from every branch, MACs of the largest; ``scan``: its carry to a fixed point,
its body's products times its length) and conservatively (an equation's outputs depend on all its inputs).
Products inside a ``while`` loop are refused (``ValueError``): the program does not say its trip count.
docs/design.md, "Your Flax model", has the full description.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax
import jax.extend  # noqa: F401  (jax.extend.core: not imported by `import jax`)

TAG = "fjs_layer:"
_TAGGED = re.compile(re.escape(TAG) + r"([^/()\s]+)")

# A value's dependencies: (sources, parameters, made in). ``sources``: layer indices (-1: the model input) whose
# outputs it is computed from; ``parameters``: for a value computed from parameters alone (a kernel transform, a
# learned query), their labels; ``made in``: the layer whose call computed such a value (None outside every call).
_NONE: tuple = (frozenset(), frozenset(), None)
_PRODUCTS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass
class LayerFlow:
    """What the program does inside one weight layer's call. ``sources``: the layers (``-1``: the model input)
    whose outputs reach the call without passing another weight layer (a value computed inside a layer's call
    is that layer's output); the products there that multiply by the layer's own kernel (``kernel_products``,
    ``kernel_macs``, ``contractions``: entries each output sums over), and the others that involve data
    (``side_macs``, ``side``: per product, the parameters it multiplies; LoRA's ``x @ lora_a @ lora_b``),
    which the kernel's rows do not reach."""
    sources: set = dataclasses.field(default_factory=set)
    kernel_macs: int = 0
    kernel_products: int = 0
    contractions: set = dataclasses.field(default_factory=set)
    side_macs: int = 0
    side: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ProgramFlow:
    layers: dict            # layer name -> LayerFlow
    logits_sources: frozenset
    other_macs: int         # products outside every layer's call (attention's scores and values)


def layer_scope(name: str):
    """The ``jax.named_scope`` that attributes the products traced inside it to the layer ``name``
    (whose ``/`` are written ``::``: the name stack joins scopes with ``/``)."""
    return jax.named_scope(TAG + name.replace("/", "::"))


def _sub(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jax.extend.core.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _sub(v)]
    return []


def _join(*deps) -> tuple:
    sources = frozenset().union(*(d[0] for d in deps))
    if sources:
        return (sources, frozenset(), None)
    return (sources, frozenset().union(*(d[1] for d in deps)), next((d[2] for d in deps if d[2] is not None), None))


def _fixed_point(carry: list, step) -> list:
    """A loop's carry dependencies joined with ``step(carry)``'s until they stop growing (a finite, monotone
    lattice: a fixed point within a few rounds)."""
    for _ in range(64):
        new = [_join(c, o) for c, o in zip(carry, step(carry))]
        if new == carry:
            break
        carry = new
    return carry


def _contraction(eqn, weight: int) -> int:
    """How many entries each output of a product sums over (the contracted axes of its operands)."""
    if eqn.primitive.name == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[weight].aval.shape
        return int(math.prod(shape[d] for d in (lc if weight == 0 else rc)))
    rhs = eqn.invars[1].aval.shape
    return int(math.prod(rhs)) // int(rhs[eqn.params["dimension_numbers"].rhs_spec[0]])


def product_macs(eqn) -> int:
    """MACs of one equation, from its shapes: ``dot_general`` prod(lhs shape) x prod(rhs dims neither contracted
    nor batch); ``conv_general_dilated`` prod(output shape) x kh x kw x in/groups."""
    if eqn.primitive.name == "dot_general":
        lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
        (_, rc), (_, rb) = eqn.params["dimension_numbers"]
        return int(math.prod(lhs)) * int(math.prod(d for i, d in enumerate(rhs) if i not in tuple(rc) + tuple(rb)))
    return int(math.prod(eqn.outvars[0].aval.shape)) * _contraction(eqn, 1)


class _Flow:
    def __init__(self, index: dict):
        self.index = index
        self.layers = {name: LayerFlow() for name in index}
        self.other_macs = 0

    def total(self) -> int:
        return self.other_macs + sum(f.kernel_macs + f.side_macs for f in self.layers.values())

    def absorb(self, other: "_Flow", costs: bool) -> None:
        self.other_macs += other.other_macs if costs else 0
        for name, f in other.layers.items():
            mine = self.layers[name]
            mine.sources |= f.sources
            if costs:
                mine.kernel_macs += f.kernel_macs
                mine.kernel_products += f.kernel_products
                mine.contractions |= f.contractions
                mine.side_macs += f.side_macs
                mine.side += f.side

    def scope(self, eqn, inherited):
        """The layer of the innermost tag on the equation's name stack (a transform writes its scopes inside
        its own name, ``vmap(fjs_layer:conv1)``: ``nn.vmap``), else ``inherited``."""
        found = _TAGGED.findall(str(eqn.source_info.name_stack))
        layer = found[-1].replace("::", "/") if found else inherited
        return layer if layer in self.index else inherited

    def entering(self, deps: tuple, where) -> tuple:
        """A value as an equation in ``where`` reads it: computed from parameters alone inside another layer's
        call (a lookup of constant positions, a projection of a learned query), it is that layer's output."""
        if deps[2] is not None and deps[2] != where:
            return (frozenset({self.index[deps[2]]}), frozenset(), None)
        return deps

    def combine(self, ins: Sequence[tuple], where) -> tuple:
        deps = _join(*ins) if ins else _NONE
        if not deps[0]:
            return (deps[0], deps[1], where)   # parameters only (a kernel transform stays a parameter)
        if where is None:
            return deps
        self.layers[where].sources |= deps[0] - {self.index[where]}
        return (frozenset({self.index[where]}), frozenset(), None)

    def product(self, eqn, ins: Sequence[tuple], where, scale: int) -> None:
        macs = scale * product_macs(eqn)
        if where is None:
            self.other_macs += macs
            return
        kernel = ("params", where, "kernel")
        flow = self.layers[where]
        weight = [i for i, (s, p, _) in enumerate(ins[:2]) if not s and kernel in p]
        if weight:
            flow.kernel_macs += macs
            flow.kernel_products += 1
            flow.contractions.add(_contraction(eqn, weight[0]))
            return
        flow.side_macs += macs
        if any(d[0] for d in ins[:2]):   # data on one side: it runs per example, beside the kernel's product
            flow.side.append(sorted({label[-1] for s, p, _ in ins[:2] if not s for label in p}))

    def run(self, jaxpr, in_deps: Sequence[tuple], where, scale: int, costs: bool) -> list:
        env: dict = dict(zip(jaxpr.invars, in_deps))

        def of(v):
            return _NONE if isinstance(v, jax.extend.core.Literal) else env.get(v, _NONE)
        for eqn in jaxpr.eqns:
            here = self.scope(eqn, where)
            ins = [self.entering(of(v), here) for v in eqn.invars]
            name = eqn.primitive.name
            if name in _PRODUCTS and costs:
                self.product(eqn, ins, here, scale)
            subs = [j for value in eqn.params.values() for j in _sub(value)]
            if not subs:
                outs = [self.combine(ins, here)] * len(eqn.outvars)
            elif name == "scan":
                outs = self.scan(eqn, ins, here, scale, costs)
            elif name == "while":
                outs = self.loop(eqn, ins, here)
            elif name == "cond":
                outs = self.cond(eqn, ins, here, scale, costs)
            elif len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(eqn.outvars):
                outs = self.run(subs[0], ins, here, scale, costs)   # pjit, remat, custom_jvp/vjp, closed_call
            else:                                                   # anything else: every output from every input
                joined = _join(*ins) if ins else _NONE
                results = [self.run(j, [joined] * len(j.invars), here, scale, costs) for j in subs]
                outs = [_join(joined, *(d for r in results for d in r))] * len(eqn.outvars)
            for v, d in zip(eqn.outvars, outs):
                env[v] = d
        return [of(v) for v in jaxpr.outvars]

    def scan(self, eqn, ins, where, scale, costs):
        body = eqn.params["jaxpr"].jaxpr
        consts, carries = eqn.params["num_consts"], eqn.params["num_carry"]
        head, carry, xs = ins[:consts], list(ins[consts:consts + carries]), ins[consts + carries:]
        length = int(eqn.params["length"])
        carry = _fixed_point(carry, lambda c: self.run(body, head + c + xs, where, scale * length, False)[:carries])
        outs = self.run(body, head + carry + xs, where, scale * length, costs)
        return [_join(c, o) for c, o in zip(carry, outs[:carries])] + outs[carries:]

    def loop(self, eqn, ins, where):
        cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        body = eqn.params["body_jaxpr"].jaxpr
        probe = _Flow(self.index)
        for sub in _sub([eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]]):
            probe.run(sub, [_NONE] * len(sub.invars), where, 1, True)
        if probe.total():
            raise ValueError("the forward pass runs products inside a while loop, whose number of iterations the "
                             "program does not say (and reverse-mode training cannot differentiate); use a scan "
                             "(lax.scan, nn.scan, a fori_loop with static bounds)")
        consts, carry = ins[cond_n:cond_n + body_n], list(ins[cond_n + body_n:])
        return _fixed_point(carry, lambda c: self.run(body, consts + c, where, 1, False))

    def cond(self, eqn, ins, where, scale, costs):
        branches = []
        for branch in _sub(eqn.params["branches"]):
            flow = _Flow(self.index)
            branches.append((flow, flow.run(branch, ins[1:], where, scale, costs)))
        largest = max(branches, key=lambda b: b[0].total())[0] if branches else None
        for flow, _ in branches:
            self.absorb(flow, costs and flow is largest)
        return [_join(ins[0], *(outs[i] for _, outs in branches)) for i in range(len(eqn.outvars))]


def program_flow(jaxpr, in_labels: Sequence, layers: Sequence[str]) -> ProgramFlow:
    """The flow of ``jaxpr`` (its first output: the logits) for the weight layers ``layers`` (their scopes
    tagged by :func:`layer_scope`). ``in_labels``: per input variable, ``("input",)`` for the model's
    input (source ``-1``), a parameter's label (``("params", entry, leaf)``; a layer's kernel is
    ``("params", name, "kernel")``)."""
    index = {name: i for i, name in enumerate(layers)}
    deps = [(frozenset({-1}), frozenset(), None) if label == ("input",) else (frozenset(), frozenset({label}), None)
            for label in in_labels]
    flow = _Flow(index)
    logits = flow.entering(flow.run(jaxpr, deps, None, 1, True)[0], None)
    return ProgramFlow(flow.layers, logits[0], flow.other_macs)


__all__ = ["LayerFlow", "ProgramFlow", "TAG", "layer_scope", "product_macs", "program_flow"]
