"""Imports run one way: no cycle among the modules of qerl_jax/, pallas_kernels/ and experiments/
(module- and function-level imports, parsed with ast), no cycle between qerl_jax's subpackages, and
the layering rules of LAYER_RULES (a package never imports the rooms above it)."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("qerl_jax", "pallas_kernels", "experiments")


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


# The CLI modules: entry points that nothing imports.
CLI_MODULES = ("qerl_jax.train", "qerl_jax.evaluate")

# (importing package, packages it must never import, why). A package is a module name prefix
# ("qerl_jax.quant" covers qerl_jax/quant/ and everything under it).
_ABOVE_MODELS = ("qerl_jax.rl", "qerl_jax.sampling", "qerl_jax.trainer", "qerl_jax.data",
                 "qerl_jax.rewards", "qerl_jax.aqn", "qerl_jax.lora", "qerl_jax.model_setup",
                 "qerl_jax.evaluation", "qerl_jax.warmup")
LAYER_RULES = (
    ("pallas_kernels", ("qerl_jax", "experiments"),
     "the kernels are arrays in, arrays out"),
    ("qerl_jax", ("experiments", "benchmarks"),
     "the library never imports the studies or benchmarks that use it"),
    ("qerl_jax.quant", ("qerl_jax.models", "qerl_jax.model_quant", "qerl_jax.parallel")
     + _ABOVE_MODELS,
     "formats and the linear op sit below the model, the mesh and the whole-model setup"),
    ("qerl_jax.models", ("qerl_jax.model_quant", "qerl_jax.quant.backends",
                         "qerl_jax.quant.kernel_registry", "qerl_jax.quant.kernels",
                         "pallas_kernels") + _ABOVE_MODELS,
     "the model knows nothing of RL, data, rewards or kernel policy"),
    ("qerl_jax.parallel", ("qerl_jax.models", "qerl_jax.model_quant") + _ABOVE_MODELS,
     "the mesh sits below the model that is laid out on it"),
    ("qerl_jax.data", ("qerl_jax.rewards", "qerl_jax.rl", "qerl_jax.sampling",
                       "qerl_jax.trainer", "qerl_jax.quant", "qerl_jax.model_quant"),
     "prompts and gold answers know nothing of how they are scored"),
    ("qerl_jax.rewards", ("qerl_jax.models", "qerl_jax.quant", "qerl_jax.model_quant",
                          "qerl_jax.parallel", "qerl_jax.data") + _ABOVE_MODELS[:-1],
     "rewards are pure Python scorers of (completion, gold)"),
    ("qerl_jax.rl", ("qerl_jax.sampling", "qerl_jax.trainer", "qerl_jax.data",
                     "qerl_jax.rewards", "qerl_jax.model_setup", "qerl_jax.model_quant"),
     "advantages, losses and the train step take arrays, not the sampler or the data"),
    ("qerl_jax.infra", ("qerl_jax.models", "qerl_jax.quant", "qerl_jax.model_quant",
                        "qerl_jax.parallel", "pallas_kernels") + _ABOVE_MODELS,
     "run infrastructure serves every layer and depends on none of them"),
    ("qerl_jax.registry", ("qerl_jax",),
     "the name registry imports nothing of the library (its entries load lazily)"),
)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layering_violations(graph) -> list[str]:
    """One line per import that breaks a rule of LAYER_RULES or imports a CLI module."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target in CLI_MODULES and module != target:
                wrong.append(f"{module} imports the CLI module {target}")
            for package, forbidden, why in LAYER_RULES:
                if not _under(module, package):
                    continue
                for room in forbidden:
                    if _under(target, room) and not _under(target, package):
                        wrong.append(f"{module} imports {target}: {why}")
    return wrong


def test_the_layering_rules_hold():
    graph = import_graph()
    wrong = layering_violations(graph)
    assert not wrong, "\n".join(wrong)


def _subpackage(module: str) -> str:
    """qerl_jax.quant.backends.xla -> qerl_jax.quant; top-level modules stay themselves."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_cycle_between_subpackages():
    """Collapsed to qerl_jax's subpackages and top-level modules, the graph has no cycle
    (quant <-> parallel once made one)."""
    graph = {}
    for module, targets in import_graph().items():
        if not module.startswith("qerl_jax"):
            continue
        node = _subpackage(module)
        graph.setdefault(node, set()).update(
            _subpackage(t) for t in targets if t.startswith("qerl_jax") and _subpackage(t) != node)
    cycle = _cycle(graph)
    assert cycle is None, "subpackage cycle: " + " -> ".join(cycle)


def test_the_rules_catch_a_wrong_way_edge():
    graph = {"qerl_jax.data.sources": {"qerl_jax.rewards.gsm8k"},
             "qerl_jax.trainer": {"qerl_jax.evaluate"},
             "qerl_jax.quant.backends.sharded": {"qerl_jax.parallel.mesh"},
             "qerl_jax.models.layers": {"qerl_jax.quant.linear_op"}}
    wrong = layering_violations(graph)
    assert len(wrong) == 3 and not any(w.startswith("qerl_jax.models") for w in wrong), wrong


def test_function_level_imports_are_edges():
    """An import inside a function is an edge (a lazy import hides no cycle)."""
    tree = ast.parse("def f():\n    from qerl_jax.quant import linear_op\n")
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges |= _imported(node, "qerl_jax.example", False, _modules())
    assert edges == {"qerl_jax.quant.linear_op"}
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
