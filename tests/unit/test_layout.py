"""The package's shape, measured from its source: no circle of imports (module-level,
lazy and ``TYPE_CHECKING`` imports alike), no module over 450 lines, no function over 80,
nothing of the repository's tools inside it, loggers named after their modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kafka_idem"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imported(name: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: dict[str, tuple[Path, bool]]) -> list[str]:
    """The modules of the package an import statement names (module or package)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix
                   for a in node.names]
    out = []
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        out.append(target)
    return [t for t in out if t]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules its imports load. Importing ``a.b.c`` also runs the
    ``__init__`` of ``a.b``: an edge to every enclosing package but the top one (which
    every import runs) and the importer's own (already running)."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, (path, is_package) in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in imported(name, is_package, node, known):
                if target == "kafka_idem":  # `from kafka_idem import X` inside the package
                    graph[name].add(target)
                while "." in target:
                    if target != name and not name.startswith(target + "."):
                        graph[name].add(target)
                    target = target.rpartition(".")[0]
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_circle_of_imports() -> None:
    assert circles(import_graph()) == []


def test_no_module_over_the_limit() -> None:
    long = {str(path.relative_to(PACKAGE.parent)): n for path, _ in modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_over_the_limit() -> None:
    long = {}
    for path, _ in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = lines
    assert long == {}


@pytest.mark.parametrize("needle", ["sys.path.insert", "sys.path.append", "tools.chaos"])
def test_the_package_holds_no_repository_tool(needle: str) -> None:
    allowed = {"kafka_idem/cli/common.py"}  # `kafka-idem run MODULE:APP`: the current directory
    found = [str(path.relative_to(PACKAGE.parent)) for path, _ in modules().values()
             if needle in path.read_text()]
    assert sorted(set(found) - allowed) == []


def test_loggers_are_named_after_their_modules() -> None:
    """A module's own logger (a module-level ``x = logging.getLogger(...)``) is ``__name__``."""
    named = []
    for path, _ in modules().values():
        for node in ast.parse(path.read_text()).body:
            call = node.value if isinstance(node, ast.Assign) else None
            if (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "getLogger"
                    and not (call.args and isinstance(call.args[0], ast.Name)
                             and call.args[0].id == "__name__")):
                named.append(f"{path.relative_to(PACKAGE.parent)}: {ast.unparse(call)}")
    # the one exception: a child logger kept silent while librdkafka's options are checked
    assert named == [
        "kafka_idem/settings/checks.py: logging.getLogger('kafka_idem.settings.check')"]


# The layers of the package, top first (docs/ARCHITECTURE.md, "What may import what"):
# a module imports only modules of its own layer or of the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kafka_idem", "kafka_idem.cli"),
    ("kafka_idem.verify", "kafka_idem.testing", "kafka_idem.console"),
    ("kafka_idem.replay",),
    ("kafka_idem.consume",),  # the member's loop: runner, offsets, lag, shutdown...
    ("kafka_idem.consume.concurrency",),
    ("kafka_idem.consume.paths",),
    ("kafka_idem.consume.outcome", "kafka_idem.consume.partitions", "kafka_idem.consume.parking",
     "kafka_idem.consume.committable",
     "kafka_idem.consume.config_hold", "kafka_idem.consume.tracing",
     "kafka_idem.consume.rate_limit"),
    ("kafka_idem.admin",),
    ("kafka_idem.app", "kafka_idem.registration", "kafka_idem.producer",
     "kafka_idem.codec_selection"),
    ("kafka_idem.outbox",),
    ("kafka_idem.handler", "kafka_idem.context"),
    ("kafka_idem.orm",),
    ("kafka_idem.codecs",),
    ("kafka_idem.store",),
    ("kafka_idem.settings",),
    ("kafka_idem.deadletters",),
    ("kafka_idem.keys", "kafka_idem.retry", "kafka_idem.observe"),
    ("kafka_idem.errors", "kafka_idem._version"),
)


def layer_of(module: str) -> int:
    """The index of the most specific layer entry naming ``module`` or a package of it."""
    best, depth = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and name.count(".") > depth:
                best, depth = i, name.count(".")
    return best


def test_every_module_has_a_layer() -> None:
    """Named by an entry of its own (not only as part of the top package)."""
    assert [m for m in modules() if m != "kafka_idem"
            and not any(m.startswith(n + ".") or m == n
                        for names in LAYERS for n in names if n != "kafka_idem")] == []


def test_imports_point_down_the_layers() -> None:
    upward = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
                    if layer_of(t) < layer_of(m))
    assert upward == []


# Packages whose exports are the user's API (documented in docs/reference/api.md), not only what
# other packages of kafka_idem use.
PUBLIC_PACKAGES = ("kafka_idem.codecs", "kafka_idem.testing", "kafka_idem.verify")
USERS = ("kafka_idem", "consumers", "bench", "tools", "tests")


def exports(init: Path) -> set[str]:
    """The names a package's ``__init__`` imports or defines (its ``__all__`` aside)."""
    names: set[str] = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)} - {"__all__"}
    return names - {"annotations"}


def test_a_package_exports_only_what_other_packages_use() -> None:
    """Every name a subpackage's ``__init__`` exports is used from outside it (by another
    package of kafka_idem, the examples, the benchmarks, the tools or the tests)."""
    root = PACKAGE.parent
    sources = {path: path.read_text() for folder in USERS
               for path in (root / folder).rglob("*.py")}
    unused = []
    for name, (path, is_package) in modules().items():
        if not is_package or name == "kafka_idem" or name in PUBLIC_PACKAGES:
            continue
        outside = [text for p, text in sources.items() if path.parent not in p.parents]
        leaf = name.rpartition(".")[2]
        for export in sorted(exports(path)):
            by_name = re.compile(rf"from {re.escape(name)} import "  # one line or (...)
                                 rf"(\([^)]*\b{export}\b[^)]*\)|[^\n(]*\b{export}\b)")
            by_module = re.compile(rf"\b{leaf}\.{export}\b")
            if not any(by_name.search(text) or by_module.search(text) for text in outside):
                unused.append(f"{name}.{export}")
    assert unused == []
