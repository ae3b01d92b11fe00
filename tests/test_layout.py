"""The layout shows the architecture: no import cycles between modules (top-level or inside functions), the
algorithms (`spec/`) use no Ray and nothing above them, the runtime nothing of serving."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "orchestrator"


def _imports() -> dict[str, set[str]]:
    """module -> the orchestrator modules and the top-level packages it imports (anywhere in the file)."""
    files = {".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts): f for f in PACKAGE.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): f for name, f in files.items()}
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules or not m.startswith("orchestrator")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between modules (package __init__ re-exports aside), or None."""
    inits = {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").is_file()}
    edges = {m: {t for t in ts if t in graph and t not in inits and t != m} for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t] if t in path else [m, t]
            if t not in state and (found := visit(t, [*path, t])):
                return found
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_cycles():
    assert _cycle(_imports()) is None, _cycle(_imports())


def test_the_algorithms_use_no_ray_and_the_runtime_nothing_of_serving():
    graph = _imports()
    for module, imported in graph.items():
        tops = {m.split(".")[0] for m in imported} | {".".join(m.split(".")[:2]) for m in imported}
        if module.startswith("orchestrator.spec"):
            assert not tops & {"ray", "orchestrator.runtime", "orchestrator.engine", "orchestrator.serving"}, module
        if module.startswith("orchestrator.runtime"):
            assert "orchestrator.serving" not in tops, module


def test_every_module_imports_only_its_own_layer_or_below():
    """orchestrator/layout.py's LAYERS (the architecture page is generated from it) hold for every import."""
    from orchestrator.layout import LAYERS, layer_of

    graph = _imports()
    upward = []
    for module, imported in sorted(graph.items()):
        if module == "orchestrator":
            continue
        for target in sorted(t for t in imported if t in graph and t != "orchestrator"):
            if layer_of(target) > layer_of(module):
                upward.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not upward, "\n".join(upward)


def test_the_layer_check_catches_an_upward_import():
    from orchestrator.layout import layer_of

    assert layer_of("orchestrator.stats") < layer_of("orchestrator.evaluation.evaluate")
    assert layer_of("orchestrator.stats") < layer_of("orchestrator.demo")
    assert (
        layer_of("orchestrator.data.storage")
        < layer_of("orchestrator.spec.tree")
        < layer_of("orchestrator.data.collect")
    )
