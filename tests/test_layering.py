"""The layering table of docs/architecture.md, checked on the source (imports parsed, nothing
imported).

Each layer is a package (or the group of public modules), and each has one rule: the layers it may
import and the third-party libraries it must never import. Every import in every module of the
layer counts, lazy and ``TYPE_CHECKING`` ones included: a lower layer that reaches up, even inside a
function, is a defect of the layout. Beyond the table:

- the pure engine logic (``engine_core._core``) reaches no event loop, socket or tensor library,
  directly or through the engine_core modules it imports;
- nothing in engine_core imports torch, triton or cupy; numpy only lazily inside a function and
  guarded against its absence.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "engine_core"

PUBLIC = (
    "config",
    "sampling_params",
    "outputs",
    "errors",
    "abc",
    "ngram",
    "spec",
    "kv_connector",
    "lora",
)
"""The public type modules: one layer, below everything private but ``_core``'s wire types."""

EVENT_LOOPS_SOCKETS_TENSORS = frozenset(
    {"anyio", "zmq", "trio", "asyncio", "sniffio", "torch", "triton", "cupy"}
)
NEVER_IMPORTED = frozenset({"torch", "triton", "cupy"})
LAZY_ONLY = frozenset({"numpy"})


@dataclass(frozen=True)
class Layer:
    may_import: frozenset[str]
    """The layers (as :func:`layer_of` names them) whose modules this layer may import."""
    never: frozenset[str] = frozenset()
    """Top-level third-party packages this layer must never import."""


def _layer(*names: str, never: frozenset[str] = frozenset()) -> Layer:
    return Layer(frozenset(names), never)


SURFACES = ("engine_core", "server", "cli", "_bench", "testing")
LAYERS: dict[str, Layer] = {
    # abc re-exports the scheduler output that backends read, which _core emits.
    "public": _layer("public", "_core", never=EVENT_LOOPS_SOCKETS_TENSORS),
    "_core": _layer("public", "_core", never=EVENT_LOOPS_SOCKETS_TENSORS),
    "_structured": _layer("public", "_core", "_structured", never=EVENT_LOOPS_SOCKETS_TENSORS),
    "_plugins": _layer("public", "_plugins", never=EVENT_LOOPS_SOCKETS_TENSORS),
    # The worker processes of multi-process backends (for backends, not for the core).
    "_workers": _layer("public", "_core", "_workers", never=NEVER_IMPORTED),
    "_engine": _layer("public", "_core", "_structured", "_plugins", "_engine"),
    "_frontend": _layer("public", "_core", "_structured", "_plugins", "_engine", "_frontend"),
    "testing": _layer("public", "_core", "_engine", "testing"),
    "server": _layer(
        "public",
        "_core",
        "_structured",
        "_plugins",
        "_engine",
        "_frontend",
        "server",
        "engine_core",
    ),
    "_bench": _layer(
        "public", "_core", "_plugins", "_engine", "_frontend", "_bench", "engine_core"
    ),
    "cli": _layer(
        "public",
        "_core",
        "_plugins",
        "_engine",
        "_frontend",
        "_bench",
        "server",
        "cli",
        "engine_core",
    ),
    "engine_core": _layer(
        "public", "_core", "_plugins", "_engine", "_frontend", "cli", "engine_core"
    ),
}


def layer_of(module: str) -> str | None:
    """The layer an engine_core module belongs to (None for modules outside engine_core)."""
    parts = module.split(".")
    if parts[0] != "engine_core":
        return None
    if len(parts) == 1 or parts[1] == "__main__":
        return "engine_core"
    return "public" if parts[1] in PUBLIC else parts[1]


@dataclass(frozen=True)
class Import:
    module: str
    """The absolute dotted name imported (for ``from a import b``: ``a`` and ``a.b``)."""
    line: int
    in_function: bool
    guarded: bool
    """Inside a ``try`` whose handlers catch ImportError (or broader)."""
    type_checking_only: bool


def _module_path(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "engine_core":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        if handler.type is None:
            return True
        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        for name in names:
            if isinstance(name, ast.Name) and name.id in (
                "ImportError",
                "ModuleNotFoundError",
                "Exception",
                "BaseException",
            ):
                return True
    return False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(module: str, path: Path | None = None) -> list[Import]:
    """The imports in ``module``'s source (read from ``path`` when given)."""
    path = path or _module_path(module)
    assert path is not None, module
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, guarded: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, node.lineno, in_function, guarded, type_checking))
            return
        if isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, path.name == "__init__.py")
            found.append(Import(base, node.lineno, in_function, guarded, type_checking))
            for alias in node.names:
                found.append(
                    Import(f"{base}.{alias.name}", node.lineno, in_function, guarded, type_checking)
                )
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, guarded, True)
            for child in node.orelse:
                visit(child, in_function, guarded, type_checking)
            return
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                visit(child, in_function, True, type_checking)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, in_function, guarded, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, guarded, type_checking)

    visit(tree, False, False, False)
    return found


