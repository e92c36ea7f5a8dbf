"""The shape of the house, counted: files over 600 lines, functions over 80 lines (docstrings
left out), functions of more than 10 parameters, ``# fmt: skip`` lines, import circles, arrows
that point up (a layer, or a room inside a package), private names imported across modules, and
imports inside functions that do not say why they are lazy (a comment on the import or just
above its block): imports sit at the top, where readers and these counts see the arrows.

``python tests/test_house.py`` prints the counts; the test holds each at zero.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[1]
PKG = ROOT / "delta_jax"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 10  # self and cls not counted: pass options whole instead of loose flags

# Wider signatures kept on purpose, each with its reason.
WIDE_SIGNATURES = {
    # Public keyword API: four of its inputs are the Transformer's own call inputs, passed
    # through; the rest are independent keyword-only switches, each with a default.
    "delta_jax.models.logprobs.token_logprobs",
    # Public keyword API (``Sampler.generate``): keyword-only request options with defaults.
    "delta_jax.sampling.sampler.generate",
    # A Pallas kernel: the pallas_call passes its ten refs positionally.
    "delta_jax.sampling.attention.trie_kernel._kernel",
}

# Layers, bottom first: a module may import its own layer and the ones below. The loss is at
# the bottom (other projects import it alone); entry points at the top. The demo is a model and
# data source beside data/ and envs/ (a tiny model warmed up on its task, like a hub download);
# the run's configuration sits above the stages it configures (it checks data's task names).
LAYERS = [
    ["losses"],
    ["extras", "deprecation", "distributed", "hub", "sharding", "models"],
    ["checkpoint", "data", "rewards", "envs", "sampling", "eval_sets", "eval_metrics", "demo"],
    ["config", "diagnostics"],
    ["rl", "eval"],
    ["plan"],
    ["compare", "cli"],
]

# Rooms inside a package, bottom first, named by the module or sub-package under it; the same
# rule holds between them, and the package's own facade sits above its rooms. In sampling the
# strategies, outputs, buckets, drafts and attention backends know nothing of the engine; the
# engine and the static loop run on them; the Sampler picks between the two.
ROOMS = {
    "sampling": [
        ["strategies", "output", "buckets", "speculation", "attention"],
        ["engine", "static", "partial"],
        ["sampler"],
    ],
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _reexports(mods: dict[str, Path]) -> dict[tuple[str, str], str]:
    """``(package, name) -> defining module`` for what each ``__init__`` imports and re-exports."""
    out = {}
    for mod, path in mods.items():
        if path.name != "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node, True)
                for a in node.names:
                    out[(mod, a.asname or a.name)] = src
    return out


def imports(mods: dict[str, Path]) -> dict[str, list[tuple[str, str, int]]]:
    """Per module: ``(imported module, name or "", line)``, package facades seen through."""
    again = _reexports(mods)
    out = defaultdict(list)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out[mod] += [(a.name, "", node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node, is_pkg)
                for a in node.names:
                    target = f"{src}.{a.name}"
                    if target in mods:
                        out[mod].append((target, "", node.lineno))
                    else:
                        seen = set()
                        while (src, a.name) in again and src not in seen:
                            seen.add(src)
                            src = again[(src, a.name)]
                        out[mod].append((src, a.name, node.lineno))
    return {m: [x for x in v if x[0].startswith("delta_jax")] for m, v in out.items()}


def long_files(mods) -> set[str]:
    return {
        f"{module_name(p)} ({n} lines)"
        for p in mods.values()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }


def long_functions(mods) -> set[str]:
    found = set()
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = node.end_lineno - node.lineno + 1
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                n -= doc.end_lineno - doc.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.add(f"{mod}.{node.name}")
    return found


def wide_functions(mods) -> set[str]:
    found = set()
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            named = [*args.posonlyargs, *args.args]
            n = len(named) + len(args.kwonlyargs)
            n -= bool(named) and named[0].arg in ("self", "cls")
            if n > MAX_PARAMETERS and f"{mod}.{node.name}" not in WIDE_SIGNATURES:
                found.add(f"{mod}.{node.name} ({n} parameters)")
    return found


def format_skips(mods) -> set[str]:
    return {
        f"{mod}:{i}"
        for mod, path in mods.items()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "# fmt: skip" in line
    }


def unexplained_lazy_imports(mods) -> set[str]:
    found = set()
    for mod, path in mods.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            nodes = [n for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
            spans = {i for n in nodes for i in range(n.lineno, n.end_lineno + 1)}
            for node in nodes:
                above = node.lineno - 1
                while above in spans:  # the line above the block of imports this one is in
                    above -= 1
                said = [lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)]
                if not any("#" in line for line in [*said, lines[above - 1]]):
                    found.add(f"{mod}:{node.lineno}")
    return found


def circles(mods) -> set[str]:
    """Strongly connected groups of modules (Tarjan), package ``__init__`` facades left out."""
    facades = {m for m, p in mods.items() if p.name == "__init__.py"}
    graph = {
        m: {t for t, _, _ in deps if t in mods and t not in facades and t != m}
        for m, deps in imports(mods).items()
        if m not in facades
    }
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(" <-> ".join(sorted(group)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return set(groups)


def layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise KeyError(f"{mod}: place its package in LAYERS")


def room(mod: str) -> int:
    """The module's room in its package's :data:`ROOMS` (0 for a package without rooms)."""
    parts = mod.split(".")
    rooms = ROOMS.get(parts[1], []) if len(parts) > 1 else []
    if not rooms:
        return 0
    if len(parts) == 2:
        return len(rooms)
    for i, names in enumerate(rooms):
        if parts[2] in names:
            return i
    raise KeyError(f"{mod}: place it in ROOMS[{parts[1]!r}]")


def points_up(m: str, t: str) -> bool:
    if layer(t) != layer(m):
        return layer(t) > layer(m)
    return m.split(".")[1] == t.split(".")[1] and room(t) > room(m)


def arrows_up(mods) -> set[str]:
    return {
        f"{m} -> {t}"
        for m, deps in imports(mods).items()
        if m != "delta_jax"
        for t, _, _ in deps
        if t in mods and t != "delta_jax" and points_up(m, t)
    }


def private_imports(mods) -> set[str]:
    """``from x import _name`` and ``x._name`` on an imported project module, across modules."""
    found = set()
    for mod, deps in imports(mods).items():
        found |= {
            f"{mod} -> {t}.{name}"
            for t, name, _ in deps
            if name.startswith("_") and not name.startswith("__") and t != mod
        }
        tree = ast.parse(mods[mod].read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name: a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node, mods[mod].name == "__init__.py")
                aliases |= {a.asname or a.name: f"{src}.{a.name}" for a in node.names}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and aliases.get(node.value.id, "") in mods
                and aliases[node.value.id] != mod
            ):
                found.add(f"{mod} -> {aliases[node.value.id]}.{node.attr}")
    return found


COUNTS = {
    "file": long_files,
    "function": long_functions,
    "parameters": wide_functions,
    "fmt_skip": format_skips,
    "lazy_import": unexplained_lazy_imports,
    "circle": circles,
    "up": arrows_up,
    "private": private_imports,
}


def count() -> dict[str, set[str]]:
    mods = modules()
    return {kind: fn(mods) for kind, fn in COUNTS.items()}


def test_the_count_finds_what_it_looks_for(tmp_path, monkeypatch):
    """The counters are not vacuous: a planted long file, long function, circle, arrow up,
    private import and unexplained lazy import are each found."""
    pkg = tmp_path / "delta_jax"
    (pkg / "losses").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "losses" / "__init__.py").write_text("from delta_jax.losses.a import f\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (pkg / "losses" / "a.py").write_text(
        "import delta_jax.losses.b\nfrom delta_jax.cli import run\n"
        f'def f():\n    """Doc."""\n{body}\n' + "\n" * MAX_FILE_LINES
    )
    (pkg / "losses" / "b.py").write_text(
        "from delta_jax.losses import f\nfrom delta_jax import cli\n"
    )
    (pkg / "losses" / "c.py").write_text(
        "_hidden = 1\n\n\ndef g(self, a, b, c, d, e, f, g, h, i, *, j, k): ...\n"
        "y = [1, 2]  # fmt: skip\n"
        "def h():\n    import os\n    import sys\n\n\n"
        "def k():\n    # Lazy: a reason.\n    import os\n    import sys\n"
    )
    (pkg / "cli.py").write_text("from delta_jax.losses.c import _hidden\n\ndef run(): ...\n")
    for room in ("sampling", "sampling/attention", "sampling/engine"):
        (pkg / room).mkdir()
        (pkg / room / "__init__.py").write_text("")
    (pkg / "sampling" / "engine" / "e.py").write_text("x = 1\n")
    (pkg / "sampling" / "attention" / "d.py").write_text(
        "from delta_jax.sampling.engine.e import x\n"
    )
    (pkg / "sampling" / "sampler.py").write_text("from delta_jax.sampling.engine.e import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    found = count()
    assert found["file"] == {
        f"delta_jax.losses.a ({MAX_FILE_LINES + 4 + MAX_FUNCTION_LINES} lines)"
    }
    assert found["function"] == {"delta_jax.losses.a.f"}
    assert found["parameters"] == {"delta_jax.losses.c.g (11 parameters)"}
    assert found["fmt_skip"] == {"delta_jax.losses.c:5"}
    assert found["lazy_import"] == {"delta_jax.losses.c:7", "delta_jax.losses.c:8"}
    assert found["circle"] == {"delta_jax.losses.a <-> delta_jax.losses.b"}
    assert found["up"] == {
        "delta_jax.losses.a -> delta_jax.cli",
        "delta_jax.losses.b -> delta_jax.cli",
        "delta_jax.sampling.attention.d -> delta_jax.sampling.engine.e",
    }
    assert found["private"] == {"delta_jax.cli -> delta_jax.losses.c._hidden"}


def test_the_house_holds():
    found = {kind: sorted(items) for kind, items in count().items() if items}
    assert not found, f"the house count: {found}"


if __name__ == "__main__":
    for kind, items in count().items():
        print(f"{kind}: {len(items)}")
        for item in sorted(items):
            print(f"  {item}")
