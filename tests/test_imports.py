"""The package's imports, drawn as arrows between modules, have no circle and
never point from a lower layer up to a higher one.

Read from the source (every `import` statement, function-level ones too),
so a lazy import counts like any other. Layers, lowest first: the layer
itself (`keras_selfattn` outside `serving` and `export`), `serving`,
`export`, the command line (`keras_selfattn_cli`); inside `export`, the
formats never import what checks and stages them (`verify`, `pipeline`,
the public exporters). A private module (`_name`) is imported only from
inside its own package. The command line's table module is
`keras_selfattn_runtimes.table`, imported by name without `keras_selfattn`
(tested in test_cli_startup.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("keras_selfattn", "keras_selfattn_cli", "keras_selfattn_runtimes")
LAYERS = ("layer", "serving", "export", "cli")
# Modules of `export` above its formats: a format importing one of them
# would run from a lower layer back up.
ABOVE_FORMATS = (
    "keras_selfattn.export.forward.check",
    "keras_selfattn.export.pipeline",
    "keras_selfattn.export.forward",
    "keras_selfattn.export.forward.target",
    "keras_selfattn.export.decode_step",
    "keras_selfattn.export.parity.runner",
)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest module of ours that `name` names (a module or a name in
    one), or None for other packages."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _edges() -> dict[str, set[str]]:
    modules = _modules()
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[
                        : len(package.split(".")) - node.level + 1
                    ]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    edges[name].add(resolved)
                    break
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def _layer(module: str) -> str:
    if module.startswith("keras_selfattn_cli"):
        return "cli"
    for name in ("export", "serving"):
        if module.startswith(f"keras_selfattn.{name}"):
            return name
    return "layer"


def test_the_drawing_sees_the_imports():
    """The graph is the real one: known arrows are in it."""
    edges = _edges()
    assert "keras_selfattn.self_attention" in edges["keras_selfattn"]
    assert "keras_selfattn.export.formats" in edges["keras_selfattn.export.pipeline"]
    assert "keras_selfattn_cli._process" in edges["keras_selfattn_cli"]


def _reached(edges: dict[str, set[str]], prefix: str) -> set[str]:
    """Every module of ours that the modules named `prefix...` reach."""
    todo = [source for source in edges if source.startswith(prefix)]
    seen: set[str] = set()
    while todo:
        for target in edges[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_command_line_reads_the_table_without_importing_the_package():
    """Its way to the formats' table is `keras_selfattn_runtimes`, which
    imports nothing of `keras_selfattn`."""
    edges = _edges()
    assert edges["keras_selfattn_cli._table"] == {"keras_selfattn_runtimes.table"}
    runtimes = _reached(edges, "keras_selfattn_runtimes")
    assert not {t for t in runtimes if t.startswith("keras_selfattn.")}
    assert "keras_selfattn_cli._commands" in edges["keras_selfattn_cli"]
    reached = _reached(edges, "keras_selfattn_cli")
    assert {t for t in reached if t.startswith("keras_selfattn.")}  # commands do


def test_no_import_circle():
    assert _cycles(_edges()) == []


def test_no_import_runs_up_a_layer():
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in _edges().items()
        for target in targets
        if LAYERS.index(_layer(target)) > LAYERS.index(_layer(source))
    )
    assert upward == []


def test_formats_do_not_import_what_checks_and_stages_them():
    edges = _edges()
    formats = [m for m in edges if m.startswith("keras_selfattn.export.formats")]
    upward = sorted(
        f"{source} -> {target}"
        for source in formats
        for target in edges[source]
        if target in ABOVE_FORMATS
    )
    assert formats and upward == []


def test_a_circle_is_found():
    """The detector itself finds a circle and a chain's absence of one."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_owner(module: str) -> str | None:
    """The package a private module (`_name`, at any depth) belongs to:
    the modules inside it may import it, no other."""
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part.startswith("_") and index:
            return ".".join(parts[:index])
    return None


def test_no_private_module_is_imported_from_another_package():
    crossing = sorted(
        f"{source} -> {target}"
        for source, targets in _edges().items()
        for target in targets
        if (owner := _private_owner(target))
        and not source.startswith(f"{owner}.")
        and source != owner
    )
    assert crossing == []


def test_a_private_import_across_packages_is_found():
    """The rule sees a package reaching into another's private module, and
    lets a package's own modules (its subpackages too) in."""
    owner = _private_owner("keras_selfattn.export.formats._base")
    assert owner == "keras_selfattn.export.formats"
    assert not "keras_selfattn.export.generator._writer".startswith(f"{owner}.")
    assert "keras_selfattn.export.formats.onnx.format".startswith(f"{owner}.")
    assert _private_owner("keras_selfattn.export.forward.check") is None


def _names_keras_src(path: Path) -> bool:
    """Whether a module imports `keras.src` (an import statement, or a
    module name given to `importlib`)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        else:
            continue
        if any(name == "keras.src" or name.startswith("keras.src.") for name in names):
            return True
    return False


def test_keras_private_modules_are_imported_in_at_most_two_modules():
    """Keras's private names go through `keras_selfattn._keras_private`
    (CONTRIBUTING.md's "Keras's private names")."""
    importing = sorted(
        name for name, path in _modules().items() if _names_keras_src(path)
    )
    assert "keras_selfattn._keras_private" in importing
    assert len(importing) <= 2, importing
