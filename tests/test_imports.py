"""The package's imports run one way: no module imports, even inside a function, a module that imports it
back (directly or around a loop), and each stage of workload -> wrap -> schedule -> engine -> results reads
only the stages before it (DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_sim"
# a stage may not import these (the ones after it, and the scenario and CLI that sit on top)
LATER = {
    "fsdp_sim.workload": ("fsdp_sim.wrap", "fsdp_sim.schedule", "fsdp_sim.engine", "fsdp_sim.results",
                          "fsdp_sim.scenario", "fsdp_sim.cli"),
    "fsdp_sim.hardware": ("fsdp_sim.schedule", "fsdp_sim.engine", "fsdp_sim.results", "fsdp_sim.scenario",
                          "fsdp_sim.cli"),
    "fsdp_sim.schedule": ("fsdp_sim.engine", "fsdp_sim.results", "fsdp_sim.scenario", "fsdp_sim.cli"),
    "fsdp_sim.engine": ("fsdp_sim.schedule", "fsdp_sim.results", "fsdp_sim.scenario", "fsdp_sim.cli"),
    "fsdp_sim.results": ("fsdp_sim.cli",),
}
INTERFACE = {"fsdp_sim.schedule.ops"}  # the op graph: schedule's output, which the pricer and the engine read


def _name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> nx.DiGraph:
    """An edge a -> b for every `import` of package module b anywhere in a's source (function bodies too)."""
    modules = {_name(p, package): p for p in package.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not cycles, f"modules that import each other: {cycles}"


def test_stages_import_only_earlier_stages():
    wrong = [(a, b) for a, b in import_graph().edges for stage, later in LATER.items()
             if (a == stage or a.startswith(stage + ".")) and b.startswith(later) and b not in INTERFACE]
    assert not wrong, f"imports against the flow workload -> wrap -> schedule -> engine -> results: {wrong}"


def test_the_walk_sees_a_cycle(tmp_path):
    """The check itself: two modules importing each other inside functions form a cycle it reports."""
    pkg = tmp_path / "fsdp_sim"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from fsdp_sim.b import g\n")
    (pkg / "b.py").write_text("from . import a\n")
    assert nx.find_cycle(import_graph(pkg))
