"""jaxpar's import graph, read from the source with `ast`: no cycle, and no import runs up a layer; and the house's
limits on size: no module over 600 lines, no function over 80.

Every import counts, at module level, inside functions and under TYPE_CHECKING alike. A module's layer is
the subpackage it lives in (`jaxpar.core.plan` is in `core`); the package root, `jaxpar.cli` and the public
modules of one's own training loop (`TOP`) sit on top.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lowest first (`meshes` holds presets, data only): each layer may import only from the layers before it (and from within itself, without a cycle).
LAYERS = ("meshes", "core", "data", "parallel", "pipeline", "models", "train", "objectives", "planner", "interop", "run", "top")
TOP = ("jaxpar", "jaxpar.cli", "jaxpar.cli_weights", "jaxpar.checkpoint", "jaxpar.distributed", "jaxpar.inspect", "jaxpar.metrics")
SOURCES = {"jaxpar": ROOT / "jaxpar", "jaxpar.models": ROOT / "models", "jaxpar.meshes": ROOT / "meshes"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known) -> dict[str, int]:
    """The jaxpar modules `name` imports, each with the line of its first import there."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports the module; `from module import name` the module itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            module = resolve(target)
            if module and module != name:
                found.setdefault(module, node.lineno)
    return found


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "top"


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    strays = [name for name in graph() if name not in TOP and layer(name) == "top"]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


def test_no_import_runs_up_a_layer():
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)}) on line {line}"
              for a, targets in graph().items() for b, line in targets.items()
              if LAYERS.index(layer(b)) > LAYERS.index(layer(a))]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_sees_imports_inside_functions():
    """The reader itself: a function-level import is an edge (cli imports most of jaxpar only inside functions)."""
    assert "jaxpar.run.training" in graph()["jaxpar.cli"]


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80  # one idea per file, a function read at a glance


def test_no_module_is_over_600_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by what they do): {long}"


def test_no_function_is_over_80_lines():
    """From its `def` to its last line, nested functions counted in their outer one too."""
    long = [f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for name, path in modules().items() for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
