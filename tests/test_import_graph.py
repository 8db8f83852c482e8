"""Imports run one way: no cycle among the modules of qerl_jax/ and pallas_kernels/ (module- and
function-level imports, parsed with ast), and pallas_kernels imports nothing from qerl_jax."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("qerl_jax", "pallas_kernels")


def _modules() -> dict[str, str]:
    """module name -> file path, for every .py file of the packages."""
    modules = {}
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = path
    return modules


def _imported(node, module: str, is_package: bool, known) -> set[str]:
    """The known modules an Import / ImportFrom node names (a name imported from a package is
    the submodule when one exists, else the package)."""
    targets = set()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            targets.add(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {}
    for module, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        edges = set()
        for node in ast.walk(tree):  # module level and inside functions alike
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, is_package, known)
        edges.discard(module)
        graph[module] = edges
    return graph


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "qerl_jax.quant.linear_op" in graph and "pallas_kernels.blockwise_matmul" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_pallas_kernels_import_nothing_from_qerl_jax():
    graph = import_graph()
    wrong = {module: sorted(t for t in targets if t.split(".")[0] == "qerl_jax")
             for module, targets in graph.items() if module.startswith("pallas_kernels")}
    assert not any(wrong.values()), wrong


def test_quant_imports_neither_models_nor_the_layers_above():
    """quant/ sits below models/ (which calls its linear op) and below the whole-model
    operations of model_quant/."""
    graph = import_graph()
    wrong = {module: sorted(t for t in targets
                            if t.startswith(("qerl_jax.models", "qerl_jax.model_quant",
                                             "qerl_jax.lora", "qerl_jax.sampling")))
             for module, targets in graph.items() if module.startswith("qerl_jax.quant")}
    assert not any(wrong.values()), wrong


def test_function_level_imports_are_edges():
    """An import inside a function is an edge (a lazy import hides no cycle)."""
    tree = ast.parse("def f():\n    from qerl_jax.quant import linear_op\n")
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges |= _imported(node, "qerl_jax.example", False, _modules())
    assert edges == {"qerl_jax.quant.linear_op"}
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