def runtime_closure(module: str) -> dict[str, list[str]]:
    """Every module imported when ``module`` runs its top level (engine_core modules followed
    transitively), mapped to one import chain that reaches it.

    The package's ``__init__`` (the public surface, a higher layer) is not followed; importing
    the whole package is checked at run time by the subprocess test below.
    """
    chains: dict[str, list[str]] = {module: [module]}
    todo = [module]
    while todo:
        current = todo.pop()
        for imp in imports_of(current):
            if imp.in_function or imp.type_checking_only:
                continue
            name = imp.module
            if name.split(".")[0] == "engine_core" and _module_path(name) is None:
                continue  # ``from engine_core.x import name`` where name is not a module
            if name in chains:
                continue
            chains[name] = chains[current] + [name]
            if _module_path(name) is not None:
                todo.append(name)
    return chains


def all_package_modules() -> list[str]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    return modules


# -- the checker itself --------------------------------------------------------------------------


def test_checker_sees_imports_the_way_python_runs_them(tmp_path: Path) -> None:
    source = """
from __future__ import annotations
import json
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import anyio
try:
    import numpy as np
except ImportError:
    np = None
def f():
    import torch
    try:
        import numpy
    except ModuleNotFoundError:
        pass
"""
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    found = {
        (i.module, i.in_function, i.guarded, i.type_checking_only)
        for i in imports_of("engine_core.probe", probe)
    }
    assert ("json", False, False, False) in found
    assert ("anyio", False, False, True) in found
    assert ("numpy", False, True, False) in found
    assert ("torch", True, False, False) in found
    assert ("numpy", True, True, False) in found


def test_closure_follows_engine_core_imports() -> None:
    chains = runtime_closure("engine_core._core.scheduler")
    # The scheduler reaches the sampling parameters through the scheduler output.
    assert "engine_core.sampling_params" in chains
    assert "engine_core._core.block_pool" in chains
    assert "msgspec" in chains
    assert "xxhash" in chains
    # Imports only under TYPE_CHECKING are not followed.
    assert "engine_core.config" not in chains


# -- the rules ------------------------------------------------------------------------------------


def violations(module: str, path: Path | None = None) -> list[str]:
    """Each import of ``module`` that its layer's rule forbids, as ``module:line imports x``.

    ``from a import b`` names ``a`` and ``a.b``; the module actually imported is ``a.b`` when that
    is a module of engine_core, else ``a``.
    """
    layer = layer_of(module)
    assert layer in LAYERS, f"{module} belongs to no layer of the table ({layer})"
    rule = LAYERS[layer]
    by_line: dict[int, list[str]] = {}
    for imp in imports_of(module, path):
        by_line.setdefault(imp.line, []).append(imp.module)
    found = []
    for line, names in sorted(by_line.items()):
        resolved = [n for n in names if _module_path(n) is not None]
        modules = [n for n in resolved if not any(o.startswith(n + ".") for o in resolved)] or [
            min(names, key=len)
        ]
        for name in modules:
            target = layer_of(name)
            if target is None:
                bad = name.split(".")[0] in rule.never
            else:
                bad = target not in rule.may_import
            if bad:
                found.append(f"{module}:{line} imports {name}")
    return found


def test_every_module_belongs_to_a_layer() -> None:
    assert {layer_of(m) for m in all_package_modules()} == set(LAYERS)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layer_imports_only_what_its_rule_allows(layer: str) -> None:
    modules = [m for m in all_package_modules() if layer_of(m) == layer]
    assert modules
    assert [v for m in modules for v in violations(m)] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import anyio", "imports anyio"),
        ("def f():\n    import zmq", "imports zmq"),
        ("from engine_core._engine.core import EngineCore", "imports engine_core._engine.core"),
        ("from engine_core._frontend import llm", "imports engine_core._frontend.llm"),
        ("from engine_core import server", "imports engine_core.server"),
    ],
)
def test_rule_catches_core_reaching_up(tmp_path: Path, source: str, expected: str) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(f"from engine_core.config import EngineConfig\n{source}\n")
    found = violations("engine_core._core.probe", probe)
    assert len(found) == 1 and found[0].endswith(expected), found


def test_rule_lets_engine_import_core_but_not_frontend(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import anyio\nfrom engine_core._core.scheduler import Scheduler\n"
        "from engine_core._frontend.llm import LLM\n"
    )
    assert violations("engine_core._engine.probe", probe) == [
        "engine_core._engine.probe:3 imports engine_core._frontend.llm"
    ]


@pytest.mark.parametrize("module", [m for m in all_package_modules() if layer_of(m) == "_core"])
def test_pure_engine_logic_imports_no_event_loop_sockets_or_tensors(module: str) -> None:
    bad = {
        name: chain
        for name, chain in runtime_closure(module).items()
        if name.split(".")[0] in EVENT_LOOPS_SOCKETS_TENSORS
    }
    assert bad == {}, "forbidden imports (with the chain reaching them): " + "; ".join(
        " -> ".join(chain) for chain in bad.values()
    )


