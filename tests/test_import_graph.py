"""The import graph of `rlhf_mcore/`: no cycle, and the layering rules (issue 33, item 4), read from the source.

Every import statement of a module counts, wherever it is: module level, inside a function, under
`if TYPE_CHECKING:`. A lazy import that closes a cycle only hides it until the day both modules are imported
in the other order; a component that reaches up into the trainer at function level depends on it all the same.
`from package import name` resolves to the submodule `name` when there is one, and to the module a package's
`_LAZY = {name: module}` table loads it from (PEP 562 lazy packages such as `rlhf_mcore.models` and
`rlhf_mcore.data`), so a lazy re-export hides no edge.

The layering rules are data (:data:`RULES`): who, what it must not import, what it may import anyway, and why.
Nothing is imported here: the checks parse the files, so they take well under a second.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The packages below the trainer: they never import `rlhf_mcore.trainer` or the launchers.
COMPONENTS = ("data", "parallel", "algos", "rewards", "models", "engine", "rollout", "sync", "agents", "vla")


@dataclass(frozen=True)
class Rule:
    """Modules matching `source` import nothing matching `forbidden`, unless it also matches `allowed`.

    A pattern `a.b` matches `a.b` and everything below it (`a.b.c`); `=a.b` matches `a.b` only. `lazy_allowed`
    patterns are allowed too, but only inside functions (asked lazily, never at import time)."""

    name: str
    source: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    lazy_allowed: tuple[str, ...] = ()
    why: str = ""


RULES = [
    *[Rule(f"{c}-below-trainer", f"rlhf_mcore.{c}", ("rlhf_mcore.trainer", "launch"),
           why="components sit below the trainer and the launchers, which compose them") for c in COMPONENTS],
    Rule("rewards-build-no-engines", "rlhf_mcore.rewards",
         forbidden=("rlhf_mcore.engine", "rlhf_mcore.models.builder", "rlhf_mcore.rollout"),
         allowed=("rlhf_mcore.rollout.base",),  # SamplingParams and the other plain types
         why="rewards score rows; the engines they score with (reward model, judge) are built by "
             "rlhf_mcore.trainer.roles, which builds the other roles (rollout's builder is its package __init__)"),
    Rule("config-imports-no-component", "rlhf_mcore.config",  # the module today, the package and its modules after
         forbidden=("rlhf_mcore", "torch", "megatron", "transformers"),
         allowed=("rlhf_mcore.config", "rlhf_mcore.errors", "rlhf_mcore.registry"),
         # the cross-field checks (config/cross.py) ask the registries and a few torch-free modules, lazily;
         # tests/test_config_imports.py checks in a fresh interpreter that none of them loads torch
         lazy_allowed=("=rlhf_mcore.algos", "=rlhf_mcore.algos.names", "rlhf_mcore.rewards.registry",
                       "=rlhf_mcore.rewards.judge_template", "=rlhf_mcore.models.pipeline_layout"),
         why="loading a config imports no component, torch nor an engine (issue 33, item 2)"),
]


def _match(name: str, pattern: str) -> bool:
    if pattern.startswith("="):
        return name == pattern[1:]
    return name == pattern or name.startswith(pattern + ".")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str  # a module of the tree, or the top-level name of anything else ("torch", "launch.generate")
    line: int
    lazy: bool  # inside a function


def module_files(root: Path, package: str = "rlhf_mcore") -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root/package` (a package by its __init__.py)."""
    out = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    """A package __init__'s `_LAZY = {"name": "module", ...}` (PEP 562 re-exports), else {}."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
    return {}


def _function_level(tree: ast.Module) -> set[int]:
    """ids of the import nodes that sit inside a function (or lambda) body."""
    inner = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inner


@functools.cache
def import_edges(root: Path = ROOT) -> tuple[Edge, ...]:
    """Every import of every module under `root/rlhf_mcore`, resolved to module names (module docstring)."""
    files = module_files(root)
    trees = {m: ast.parse(f.read_text(), str(f)) for m, f in files.items()}
    lazy = {m: _lazy_table(t) for m, t in trees.items() if files[m].name == "__init__.py"}

    def known(name: str) -> str:
        """The innermost module of the tree containing `name` ("a.b.C" -> "a.b"); other names as they are."""
        probe = name
        while probe and probe not in files:
            probe = probe.rpartition(".")[0]
        return probe or name

    edges = []
    for mod, tree in trees.items():
        inner = _function_level(tree)
        here = mod if files[mod].name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = []
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in files else lazy.get(base, {}).get(a.name) or known(base))
            else:
                continue
            edges += [Edge(mod, t, node.lineno, id(node) in inner) for t in targets if t != mod]
    return tuple(edges)


def find_cycles(edges) -> list[list[str]]:
    """One closed path `[a, b, ..., a]` per strongly connected component of more than one module (among the
    tree's own modules), through the component's first module by name, shortest first: so a failure names a
    concrete cycle. Sorted by that first module."""
    graph: dict[str, set[str]] = {e.source: set() for e in edges}
    for e in edges:
        if e.target in graph:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in sorted(components):
        start, members = comp[0], set(comp)
        paths, frontier, closed = {start: [start]}, [start], None
        while closed is None:  # breadth first inside the component, back to `start` (it is strongly connected)
            nxt = []
            for v in frontier:
                succ = sorted(graph[v] & members)
                if start in succ:
                    closed = paths[v] + [start]
                    break
                for w in succ:
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        cycles.append(closed)
    return cycles


def _describe(cycle: list[str], edges) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        e = next(e for e in edges if e.source == a and e.target == b)
        hops.append(f"{a} -> {b} (line {e.line}{', in a function' if e.lazy else ''})")
    return "; ".join(hops)


def violations(rule: Rule, edges) -> list[str]:
    out = []
    for e in edges:
        if not _match(e.source, rule.source) or not any(_match(e.target, p) for p in rule.forbidden):
            continue
        if any(_match(e.target, p) for p in rule.allowed):
            continue
        if e.lazy and any(_match(e.target, p) for p in rule.lazy_allowed):
            continue
        found = f"{e.source} imports {e.target} (line {e.line}{', in a function' if e.lazy else ''})"
        if found not in out:  # `from m import a, b` is one finding
            out.append(found)
    return out


def test_no_import_cycle_in_rlhf_mcore():
    """No cycle among the modules of rlhf_mcore/, function-level imports included; each cycle is reported by the
    modules on it and the import lines that close it.
    Mutation: add `from rlhf_mcore.agents.runner import AgentStream` inside a function of agents/loops.py -> fails
    naming rlhf_mcore.agents.loops <-> rlhf_mcore.agents.runner."""
    edges = import_edges()
    cycles = find_cycles(edges)
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(
        f"  {' <-> '.join(sorted(set(c)))}: {_describe(c, edges)}" for c in cycles)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_layering_rule(rule):
    """Mutation: add `from rlhf_mcore.trainer import roles` inside any function of a data/ module -> the rule
    `data-below-trainer` fails naming the module and line (a module-level one fails the same way)."""
    found = violations(rule, import_edges())
    assert not found, f"{rule.name} ({rule.why}):\n  " + "\n  ".join(found)


def test_the_checker_sees_lazy_imports_lazy_packages_and_relative_imports(tmp_path):
    """The walk on a small tree: a cycle closed by a function-level import, one closed through a package's `_LAZY`
    table, relative imports, and a rule broken inside a function. If the checker missed any of these, the two
    tests above could not fail for it. Mutation: count only module-level statements (iterate `tree.body` instead of
    `ast.walk(tree)`) -> fails."""
    pkg = tmp_path / "rlhf_mcore"
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from rlhf_mcore import b\n",  # a -> b, lazily
        "b.py": "from . import a\n",  # b -> a: cycle a <-> b
        "lazy/__init__.py": '_LAZY = {"Thing": "rlhf_mcore.lazy.impl"}\n',
        "lazy/impl.py": "from ..c import x\n",  # impl -> c
        "c.py": "x = 1\ndef g():\n    from rlhf_mcore.lazy import Thing\n",  # c -> lazy.impl through _LAZY
        "data/__init__.py": "",
        "data/d.py": "def h():\n    from rlhf_mcore.trainer import roles\n",
        "trainer/__init__.py": "",
        "trainer/roles.py": "",
        "errors.py": "",
        "algos/__init__.py": "",
        "rewards/__init__.py": "",
        "rewards/judge.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    edges = import_edges(tmp_path)
    assert find_cycles(edges) == [["rlhf_mcore.a", "rlhf_mcore.b", "rlhf_mcore.a"],
                                  ["rlhf_mcore.c", "rlhf_mcore.lazy.impl", "rlhf_mcore.c"]]
    assert violations(RULES[0], edges) == ["rlhf_mcore.data.d imports rlhf_mcore.trainer.roles (line 2, in a function)"]
    config_rule = next(r for r in RULES if r.name == "config-imports-no-component")
    (pkg / "config").mkdir()
    (pkg / "config" / "__init__.py").write_text("import torch\nfrom rlhf_mcore.errors import E\ndef v():\n"
                                                "    from rlhf_mcore import algos\n"
                                                "    from rlhf_mcore.rewards import judge\n")
    (pkg / "config" / "checks.py").write_text("from rlhf_mcore import algos\n")
    import_edges.cache_clear()
    found = violations(config_rule, import_edges(tmp_path))
    assert found == ["rlhf_mcore.config imports torch (line 1)",
                     "rlhf_mcore.config imports rlhf_mcore.rewards.judge (line 5, in a function)",
                     "rlhf_mcore.config.checks imports rlhf_mcore.algos (line 1)"], found
