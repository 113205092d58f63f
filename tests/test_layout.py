"""The package's layout: no module imports itself back through others, counting the imports made
inside functions too (a lazy import hides a circle from Python, not from a reader); no folder
does either; the scheduler's and the workers' packages (two processes) do not import each other;
and no lower layer imports a higher one (``LAYERS``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "guidespec"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for target in graph[node]:
            if target == start:
                return path + [start]
            if target not in seen:
                seen.add(target)
                stack.append((target, path + [target]))
    return None


def test_no_module_imports_itself_back() -> None:
    graph = _graph()
    assert len(graph) > 50
    cycles = [cycle for name in sorted(graph) if (cycle := _cycle_through(graph, name))]
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_the_scheduler_and_the_workers_do_not_import_each_other() -> None:
    graph = _graph()
    for side, other in (("guidespec.scheduler", "guidespec.worker"), ("guidespec.worker", "guidespec.scheduler")):
        crossing = sorted(
            f"{m} -> {t}" for m, targets in graph.items() if m.startswith(side) for t in targets if t.startswith(other)
        )
        assert crossing == [], crossing


# The layers, lowest first: a unit (a folder of ``guidespec/`` or a module at its top) imports
# only units of its own layer or below, and no two units import each other, directly or round.
LAYERS = (
    ("envs", "native", "process_utils", "bitmask"),  # the ground floor: no guidespec imports but envs
    ("ipc", "cuda_ext", "protocol"),  # transport, the C draft channel, the messages
    ("config", "model_files", "grammar_backends", "prompts", "detokenizer", "output_text"),  # (text: the client's)
    ("scheduler", "worker"),  # the two kinds of engine process
    ("launch",),  # starting those processes
    ("llm", "guidespec"),  # the client (and the package's own exports)
    ("entrypoints",),  # what a user starts: all of it drives an LLM
)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _unit_graph() -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))
    return units


def test_every_unit_has_a_layer() -> None:
    layered = {unit for layer in LAYERS for unit in layer}
    assert set(_unit_graph()) == layered, set(_unit_graph()) ^ layered


def test_no_lower_layer_imports_a_higher_one() -> None:
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if rank[_unit(target)] > rank[_unit(module)]
    )
    assert upward == [], upward


def test_no_folder_imports_itself_back() -> None:
    units = _unit_graph()
    cycles = [cycle for name in sorted(units) if (cycle := _cycle_through(units, name))]
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)
