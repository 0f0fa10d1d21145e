"""What a compiled round is made of, read from its program text: the program a platform would run
(lowered for any platform on this machine, e.g. ``"cuda"`` on a CPU-only host), its convolutions
(grouped ones are per-client kernels that a GPU runs about group by group) and the kernels one
iteration of its innermost loops launches.

    text = lowered_text(jax.jit(engine.round_step), state, data, platform="cuda")
    grouped_convolutions(text)           # [] when no convolution folds clients into groups
    loop_op_counts(compiled.as_text())   # per innermost while loop: {opcode: count}

Choices made while lowering (``lax.platform_dependent``, e.g. ``models.layers.conv2d``'s ``"auto"``)
follow ``platform``; choices a trace makes from ``jax.default_backend()`` follow this process.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter
from typing import Any, Callable

import jax

from fedjax_sparse.core.training import LOCAL_STEP_SCOPE, without_local_steps

# HLO instructions that launch no kernel of their own (bookkeeping, views, control flow whose bodies
# are counted separately).
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional",
              "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
              "get-dimension-size", "copy-done", "all-reduce-done", "send-done", "recv-done", "domain"}


def lowered_text(fn: Callable, *args, platform: str = "cuda") -> str:
    """StableHLO of ``fn(*args)`` lowered for ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)
    without needing that platform's device. ``fn`` may be jitted already."""
    jitted: Any = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jax.export.export(jitted, platforms=(platform,))(*args).mlir_module()


def convolutions(text: str) -> list[dict]:
    """Each ``stablehlo.convolution`` in a lowered program: its ``feature_group_count`` and
    ``batch_group_count`` (1 when absent) and the line."""
    found = []
    for line in text.splitlines():
        if "stablehlo.convolution" not in line:
            continue
        groups = {name: int(m.group(1)) if (m := re.search(rf"{name} = (\d+)", line)) else 1
                  for name in ("feature_group_count", "batch_group_count")}
        found.append({**groups, "line": line.strip()})
    return found


def grouped_convolutions(text: str) -> list[dict]:
    """The convolutions of a lowered program with a feature or batch group count above 1."""
    return [c for c in convolutions(text) if c["feature_group_count"] > 1 or c["batch_group_count"] > 1]


_GROUP_COUNT = re.compile(r"\b(feature_group_count|batch_group_count)=(\d+)")


def compiled_grouped_convolutions(hlo: str) -> list[str]:
    """The instructions of a compiled HLO module (``....compile().as_text()``: a convolution, or the
    library call a backend made of it, e.g. cuDNN's custom call) with a feature or batch group count
    above 1: what the backend itself runs, where :func:`grouped_convolutions` reads a lowered program."""
    return [line.strip() for line in hlo.splitlines()
            if any(int(count) > 1 for _, count in _GROUP_COUNT.findall(line))]


# An op's name where it is applied (``%1 = stablehlo.add``, ``%2 = "stablehlo.scatter"(``, ``stablehlo.return``),
# not where an attribute names its kind (``#stablehlo.scatter<...>``).
_OP_NAME = re.compile(r"(?:^|=)\s*\"?(?:stablehlo|chlo)\.([a-z_]+)", re.M)


def stablehlo_op_counts(text: str) -> Counter:
    """{op name: count} over a lowered (StableHLO) program, before any fusion."""
    return Counter(_OP_NAME.findall(text))


