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

A loop whose trip count is not of that form counts once (as the cost analysis counts it).
"""

from __future__ import annotations

import dataclasses
import functools
import re

COMPUTATION_HEAD = re.compile(r"(ENTRY )?%([\w.\-]+) ")
_WHILE = re.compile(r"%[\w.\-]+ = .* while\(%([\w.\-]+)\), condition=%([\w.\-]+), body=%([\w.\-]+)")
_DEF = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*?)\)(?:, |$)")
_REF = re.compile(r"%([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


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


def loop_cost(text: str) -> Cost:
    """FLOPs and bytes of the module printed in ``text`` (``compiled.as_text()``), every loop
    body times its trip count (XLA's cost analysis of each body, on the CPU client)."""
    import jax
    from jax._src.lib import _jax
    from jaxlib import _hlo

    comps, entry = _computations(re.sub(r"\s?stack_frame_id=\d+", "", text))
    client = jax.local_devices(backend="cpu")[0].client

    @functools.cache
    def once(name: str) -> tuple[float, float]:
        seen, todo = set(), [name]
        while todo:  # the computations ``name`` reaches
            for ref in _REF.findall("\n".join(comps[todo.pop()][1:])):
                if ref in comps and ref not in seen and ref != name:
                    seen.add(ref)
                    todo.append(ref)
        module = "\n\n".join(
            ["HloModule loop_body", *("\n".join(comps[k]) for k in comps if k in seen)]
            + ["ENTRY " + "\n".join(comps[name])]
        )
        cost = _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(module))
        return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))

    loops = unknown = 0
    runs: dict[str, int] = {}

    def full(name: str, times: int) -> tuple[float, float]:
        nonlocal loops, unknown
        runs[name] = runs.get(name, 0) + times
        flops, nbytes = once(name)
        defs = None
        for line in comps[name][1:]:
            found = _WHILE.match(line.strip().removeprefix("ROOT "))
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
