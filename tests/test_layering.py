"""The one-way layering of Switchyard's packages, checked from the source with `ast`.

A violation names the importing module, its line and the imported module, so a broken rule says where.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "worker", "router", "gateway", "admission", "tenancy", "config", "bench", "tests")
WORKER_FACES = ("worker.protocol", "worker.text")  # the light modules other packages may import
LIGHT = WORKER_FACES  # import no torch, and of the worker only each other
FACED = ("router", "admission", "tenancy")  # the gateway imports these only through `__init__`
RING = "router.placement.ring"
RING_OWNER = "router.placement.policy"


@dataclass(slots=True, frozen=True)
class Source:
    """One module to check: its dotted name, whether it is a package `__init__`, and its text."""

    module: str
    is_package: bool
    text: str


@dataclass(slots=True, frozen=True)
class Import:
    module: str  # importing module
    line: int
    target: str  # absolute dotted name of what is imported


def _package_of(src: Source) -> str:
    return src.module if src.is_package else src.module.rpartition(".")[0]


def _resolve_base(src: Source, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = _package_of(src).split(".")
    base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join([*base, node.module] if node.module else base)


def imports_of(src: Source, is_module: Callable[[str], bool]) -> list[Import]:
    """Every import in `src` (at any depth), as absolute names; `from pkg import sub` gives `pkg.sub`."""
    found: dict[Import, None] = {}  # ordered and without repeats
    for node in ast.walk(ast.parse(src.text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found[Import(src.module, node.lineno, alias.name)] = None
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(src, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found[Import(src.module, node.lineno, full if is_module(full) else base)] = None
    return sorted(found, key=lambda imp: imp.line)


def _top(name: str) -> str:
    return name.partition(".")[0]


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def check(sources: Iterable[Source], is_module: Callable[[str], bool]) -> list[str]:
    """All layering violations of `sources`, one `module:line: message` string each."""
    found: list[str] = []
    for src in sources:
        owner = _top(src.module)
        for imp in imports_of(src, is_module):
            target = imp.target
            where = f"{imp.module}:{imp.line}"
            if owner == "worker" and _top(target) in PACKAGES and _top(target) not in ("worker", "common"):
                found.append(f"{where}: worker imports {target} (worker imports only common of the others)")
            if owner == "common" and (_top(target) in PACKAGES and _top(target) != "common"
                                      or _top(target) == "torch"):
                found.append(f"{where}: common imports {target} "
                             "(the shared floor imports no torch and nothing above)")
            if owner in ("router", "gateway", "admission", "tenancy") and _top(target) == "worker" \
                    and not any(_under(target, face) for face in WORKER_FACES):
                found.append(f"{where}: {owner} imports {target} (only {' and '.join(WORKER_FACES)} allowed)")
            if owner == "gateway" and _top(target) in FACED and target != _top(target):
                found.append(f"{where}: gateway imports {target} "
                             f"(use the face: from {_top(target)} import ...)")
            if owner != "tests" and _under(target, RING) and src.module != RING_OWNER and src.module != RING:
                found.append(f"{where}: imports {target} (only {RING_OWNER} may use the ring)")
            if any(_under(src.module, light) for light in LIGHT) and (
                    _top(target) == "torch"
                    or (_top(target) == "worker" and not any(_under(target, x) for x in LIGHT))):
                found.append(f"{where}: light module imports {target} "
                             f"({' and '.join(LIGHT)} import no torch and no other worker module)")
            if owner == "bench" and _top(target) == "tests":
                found.append(f"{where}: bench imports {target} (tests are not installed with the package)")
    return found


def import_cycles(sources: Iterable[Source], is_module: Callable[[str], bool]) -> list[str]:
    """Every cycle between modules (strongly connected groups), counting annotation-only and function-local
    imports; an import of a name inside a module counts as an import of that module."""
    sources = list(sources)
    graph: dict[str, set[str]] = {src.module: set() for src in sources}
    for src in sources:
        for imp in imports_of(src, is_module):
            target = imp.target
            while target and target not in graph:
                target = target.rpartition(".")[0]
            if target and target != src.module:
                graph[src.module].add(target)
    return [" <-> ".join(sorted(group)) for group in _strongly_connected(graph) if len(group) > 1]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _repo_is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def repo_sources() -> list[Source]:
    sources = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module, is_package = _module_name(path)
            sources.append(Source(module, is_package, path.read_text()))
    return sources


def test_repository_follows_the_layering() -> None:
    sources = repo_sources()
    assert len(sources) > 50  # the walk really found the packages
    violations = check(sources, _repo_is_module)
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_repository_has_no_import_cycles() -> None:
    cycles = import_cycles(repo_sources(), _repo_is_module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_cycle_check_counts_annotation_only_and_function_local_imports() -> None:
    known = {"pkg.a", "pkg.b", "pkg.c", "pkg.d"}.__contains__
    planted = [
        Source("pkg.a", False, "from pkg.b import B\n"),
        Source("pkg.b", False,
               "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"),
        Source("pkg.c", False, "def f():\n    from pkg.d import g\n    return g\n"),
        Source("pkg.d", False, "from pkg import c\n"),
    ]
    assert sorted(import_cycles(planted, known)) == ["pkg.a <-> pkg.b", "pkg.c <-> pkg.d"]
    assert import_cycles(planted[:1] + planted[2:3], known) == []


def test_checker_catches_light_and_bench_rules() -> None:
    known = {"worker.protocol", "worker.protocol.frames", "worker.text", "worker.text.tokenizer",
             "worker.engine.core", "tests.worker_procs", "bench.routing"}.__contains__
    bad = [
        Source("worker.protocol.frames", False, "import torch\n"),
        Source("worker.text.tokenizer", False, "from worker.engine.core import Engine\n"),
        Source("bench.routing", False, "from tests.worker_procs import start\n"),
    ]
    found = check(bad, known)
    for prefix in ("worker.protocol.frames:1: light module imports torch",
                   "worker.text.tokenizer:1: light module imports worker.engine.core",
                   "bench.routing:1: bench imports tests.worker_procs"):
        assert any(v.startswith(prefix) for v in found), f"missed {prefix!r} in {found}"
    good = [Source("worker.text.tokenizer", False,
                   "import tokenizers\nfrom worker.text.model_source import x\n"),
            Source("bench.routing", False, "from config.local_stack.launcher import Stack\n")]
    assert check(good, known) == []


def test_checker_catches_violations() -> None:
    """The checker flags each kind of violation on synthetic modules, and passes the allowed forms."""
    known = {"router.placement.ring", "router.placement.policy", "router.links.client",
             "tenancy.tenant_admin", "worker.engine.core", "worker.protocol", "worker.text",
             "worker.text.tokenizer", "gateway.web.sse"}
    bad = [
        Source("worker.engine.core", False, "import gateway.app\nfrom tenancy import Tenant\n"),
        Source("router.links.client", False, "from worker.engine.core import Engine\n"),
        Source("gateway.flow.service", False,
               "from router.links.client import WorkerClient\nfrom tenancy import tenant_admin\n"),
        Source("gateway.app", False, "import admission.gate\n"),
        Source("config.cmd_gateway", False, "from router.placement.ring import HashRing\n"),
        Source("router.placement.kv_view", False, "from . import ring\n"),
        Source("router.placement", True, "from .ring import HashRing\n"),
        Source("common.priorities", False, "import torch\nfrom worker.protocol import Frame\n"),
    ]
    found = check(bad, known.__contains__)
    expected = [
        "worker.engine.core:1: worker imports gateway.app",
        "worker.engine.core:2: worker imports tenancy",
        "router.links.client:1: router imports worker.engine.core",
        "gateway.flow.service:1: gateway imports router.links.client",
        "gateway.flow.service:2: gateway imports tenancy.tenant_admin",
        "gateway.app:1: gateway imports admission.gate",
        "config.cmd_gateway:1: imports router.placement.ring",
        "router.placement.kv_view:1: imports router.placement.ring",
        "router.placement:1: imports router.placement.ring",
        "common.priorities:1: common imports torch",
        "common.priorities:2: common imports worker.protocol",
    ]
    for prefix in expected:
        assert any(v.startswith(prefix) for v in found), f"missed {prefix!r} in {found}"
    assert len(found) == len(expected), found

    good = [
        Source("worker.server.serve", False,
               "from worker.protocol import Frame\nfrom . import engine\nimport zmq\n"),
        Source("gateway.flow.service", False,
               "import router\nfrom router import Router\nfrom admission import Admission\n"
               "from tenancy import Tenant\nfrom worker.protocol import Priority\n"
               "from .sse import event\nfrom worker.text import tokenizer\n"),
        Source("router.placement.policy", False, "from router.placement.ring import HashRing\n"),
        Source("tests.router.test_router_ring", False, "from router.placement.ring import HashRing\n"),
    ]
    assert check(good, known.__contains__) == []