def imports_anywhere(libraries: frozenset[str]) -> list[tuple[str, Import]]:
    """Every import of one of ``libraries`` in the package, with the importing module."""
    return [
        (module, imp)
        for module in all_package_modules()
        for imp in imports_of(module)
        if imp.module.split(".")[0] in libraries
    ]


def test_package_never_imports_torch_triton_or_cupy() -> None:
    found = imports_anywhere(NEVER_IMPORTED)
    assert [f"{module}:{imp.line} imports {imp.module}" for module, imp in found] == []


def test_numpy_only_lazily_and_guarded() -> None:
    offenders = [
        f"{module}:{imp.line} imports {imp.module}"
        for module, imp in imports_anywhere(LAZY_ONLY)
        if not imp.type_checking_only and not (imp.in_function and imp.guarded)
    ]
    assert offenders == []


def test_importing_the_package_and_the_scheduler_loads_no_torch_or_zmq() -> None:
    code = (
        "import engine_core, engine_core._core.scheduler, sys; "
        "bad = [m for m in ('torch', 'zmq', 'triton', 'cupy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_ray_only_in_its_launcher_which_is_imported_only_when_asked_for() -> None:
    # Ray (the optional extra) is imported by ray_launch alone, and ray_launch only lazily
    # (inside the function that runs for data_parallel_backend="ray") or for type checking.
    ray_importers = {module for module, _ in imports_anywhere(frozenset({"ray"}))}
    assert ray_importers == {"engine_core._engine.ray.launch"}
    eager = [
        f"{module}:{imp.line}"
        for module in all_package_modules()
        for imp in imports_of(module)
        if imp.module.startswith("engine_core._engine.ray.launch")
        and not (imp.in_function or imp.type_checking_only)
        and module != "engine_core._engine.ray.launch"
    ]
    assert eager == []


def test_serving_without_the_ray_backend_loads_no_ray() -> None:
    code = (
        "import sys, engine_core, engine_core.cli, engine_core._engine.dp.client, "
        "engine_core._engine.ray.placement, engine_core._engine.main; "
        "from engine_core import LLM; "
        "llm = LLM(backend='mock', tokenizer='byte', multiprocess=True, data_parallel_size=2); "
        "llm.generate('abc', use_tqdm=False); llm.close(); "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- the rooms inside _engine ------------------------------------------------------------------

ENGINE_ROOMS: dict[str, frozenset[str]] = {
    # The engine step and what it settles at startup: no pipes, no clients, no process.
    "core": frozenset({"startup"}),
    "startup": frozenset(),
    # The messages and the pipes: below everything that uses them.
    "wire": frozenset(),
    "pipes": frozenset({"pipes"}),
    "runtime": frozenset(),
    # The engine-core process: the step served over the pipes.
    "proc": frozenset({"core", "pipes", "wire"}),
    "main": frozenset({"core", "proc", "pipes", "runtime", "wire"}),
    "__main__": frozenset({"main"}),
    # The clients: the interface, in-process, one process, several, and Ray's launcher.
    # (``client`` picks one: it imports them lazily.) What both sides of the pipe read lives
    # below them all, in ``_core.engine_io``: no client imports the engine step.
    "client": frozenset({"inproc_client", "mp", "dp"}),
    "inproc_client": frozenset({"client", "core"}),
    "mp": frozenset({"mp", "client", "pipes", "wire"}),
    "dp": frozenset({"dp", "mp", "client", "ray"}),
    "ray": frozenset({"ray", "mp", "main", "pipes", "wire"}),
}
"""Which rooms of ``engine_core._engine`` (a top-level module or a subpackage) each room may
import: the pipes and the messages know nothing of the clients, the engine step nothing of
pipes or processes."""


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["engine_core", "_engine"] or len(parts) < 3:
        return None
    return parts[2]


def test_every_engine_module_is_in_a_room() -> None:
    rooms = {room_of(m) for m in all_package_modules() if layer_of(m) == "_engine"}
    assert rooms - {None} == set(ENGINE_ROOMS)


def test_engine_rooms_import_only_what_their_rule_allows() -> None:
    found = []
    for module in all_package_modules():
        room = room_of(module)
        if room is None:
            continue
        for imp in imports_of(module):
            target = room_of(imp.module)
            if target is not None and target != room and target not in ENGINE_ROOMS[room]:
                found.append(f"{module}:{imp.line} imports {imp.module}")
    assert found == []


def test_engine_has_at_most_twelve_rooms() -> None:
    # Its top level stays one screen: modules and subpackages, __init__ and __main__ aside.
    assert len(set(ENGINE_ROOMS) - {"__main__"}) <= 12