# ---------------------------------------------------------------- loops of a program
# ``training.run_local_epochs`` runs each local step under ``jax.named_scope(LOCAL_STEP_SCOPE)``: the scope
# reaches the ops' metadata, which is how the local-step loop is told from the loops around and inside it.

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = [^=]*?\b([a-z][a-z0-9\-]*)\(")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_CALLED = re.compile(r"\b(?:to_apply|true_computation|false_computation)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")


def _computations(hlo: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = comps.setdefault(m.group(1), [])
        elif line.strip() == "}":
            current = None
        else:
            current.append(line)
    return comps


def _direct_hlo_ops(name: str, comps: dict[str, list[str]], scope: str, seen: tuple = ()) -> tuple[Counter, int]:
    """Top-level opcodes of computation ``name``, the computations it calls or branches to (``call``,
    ``conditional``) inlined and nested ``while`` loops counted as one op each; and how many of them
    carry ``scope`` in their metadata."""
    ops: Counter = Counter()
    in_scope = 0
    for line in comps.get(name, []):
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            continue
        op = instruction.group(1)
        ops[op] += 1
        in_scope += scope in line
        if op in ("call", "conditional"):
            for m in _CALLED.finditer(line):
                callees = [m.group(1)] if m.group(1) else re.findall(r"%?([\w.\-]+)", m.group(2))
                for callee in callees:
                    if callee not in seen:
                        inner, inner_scope = _direct_hlo_ops(callee, comps, scope, seen + (callee,))
                        ops += inner
                        in_scope += inner_scope
    return ops, in_scope


def loop_op_counts(hlo: str, scope: str = LOCAL_STEP_SCOPE) -> list[dict]:
    """Every ``while`` loop of a compiled HLO module (``jit(f).lower(...).compile().as_text()``): the
    instructions one iteration of its body runs at top level, by opcode (a nested loop counts as one
    ``while``), ``kernels``: those that launch work of their own (fusions, library calls, copies...;
    on a GPU each is at least one kernel launch, what a CUDA graph or fewer, larger fusions would
    save), and ``in_scope``: how many come from code traced under ``jax.named_scope(scope)``. Sorted by
    ``in_scope``, then ``kernels``: in a round program the local-step loop comes first."""
    comps = _computations(hlo)
    loops = []
    for body in sorted({m.group(1) for lines in comps.values() for line in lines if (m := _WHILE_BODY.search(line))}):
        ops, in_scope = _direct_hlo_ops(body, comps, scope)
        kernels = sum(n for op, n in ops.items() if op not in _NO_KERNEL)
        loops.append({"body": body, "kernels": kernels, "in_scope": in_scope, "ops": dict(sorted(ops.items()))})
    return sorted(loops, key=lambda r: (-r["in_scope"], -r["kernels"]))


def _functions(text: str) -> dict[str, list[str]]:
    """{function name: its body lines} of a lowered module (``func.func ... @name(...) {`` to its ``}``)."""
    funcs: dict[str, list[str]] = {}
    name, depth = None, 0
    for line in text.splitlines():
        if name is None:
            m = re.search(r"func\.func (?:public |private )?@([\w.\-$]+)\(", line)
            if m and line.rstrip().endswith("{"):
                name, depth = m.group(1), 1
                funcs[name] = []
            continue
        depth += line.count("{") - line.count("}")
        if depth <= 0:
            name = None
        else:
            funcs[name].append(line)
    return funcs


def _scoped_locations(text: str, scope: str) -> set[str]:
    """The location aliases (``#loc12``) of a lowered module whose name path, followed through the
    aliases it refers to, contains ``scope``."""
    raw = dict(re.findall(r"^#(loc\d+) = (.*)$", text, flags=re.M))
    memo: dict[str, bool] = {}

    def scoped(alias: str, depth: int = 0) -> bool:
        if alias not in memo:
            memo[alias] = False  # cycles: not in scope
            body = raw.get(alias, "")
            memo[alias] = scope in body or (depth < 64 and any(scoped(a, depth + 1)
                                                                for a in re.findall(r"#(loc\d+)", body)))
        return memo[alias]
    return {a for a in raw if scoped(a)}


def _direct_stablehlo_ops(lines: list[str], funcs: dict[str, list[str]], scoped: set[str],
                          seen: tuple = ()) -> tuple[Counter, int]:
    """Ops of a region by name with the functions it calls inlined and each nested while's body left
    out (the while counts as one op); and how many ops sit at a location in ``scoped``."""
    ops: Counter = Counter()
    in_scope = 0
    skipping, depth = False, 0   # inside a nested while (its cond and body regions)
    for line in lines:
        if skipping:
            depth += line.count("{") - line.count("}")
            skipping = depth > 0
            continue
        for op in _OP_NAME.findall(line):
            ops[op] += 1
        m = re.search(r"loc\(#(loc\d+)\)\s*$", line)
        in_scope += bool(m and m.group(1) in scoped and re.search(r"\b(?:stablehlo|chlo)\.", line))
        for callee in re.findall(r"(?:func\.)?call @([\w.\-$]+)", line):
            if callee in funcs and callee not in seen:
                inner, inner_scope = _direct_stablehlo_ops(funcs[callee], funcs, scoped, seen + (callee,))
                ops += inner
                in_scope += inner_scope
        if "stablehlo.while(" in line:
            skipping, depth = True, line.count("{") - line.count("}")
    ops.pop("return", None)
    return ops, in_scope


def stablehlo_loop_op_counts(text: str, scope: str = LOCAL_STEP_SCOPE) -> list[dict]:
    """Every ``stablehlo.while`` of a lowered program (``lowered_text``): its body's ops by name
    before any fusion, called functions inlined and a nested loop counted as one ``while``
    (``total``), and ``in_scope`` as in :func:`loop_op_counts`, which orders them the same way. A
    platform's compiler fuses most elementwise ops; dots, convolutions, sorts, scatters and custom
    calls stay library calls or kernels of their own."""
    funcs = _functions(text)
    scoped = _scoped_locations(text, scope)
    loops = []
    for lines in funcs.values():
        for i, line in enumerate(lines):
            if "stablehlo.while(" not in line:
                continue
            depth, body_start = 0, None
            for j in range(i, len(lines)):
                if body_start is None and re.match(r"^\s*\} do \{\s*$", lines[j]) and depth == 1:
                    body_start = j + 1
                depth += lines[j].count("{") - lines[j].count("}")
                if body_start is not None and depth == 0:
                    ops, in_scope = _direct_stablehlo_ops(lines[body_start:j], funcs, scoped)
                    loops.append({"total": sum(ops.values()), "in_scope": in_scope, "ops": dict(sorted(ops.items()))})
                    break
    return sorted(loops, key=lambda r: (-r["in_scope"], -r["total"]))


# ---------------------------------------------------------------- what one local step costs
def _costs(analysis) -> dict | None:
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    if analysis is None:   # e.g. a program lowered on a GPU host for another platform: XLA gives no analysis
        return None
    return {"flops": float(analysis.get("flops", 0.0)), "bytes_accessed": float(analysis.get("bytes accessed", 0.0)),
            "transcendentals": float(analysis.get("transcendentals", 0.0))}


def local_step_cost(round_fn: Callable, *args, platforms: tuple[str, ...] = ("cpu", "cuda")) -> dict:
    """XLA's cost analysis of one iteration of the local-step loop of ``round_fn(*args)`` (a round
    whose clients train with ``training.run_local_epochs``): the round's cost less the same round
    traced with no local step; how and what it measures: docs/design.md, "What one local step costs".
    Per platform (``"cpu"``: compiled here, after fusion; ``"cuda"``: lowered for CUDA, before fusion):
    {flops, bytes_accessed, transcendentals, compiled}; None for a platform whose analysis XLA does not
    give here (on a GPU host, the program lowered for the CPU)."""
    out: dict[str, dict | None] = {}
    backend = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    for platform in platforms:
        costs = []
        for without in (False, True):
            jitted = jax.jit(lambda *a: round_fn(*a))   # a fresh trace: the context is read while tracing
            with without_local_steps() if without else contextlib.nullcontext():
                if platform == backend:
                    costs.append(_costs(jitted.lower(*args).compile().cost_analysis()))
                else:
                    costs.append(_costs(jitted.trace(*args).lower(lowering_platforms=(platform,)).cost_analysis()))
        whole, rest = costs
        out[platform] = (None if whole is None or rest is None
                         else {**{key: whole[key] - rest[key] for key in whole}, "compiled": platform == backend})
    return out
