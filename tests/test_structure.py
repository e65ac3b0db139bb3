"""The structure of reach/: the layers of docs/architecture.md, no import cycle, names.

Pure: every module under reach/ is parsed (not imported) and its imports read, those at
module level, inside functions and under ``if TYPE_CHECKING:`` alike.

- No module-level import cycle among reach/ modules. Imports inside functions and under
  ``TYPE_CHECKING`` run later or never, so they cannot form one and are left out.
- Every import goes to the importer's layer or a lower one, the layers read from the
  table in docs/architecture.md, so the document and the test cannot disagree. What an
  import loads counts too: importing ``reach.a.b`` runs ``reach/a/__init__.py`` and what it
  imports at module level, so a package's ``__init__`` loads nothing above the lowest
  layer of its modules.
- Every module in the package of its concept (a handful at the top), no module name
  twice; functions of at most 80 lines (but for the few named below, each with the
  change that removes it); only the transport imports nats-py.
- No await inside an except block of a module compiled with mypyc (setup.py's list).
- No test module imports another test module: what tests share lives in helper modules
  (``tests/*_helpers.py``) and fixtures (``tests/conftest.py``).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "reach"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

MAX_FUNCTION_LINES = 80

#: the modules that may import nats-py
NATS_IMPORTERS = {"reach.transport.*"}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    target: str
    line: int
    #: "module": runs on import; "function": runs when the function does; "typing": never
    kind: str

    def where(self) -> str:
        return f"{path_of(self.importer)}:{self.line}"


@dataclass(frozen=True, slots=True, order=True)
class Layer:
    number: int
    name: str

    def __str__(self) -> str:
        return f"layer {self.number} ({self.name})"


# -- the modules and their imports ------------------------------------------------------


@functools.cache
def modules() -> dict[str, Path]:
    """Every module under reach/ by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def path_of(module: str) -> str:
    return str(modules()[module].relative_to(ROOT))


