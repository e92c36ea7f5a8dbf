"""A compiled program's FLOPs and bytes with every loop counted at its trip count.

XLA's cost analysis (``compiled.cost_analysis()``) counts a ``while`` body once, whatever its
trip count. A train step has loops the planner cannot unroll: its micro-batches, the chunked
LM head, a scan over layers, and the loops the SPMD partitioner makes itself (with the weights
split over many chips, an all-gather followed by a matmul becomes a
``windowed_dot_general_body_ag`` loop over the shards). So the planner reads the optimised HLO
text: each loop's trip count (the ``known_trip_count`` XLA:CPU records, or else read from the
loop: ``counter < N`` in its condition, the counter starting from a constant and stepped by a
constant in its body, as the TPU compiler prints the partitioner's and JAX's loops) and each loop
body's cost from XLA's own cost analysis run on that body alone, then

    full(C) = once(C) + sum over the loops w of C: trips(w) * full(body(w)) - once(body(w))

A loop whose trip count is not of that form counts once (as the cost analysis counts it). A
``conditional``'s branches count their own loops the same way (the train step skips its empty
micro-batches with one).

The cost analysis also counts every byte an instruction reads or writes wherever it lives. The
TPU compiler keeps some in its on-chip VMEM (memory space 1 in the layouts it prints,
``{...S(1)}``): weights prefetched there by ``copy-start`` ahead of the matmul that reads them,
intermediates passed between fusions. Only HBM traffic bounds a step, so the bytes of operands
and results in memory space 1 are taken out (:func:`_off_hbm_bytes`, each such instruction's own
cost analysis); a ``copy-start``'s read from HBM stays. XLA:CPU programs have none.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax

COMPUTATION_HEAD = re.compile(r"(ENTRY )?%([\w.\-]+) ")
_WHILE = re.compile(r"%[\w.\-]+ = .* while\(%([\w.\-]+)\), condition=%([\w.\-]+), body=%([\w.\-]+)")
_DEF = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*?)\)(?:, |$)")
_REF = re.compile(r"%([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ON_CHIP = "S(1)"  # the TPU compiler's on-chip memory space (VMEM) in a printed layout
_ELEMENT = re.compile(r"(?:pred|token|[suf]\d+|bf16|f8\w*)\[[\d,]*\](?:\{[^{}]*\})?")
_PER_OPERAND = re.compile(r"bytes accessed(\d+|out)\{(\d*)\}")
# Control flow: the computations these instructions run are costed in place by the analysis (a
# fusion's or a reduction's computation is costed as part of its instruction).
_CONTROL = {
    "while": re.compile(r"(?:body|condition)=%([\w.\-]+)"),
    "call": re.compile(r"to_apply=%([\w.\-]+)"),
    "conditional": re.compile(r"(?:_computations?)=\{?((?:%[\w.\-]+(?:, )?)+)"),
}


@dataclasses.dataclass(frozen=True)
class Cost:
    """A program's per-device cost, loops at their trip counts. ``runs``: how many times each
    computation runs per call of the program (a loop body its loop's trip count times its
    caller's runs); ``unknown_trips``: loops counted once, their trip count not found."""

    flops: float
    bytes_accessed: float
    runs: dict[str, int] = dataclasses.field(repr=False)
    loops: int = 0
    unknown_trips: int = 0


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, name = "", None
    for line in text.splitlines():
        if name is None:
            head = COMPUTATION_HEAD.match(line)
            if head:
                name = head.group(2)
                comps[name] = [line.removeprefix("ENTRY ")]
                entry = name if head.group(1) else entry
        else:
            comps[name].append(line)
            if line == "}":
                name = None
    return comps, entry


def _definitions(lines: list[str]) -> dict[str, tuple[str, list[str], str]]:
    """Instruction name -> (opcode, operand names, the line)."""
    out = {}
    for line in lines[1:]:
        found = _DEF.match(line)
        if found:
            operands = re.sub(r"/\*.*?\*/", "", found.group(3))
            out[found.group(1)] = (found.group(2), _REF.findall(operands), line)
    return out


def _source(defs, name: str):
    """The instruction ``name`` is a copy of (through copies, bitcasts, converts), or None."""
    while name in defs:
        op, operands, _ = defs[name]
        if op not in ("copy", "bitcast", "convert") or len(operands) != 1:
            return defs[name]
        name = operands[0]
    return None


def _constant(defs, name: str) -> int | None:
    """The integer a scalar instruction holds, through copies; None if not a constant."""
    op, _, line = _source(defs, name) or ("", [], "")
    value = re.search(r"constant\((-?\d+)\)", line) if op == "constant" else None
    return int(value.group(1)) if value else None


def _step(comps, body: str, index: int) -> int | None:
    """What ``body`` adds to its tuple element ``index`` (the loop counter), if a constant."""
    defs = _definitions(comps[body])
    root = next((line for line in comps[body] if line.lstrip().startswith("ROOT ")), "")
    found = _DEF.match(root)
    if not found or found.group(2) != "tuple":
        return None
    elements = defs[found.group(1)][1]
    update = defs.get(elements[index]) if index < len(elements) else None
    if update is None or update[0] != "add" or len(update[1]) != 2:
        return None
    for counter, step in (update[1], update[1][::-1]):
        element = _source(defs, counter)
        if element and element[0] == "get-tuple-element" and f"index={index}," in element[2] + ",":
            return _constant(defs, step)
    return None


def _trips(comps, caller_defs, init: str, condition: str, body: str) -> int | None:
    """Trip count of ``while(init), condition=..., body=...`` when the condition is
    ``counter < N`` (or ``N > counter``) on a tuple element that starts from a constant and that
    the body steps by a constant; else None."""
    defs = _definitions(comps[condition])
    root = next((line for line in comps[condition] if "ROOT " in line), "")
    compare = re.search(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=(LT|GT)", root)
    if not compare:
        return None
    counter, bound = compare.group(1, 2)
    if compare.group(3) == "GT":
        counter, bound = bound, counter
    limit = _constant(defs, bound)
    element = _source(defs, counter)
    if limit is None or element is None or element[0] != "get-tuple-element":
        return None
    index = re.search(r"index=(\d+)", element[2])
    tuple_def = caller_defs.get(init)
    if not index or tuple_def is None or tuple_def[0] != "tuple":
        return None
    start = _constant(caller_defs, tuple_def[1][int(index.group(1))])
    step = _step(comps, body, int(index.group(1)))
    if start is None or not step or step < 0:
        return None
    return max(-(-(limit - start) // step), 0)


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes ``text[start]`` (``(`` or ``{``)."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "({"
        depth -= text[i] in ")}"
        if depth == 0:
            return i + 1
    return len(text)


def _instruction(line: str) -> tuple[str, str, str, str, str] | None:
    """``(name, shape, opcode, operands, attributes)`` of one instruction's line, or None."""
    found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if not found:
        return None
    rest = line[found.end() :]
    end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode = re.match(r"[\w\-]+", rest)
    if not opcode or len(rest) == opcode.end() or rest[opcode.end()] != "(":
        return None
    close = _closing(rest, opcode.end())
    return found.group(1), shape, opcode.group(0), rest[opcode.end() + 1 : close - 1], rest[close:]


def _element_bytes(element: str) -> int:
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", element).groups()
    width = re.match(r"[a-z]+(\d+)", dtype)  # s32, bf16, f8e4m3fn; pred and token: a byte
    bits = int(width.group(1)) if width else 8
    return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def _off_hbm_share(shape: str, skip: int | None = None) -> float:
    """The fraction of ``shape``'s bytes (a tuple's: of all its elements) that is not HBM
    traffic: elements in on-chip memory, and element ``skip`` (a copy-start's source alias)."""
    elements = _ELEMENT.findall(shape) if shape.startswith("(") else [shape]
    sizes = [_element_bytes(e) for e in elements]
    off = sum(size for i, size in enumerate(sizes) if _ON_CHIP in elements[i] or i == skip)
    return off / max(sum(sizes), 1)


def _alone(comps, shapes, shape: str, opcode: str, names: list[str], attributes: str) -> str:
    """A module of one instruction, its operands (``names``) as parameters."""
    args = [f"  p{i} = {shapes[n]} parameter({i})" for i, n in enumerate(names)]
    root = f"  ROOT r = {shape} {opcode}({', '.join(f'p{i}' for i in range(len(names)))})"
    callees = _reached(comps, _REF.findall(attributes))
    body = "\n".join([*args, root + attributes])
    called = ("\n".join(comps[c]) for c in comps if c in callees)
    return "\n\n".join(["HloModule alone", *called, "ENTRY e {\n" + body + "\n}"])


def _off_hbm_bytes(comps, name: str, analyse) -> float:
    """Bytes XLA's cost analysis counts for the instructions of computation ``name`` that are
    not HBM traffic, by the analysis of each instruction alone (``analyse(module_text)``):
    operands and results in on-chip memory; of an asynchronous copy (``copy-start``: source
    read, destination written) the source alias its result repeats, and all of its
    ``copy-done`` (which moves nothing more). The later halves of other asynchronous ops
    (``async-update``, ``async-done``, ``all-gather-done``...) cannot be costed alone: their
    bytes stay counted, as do those of any instruction ``analyse`` cannot cost alone (it
    returns ``{}``)."""
    parsed = [p for p in map(_instruction, comps[name][1:]) if p]
    shapes = {p[0]: p[1] for p in parsed}
    total = 0.0
    for _, shape, opcode, operands, attributes in parsed:
        names = _REF.findall(operands)
        if opcode in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant", *_CONTROL):
            continue  # no bytes of their own (control flow: its computations count theirs)
        if opcode == "custom-call":
            continue  # a kernel: the roofline costs its inside itself (and its printed
            # attributes can run over several lines)
        if _ON_CHIP not in shape and not any(_ON_CHIP in shapes.get(n, "") for n in names):
            continue
        if opcode.endswith("-done") and opcode != "copy-done" or opcode == "async-update":
            continue  # the later half of an asynchronous op does not stand alone: kept as counted
        cost = analyse(_alone(comps, shapes, shape, opcode, names, attributes))
        if opcode == "copy-done":
            total += cost.get("bytes accessed", 0.0)
            continue
        keys = [k for k in map(_PER_OPERAND.fullmatch, cost) if k]
        # Only the instruction's own operands (a fusion's analysis also leaves its inner
        # instructions' keys); a tuple's bytes may be keyed by element as well as whole.
        for which in ["out", *map(str, range(len(names)))]:
            operand = shape if which == "out" else shapes[names[int(which)]]
            by_element = {int(k[2]): cost[k[0]] for k in keys if k[1] == which and k[2]}
            if by_element:
                elements = _ELEMENT.findall(operand)
                total += sum(v for i, v in by_element.items() if _ON_CHIP in elements[i])
            else:
                skip = 1 if opcode == "copy-start" and which == "out" else None
                total += cost.get(f"bytes accessed{which}{{}}", 0.0) * _off_hbm_share(operand, skip)
    return total


def _reached(comps, names) -> set[str]:
    """The computations ``names`` reach (themselves included)."""
    seen, todo = set(), [n for n in names if n in comps]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [r for r in _REF.findall("\n".join(comps[name][1:])) if r in comps]
    return seen


def _control_flow(comps, name: str) -> set[str]:
    """``name`` and the computations it runs as control flow (loops, calls, branches), which
    the cost analysis of ``name`` costs instruction by instruction."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for line in comps[current][1:]:
            parsed = _instruction(line)
            if parsed and parsed[2] in _CONTROL:
                for group in _CONTROL[parsed[2]].findall(parsed[4]):
                    todo += [r for r in re.findall(r"[\w.\-]+", group) if r in comps]
    return seen


def loop_cost(text: str) -> Cost:
    """FLOPs and HBM bytes of the module printed in ``text`` (``compiled.as_text()``), every
    loop body times its trip count (XLA's cost analysis of each body, on the CPU client, less
    its on-chip bytes)."""
    # Lazy: JAX's private HLO bindings (they move between releases), loaded only where a
    # module's loops are costed.
    from jax._src.lib import _jax
    from jaxlib import _hlo

    comps, entry = _computations(re.sub(r"\s?stack_frame_id=\d+", "", text))
    client = jax.local_devices(backend="cpu")[0].client

    @functools.cache
    def once(name: str) -> tuple[float, float]:
        seen = _reached(comps, _REF.findall("\n".join(comps[name][1:]))) - {name}
        module = "\n\n".join(
            ["HloModule loop_body", *("\n".join(comps[k]) for k in comps if k in seen)]
            + ["ENTRY " + "\n".join(comps[name])]
        )
        cost = analyse(module)
        off_hbm = sum(off_hbm_bytes(c) for c in _control_flow(comps, name))
        return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)) - off_hbm

    def analyse(module: str) -> dict:
        return _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(module))

    def analyse_alone(module: str) -> dict:
        try:
            return analyse(module)
        except jax.errors.JaxRuntimeError:  # an instruction that does not stand alone
            return {}  # keeps the bytes the computation's analysis counted for it

    @functools.cache
    def off_hbm_bytes(name: str) -> float:
        on_chip = _ON_CHIP in "".join(comps[name])
        return _off_hbm_bytes(comps, name, analyse_alone) if on_chip else 0.0

    loops = unknown = 0
    runs: dict[str, int] = {}

    def full(name: str, times: int) -> tuple[float, float]:
        nonlocal loops, unknown
        runs[name] = runs.get(name, 0) + times
        flops, nbytes = once(name)
        defs = None
        for line in comps[name][1:]:
            found = _WHILE.match(line.strip().removeprefix("ROOT "))
            parsed = None if found else _instruction(line)
            if parsed and parsed[2] == "conditional":  # each branch's loops at their trips
                for group in _CONTROL["conditional"].findall(parsed[4]):
                    for branch in [r for r in re.findall(r"[\w.\-]+", group) if r in comps]:
                        (f_full, b_full), (f_once, b_once) = full(branch, times), once(branch)
                        flops, nbytes = flops + f_full - f_once, nbytes + b_full - b_once
                continue
            if not found:  # a fusion's, a call's computation: runs as often as its caller
                for ref in _REF.findall(line.partition(" = ")[2]):
                    if ref in comps and ref != name:
                        _mark(ref, times)
                continue
            defs = defs if defs is not None else _definitions(comps[name])
            init, condition, body = found.groups()
            known = _KNOWN_TRIPS.search(line)
            trips = int(known.group(1)) if known else _trips(comps, defs, init, condition, body)
            loops, unknown = loops + 1, unknown + (trips is None)
            (f_full, b_full), (f_once, b_once) = full(body, times * (trips or 1)), once(body)
            flops += (trips or 1) * f_full - f_once
            nbytes += (trips or 1) * b_full - b_once
        return flops, nbytes

    def _mark(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for line in comps[name][1:]:
            for ref in _REF.findall(line.partition(" = ")[2]):
                if ref in comps and ref != name:
                    _mark(ref, times)

    flops, nbytes = full(entry, 1)
    return Cost(flops, nbytes, runs, loops, unknown)
