"""The package's import graph: no cycles in `sparse_core` or `service`, and `sparse_core` never
imports `service` (the engine is usable without the server).

Every import counts, at module level or inside a function, and those under `TYPE_CHECKING` too:
a deferred import that dodges a cycle at run time is still two modules that need each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparse_core", "service")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules that `path` imports (a `from package import name` of a submodule
    counts as that submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # The deepest package module the import names.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imported_modules(p, modules) for p in files}
    # A package's __init__ is run by importing any of its modules: not an edge of its own
    # modules' cycles unless it imports them itself, which the walk above records.
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (as the modules around it), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_packages_have_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_sparse_core_never_imports_service():
    graph = import_graph()
    offenders = {
        module: sorted(dep for dep in deps if dep.split(".")[0] == "service")
        for module, deps in graph.items()
        if module.split(".")[0] == "sparse_core"
    }
    assert not {m: d for m, d in offenders.items() if d}


def test_the_ground_floor_imports_nothing_above_it():
    """The KV cache (`cache/`), the selection and the engine's vocabulary (the request, its
    settings and outputs, the host-device transfers) sit below the engine: none imports
    `sparse_core.engine`."""
    graph = import_graph()
    ground = [
        m for m in graph
        if m.startswith("sparse_core.cache")
        or m in ("sparse_core.selection", "sparse_core.sequence", "sparse_core.transfers",
                 "sparse_core.outputs", "sparse_core.sampling_params", "sparse_core.config")
    ]  # fmt: skip
    upward = {m: sorted(d for d in graph[m] if d.startswith("sparse_core.engine")) for m in ground}
    assert not {m: d for m, d in upward.items() if d}


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_ray_ingress_speaks_the_engines_vocabulary_without_loading_torch():
    """The ingress process (HTTP, routing, the request and its SamplingParams) imports no torch:
    `sparse_core` loads the engine only when its names are used."""
    script = (
        "import sys; import service.app, service.ray_app, service.router, service.protocol; "
        "from sparse_core.sampling_params import SamplingParams; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "from sparse_core import LLM; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("field", ["presence_penalty", "logit_bias"])
def test_the_sampling_fields_are_named_where_they_are_defined_mapped_and_used(field):
    """The OpenAI protocol (which maps onto SamplingParams), SamplingParams and the sampler:
    nothing between them copies the fields one by one. `logit_bias`, the last field added,
    took those three modules and nothing else."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    naming = sorted(module_name(p) for p in files if field in p.read_text())
    assert naming == [
        "service.protocol",
        "sparse_core.engine.sampler",
        "sparse_core.sampling_params",
    ]