def is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def ancestors(module: str) -> list[str]:
    """The packages whose ``__init__`` importing ``module`` runs, outermost first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _resolve(name: str) -> str | None:
    """The reach/ module ``name`` is, or is in (an attribute of a module)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.package = module if is_package(module) else module.rpartition(".")[0]
        self.kind = "module"
        self.found: list[Import] = []
        self.third_party: list[tuple[str, int]] = []

    def _nested(self, kind: str, nodes: list[ast.stmt]) -> None:
        outer, self.kind = self.kind, kind
        for node in nodes:
            self.visit(node)
        self.kind = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._nested("typing" if self.kind == "typing" else "function", node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._nested("typing", node.body)
            self._nested(self.kind, node.orelse)
        else:
            self.generic_visit(node)

    def _add(self, name: str, line: int) -> None:
        if name.split(".")[0] != "reach":
            self.third_party.append((name, line))
            return
        target = _resolve(name)
        assert target is not None, f"{path_of(self.module)}:{line}: no module {name}"
        if target != self.module:
            self.found.append(Import(self.module, target, line, self.kind))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            # ``from reach.x import y``: the module reach.x.y if there is one, else reach.x
            submodule = f"{source}.{alias.name}"
            self._add(submodule if submodule in modules() else source, node.lineno)


@functools.cache
def _parsed() -> dict[str, _Imports]:
    found = {}
    for module, path in modules().items():
        visitor = _Imports(module)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        found[module] = visitor
    return found


@functools.cache
def imports() -> list[Import]:
    return [found for visitor in _parsed().values() for found in visitor.found]


def eager(module: str) -> list[Import]:
    """What importing ``module`` imports at once (module level, outside TYPE_CHECKING)."""
    return [i for i in _parsed()[module].found if i.kind == "module"]


# -- the layers of docs/architecture.md ---------------------------------------------------


@functools.cache
def layer_table() -> dict[str, Layer]:
    """Each name of the table in the "Layers" section: a module, or ``pkg.*``."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers\n", 1)
    assert len(section) == 2, f"{ARCHITECTURE}: no '## Layers' section"
    body = section[1].split("\n## ", 1)[0]
    table: dict[str, Layer] = {}
    numbers = []
    for row in re.findall(r"^\|\s*(\d+)\s*\|([^|]+)\|([^|]+)\|\s*$", body, re.MULTILINE):
        layer = Layer(int(row[0]), row[1].strip())
        numbers.append(layer.number)
        for name in re.findall(r"`([^`]+)`", row[2]):
            assert name not in table, f"{ARCHITECTURE}: {name} is in {table[name]} and {layer}"
            table[name] = layer
    assert sorted(numbers) == list(range(1, len(numbers) + 1)), (
        f"{ARCHITECTURE}: the layers must be numbered 1..N once each, got {numbers}"
    )
    return table


def covers(entry: str, module: str) -> bool:
    if entry.endswith(".*"):
        package = entry[:-2]
        return module == package or module.startswith(package + ".")
    return module == entry


def entry_of(module: str) -> str | None:
    """The table's name for ``module``: itself if listed, else its nearest package's."""
    if module in layer_table():
        return module
    packages = [e for e in layer_table() if e.endswith(".*") and covers(e, module)]
    return max(packages, key=len, default=None)


def layer_of(module: str) -> Layer:
    """The layer of ``module``; one the table does not place (the first test reports it)
    counts as the bottom, so that importing it is never reported as well."""
    entry = entry_of(module)
    return Layer(0, "not placed") if entry is None else layer_table()[entry]


#: one step of what an import loads: the module, the import's file and line, and whether
#: the step is a package's ``__init__`` run for a module in it
Step = tuple[str, str, bool]


def loads(module: str) -> dict[str, list[Step]]:
    """The reach/ modules importing ``module`` loads, each with the chain that loads it:
    its module-level imports, what they import, and so on. Importing a module also runs
    the ``__init__`` of each package it is in (those ``module`` is not in itself): what
    that ``__init__`` imports is loaded too, though the package itself, which holds no
    code of its own to speak of, is not counted."""
    chains: dict[str, list[Step]] = {}
    queue: deque[tuple[str, list[Step]]] = deque([(module, [])])
    seen = {module}
    while queue:
        current, chain = queue.popleft()
        outer = set(ancestors(current)) | {current}
        for found in eager(current):
            for loaded in [*ancestors(found.target), found.target]:
                if loaded in outer or loaded in seen:
                    continue
                seen.add(loaded)
                package = loaded != found.target
                how = f"the package of {found.target}, " if package else ""
                step = [*chain, (loaded, how + found.where(), package)]
                if not package:
                    chains[loaded] = step
                queue.append((loaded, step))
    return chains


# -- the tests ---------------------------------------------------------------------------


def test_the_architecture_places_every_module_in_one_layer() -> None:
    problems = [
        f"{path_of(m)}: {m} has no layer in docs/architecture.md's table: add it to the row"
        " of the layer it belongs to"
        for m in modules()
        if entry_of(m) is None
    ]
    for entry in layer_table():
        named = [m for m in modules() if covers(entry, m)]
        if not named:
            problems.append(f"docs/architecture.md names {entry}, which is no module of reach/")
    assert not problems, "\n".join(problems)


def test_no_import_cycle_among_reach_modules() -> None:
    graph: dict[str, list[Import]] = {m: eager(m) for m in modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Import] = []
    cycles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        for edge in graph[module]:
            if state.get(edge.target) == 1:
                start = next(i for i, e in enumerate(path) if e.importer == edge.target)
                loop = [*path[start:], edge]
                cycles.append(" → ".join(f"{e.importer} ({e.where()})" for e in loop))
            elif edge.target not in state:
                path.append(edge)
                visit(edge.target)
                path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state and not path:
            visit(module)
    assert not cycles, "import cycles at module level:\n" + "\n".join(cycles)


def test_every_import_goes_to_the_same_layer_or_below() -> None:
    problems: list[str] = []
    for found in imports():
        if entry_of(found.importer) is None:
            continue  # not placed: the first test says so
        mine, theirs = layer_of(found.importer), layer_of(found.target)
        if theirs.number > mine.number:
            problems.append(
                f"{found.where()}: {found.importer} ({mine}) imports {found.target}"
                f" ({theirs}), a layer above it"
                + (" (inside a function)" if found.kind == "function" else "")
                + (" (under TYPE_CHECKING)" if found.kind == "typing" else "")
            )
    problems = list(dict.fromkeys(problems))  # one line per import statement
    assert not problems, "imports against docs/architecture.md's layers:\n" + "\n".join(problems)


def test_importing_a_module_loads_nothing_above_its_layer() -> None:
    problems = []
    for module in filter(entry_of, modules()):
        mine = layer_of(module)
        for loaded, chain in loads(module).items():
            # a chain of direct imports goes above the layer only where one import does,
            # which the test above reports; here: what a package's __init__ loads
            above = [m for m, _, package in chain if not package and layer_of(m) > mine]
            if above[:1] == [loaded] and any(package for _, _, package in chain):
                path = " → ".join([module, *(f"{m} ({how})" for m, how, _ in chain)])
                theirs = layer_of(loaded)
                problems.append(f"importing {module} ({mine}) loads {loaded} ({theirs}): {path}")
                break
    assert not problems, "\n".join(problems)


def test_a_package_init_loads_nothing_above_the_lowest_layer_in_its_package() -> None:
    # a package's __init__ runs before any module of the package is imported, so what it
    # loads at import is loaded by its lowest module too
    problems = []
    for package in (m for m in modules() if is_package(m)):
        inside = [m for m in modules() if covers(f"{package}.*", m) and entry_of(m)]
        lowest = min(inside, key=layer_of)
        for loaded, chain in loads(package).items():
            if layer_of(loaded) > layer_of(lowest):
                problems.append(
                    f"{path_of(package)} loads {loaded} ({layer_of(loaded)}) at import"
                    f" ({chain[0][1]}), and runs whenever {lowest} ({layer_of(lowest)}) is"
                    " imported: import it on first use (module __getattr__, as"
                    " reach/__init__.py does)"
                )
                break
    assert not problems, "\n".join(problems)


#: the modules that may sit at the top of reach/, beside the packages: what every
#: package uses (errors, time, settings, tasks, telemetry, lazy names), the build's check
#: and the test plugin
TOP_MODULES = {
    "__init__", "__main__", "errors", "clock", "deadline", "settings", "lazy", "tasks",
    "telemetry", "runtime", "native", "testing",
}  # fmt: skip


def test_every_module_lives_in_the_package_of_its_concept() -> None:
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top <= TOP_MODULES, (
        f"modules at the top of reach/: {sorted(top - TOP_MODULES)}: move each into the"
        " package of its concept (docs/architecture.md, 'Where is ...')"
    )


def test_no_module_name_twice() -> None:
    """One name, one module: ``reach/cli/`` aside, whose modules are named after their
    commands, no two modules share a file name (nor a name and its plural)."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem in ("__init__", "__main__") or path.parent.name == "cli":
            continue
        seen.setdefault(path.stem.removesuffix("s"), []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"module names used twice: {twice}"


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function in ``path``, decorators
    and docstring included."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                assert child.end_lineno is not None
                found.append((prefix + child.name, child.lineno, child.end_lineno - first + 1))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return found


def test_functions_are_at_most_80_lines() -> None:
    problems = []
    for module, path in modules().items():
        for name, line, length in _functions(path):
            if length > MAX_FUNCTION_LINES:
                problems.append(
                    f"{path_of(module)}:{line}: {name} is {length} lines"
                    f" (at most {MAX_FUNCTION_LINES}): split it"
                )
    assert not problems, "\n".join(problems)


def test_only_the_transport_imports_nats_py() -> None:
    problems = [
        f"{path_of(module)}:{line}: {module} imports {name}; only the transport"
        f" ({', '.join(sorted(NATS_IMPORTERS))}) imports nats-py"
        for module, visitor in _parsed().items()
        for name, line in visitor.third_party
        if name.split(".")[0] == "nats" and not any(covers(e, module) for e in NATS_IMPORTERS)
    ]
    assert not problems, "\n".join(problems)


# -- the compiled modules --------------------------------------------------------------


def test_no_compiled_module_awaits_inside_an_except_block() -> None:
    """mypyc's coroutines lose track of the exception being handled across an await in
    an except block: the wrong error escapes, or a handled one lingers. The compiled
    modules wait after the block instead."""
    root = Path(__file__).resolve().parent.parent
    setup = ast.parse((root / "setup.py").read_text())
    compiled = next(
        ast.literal_eval(node.value)
        for node in setup.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "COMPILED" for t in node.targets)
    )
    found = [
        f"{module}:{inner.lineno}"
        for module in compiled
        for node in ast.walk(ast.parse((root / module).read_text()))
        if isinstance(node, ast.ExceptHandler)
        for inner in ast.walk(node)
        if isinstance(inner, ast.Await)
    ]
    assert found == []


# -- the tests themselves --------------------------------------------------------------

TESTS = ROOT / "tests"


def _test_module_imports(path: Path) -> list[str]:
    """The test modules (``tests/**/test_*.py``) that the file at ``path`` imports."""
    package = ".".join(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            names = [source, *(f"{source}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            target = ROOT.joinpath(*name.split(".")).with_suffix(".py")
            if target.name.startswith("test_") and target.is_file():
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return found


def test_no_test_module_imports_another_test_module() -> None:
    paths = sorted(TESTS.rglob("*.py"))
    problems = [found for path in paths for found in _test_module_imports(path)]
    assert not problems, (
        "test modules import only helpers: move what they share to a tests/*_helpers.py"
        " module or a fixture in tests/conftest.py\n" + "\n".join(problems)
    )
