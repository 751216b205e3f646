"""Folders form floors: each imports only its own floor and the floors below it, and no folder is crowded.

The order of each package's folders is stated here and in docs/architecture.md; a folder missing from its
package's order is itself a failure, so a new folder has to be placed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from tests.test_layering import ROOT, Source, _repo_is_module, _strongly_connected, imports_of, repo_sources

PACKAGE_FLOORS = ("common", "worker", "tenancy", "admission", "router", "gateway", "config", "bench", "tests")
FOLDER_FLOORS = {  # each package's folders, lowest first (a package's own modules are named by the package)
    "worker": ("worker", "worker.protocol", "worker.text", "worker.kvcache", "worker.kernels", "worker.quant",
               "worker.model", "worker.sample", "worker.engine", "worker.vllm_engine", "worker.server"),
    "worker.engine": ("worker.engine.records", "worker.engine.scheduling", "worker.engine"),
    "worker.server": ("worker.server.process", "worker.server.telemetry", "worker.server.disagg",
                      "worker.server"),
    "gateway": ("gateway.telemetry", "gateway.web", "gateway.openai", "gateway.flow", "gateway.files",
                "gateway.streams", "gateway.responses", "gateway.batches", "gateway.admin", "gateway"),
    "router": ("router.placement", "router.links", "router.disagg", "router.pools", "router"),
    "config": ("config.local_stack", "config.loadtest", "config"),
    "admission": ("admission.lua", "admission.money", "admission"),
}
PRODUCT = ("common", "worker", "tenancy", "admission", "router", "gateway", "config")
MAX_MODULES = 12  # per folder, `__init__` not counted


def folder_of(src: Source) -> str:
    return src.module if src.is_package else src.module.rpartition(".")[0]


def _common_parent(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)


def _floor(order: tuple[str, ...], parent: str, folder: str) -> int | None:
    """Index of the floor `folder` stands on in `parent`'s order (its own folder, or the one it is nested
    in)."""
    best = None
    for i, name in enumerate(order):
        if folder == name or (name != parent and folder.startswith(name + ".")):
            if best is None or len(name) > len(order[best]):
                best = i
    return best


def _owner_of(target: str, folders: dict[str, str]) -> str | None:
    while target and target not in folders:
        target = target.rpartition(".")[0]
    return folders.get(target)


def check_floors(sources: Iterable[Source], is_module: Callable[[str], bool],
                 floors: dict[str, tuple[str, ...]] = FOLDER_FLOORS) -> list[str]:
    """Every import that goes up a floor (between packages, or between the folders of one package)."""
    sources = list(sources)
    folders = {src.module: folder_of(src) for src in sources}
    found = []
    for src in sources:
        here = folders[src.module]
        for imp in imports_of(src, is_module):
            there = _owner_of(imp.target, folders)
            if there is None or there == here:
                continue
            where = f"{imp.module}:{imp.line}"
            top_here, top_there = here.partition(".")[0], there.partition(".")[0]
            if top_here != top_there:
                if top_here in PACKAGE_FLOORS and top_there in PACKAGE_FLOORS and \
                        PACKAGE_FLOORS.index(top_there) > PACKAGE_FLOORS.index(top_here):
                    found.append(f"{where}: {top_here} imports {imp.target} "
                                 f"(package {top_there} is a floor above)")
                continue
            parent = _common_parent(here, there)
            order = floors.get(parent)
            if order is None:
                continue
            mine, theirs = _floor(order, parent, here), _floor(order, parent, there)
            if mine is None or theirs is None:
                found.append(f"{where}: {here if mine is None else there} has no floor in {parent}'s order")
            elif theirs > mine:
                found.append(f"{where}: {here} imports {imp.target} "
                             f"({order[theirs]} is a floor above {order[mine]})")
    return found


def folder_cycles(sources: Iterable[Source], is_module: Callable[[str], bool]) -> list[str]:
    """Every cycle between folders (strongly connected groups of the folder-level import graph)."""
    sources = list(sources)
    folders = {src.module: folder_of(src) for src in sources}
    graph: dict[str, set[str]] = defaultdict(set)
    for src in sources:
        graph[folders[src.module]]
        for imp in imports_of(src, is_module):
            there = _owner_of(imp.target, folders)
            if there is not None and there != folders[src.module]:
                graph[folders[src.module]].add(there)
    return [" <-> ".join(sorted(g)) for g in _strongly_connected(dict(graph)) if len(g) > 1]


def _product_sources() -> list[Source]:
    return [src for src in repo_sources() if src.module.partition(".")[0] in PRODUCT]


def test_repository_folders_form_floors() -> None:
    violations = check_floors(repo_sources(), _repo_is_module)
    assert not violations, "floor violations:\n" + "\n".join(violations)


def test_repository_has_no_folder_cycles() -> None:
    cycles = folder_cycles(_product_sources(), _repo_is_module)
    assert not cycles, "folder cycles:\n" + "\n".join(cycles)


def test_every_folder_of_a_floored_package_is_placed() -> None:
    folders = {folder_of(src) for src in repo_sources()}
    for parent, order in FOLDER_FLOORS.items():
        for folder in folders:
            if folder == parent or folder.startswith(parent + "."):
                assert _floor(order, parent, folder) is not None, f"{folder} has no floor in {parent}'s order"


def test_no_folder_holds_more_than_twelve_modules_and_no_name_repeats() -> None:
    counts: Counter[str] = Counter()
    names: dict[str, list[str]] = defaultdict(list)
    for path in ROOT.glob("*/**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in PRODUCT or path.name == "__init__.py":
            continue
        counts[str(rel.parent)] += 1
        names[path.name].append(str(rel))
    crowded = {folder: n for folder, n in counts.items() if n > MAX_MODULES}
    assert not crowded, f"folders over {MAX_MODULES} modules: {crowded}"
    repeated = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not repeated, f"module names used twice: {repeated}"


def test_floor_checker_catches_planted_violations() -> None:
    known = {"worker.kernels.cpu", "worker.model.llama", "worker.engine.core",
             "worker.engine.records.sequence", "worker.sample.sampler", "gateway.app", "gateway.web.sse",
             "router.dispatch", "tenancy.schema", "admission.gate", "common.priorities"}
    planted = [
        # up, local import
        Source("worker.kernels.cpu", False, "def f():\n    from worker.model.llama import x\n"),
        # nested up
        Source("worker.engine.records.sequence", False, "from worker.engine.core import Engine\n"),
        # the package root is its top
        Source("gateway.web.sse", False, "from gateway.app import create_app\n"),
        Source("tenancy.schema", False, "from admission.gate import Admission\n"),  # package floors
        Source("common.priorities", False, "from worker.sample.sampler import x\n"),
        Source("worker.sample.sampler", False,
               "from worker.kernels.cpu import x\nfrom common.priorities import P\n"),
        Source("gateway.app", False, "from gateway.web.sse import event\nimport router.dispatch\n"),
        Source("worker.engine.core", False, "from worker.engine.records.sequence import Sequence\n"),
    ]
    targets = {imp.target for src in planted for imp in imports_of(src, known.__contains__)}
    bare = [Source(name, False, "") for name in sorted(targets - {src.module for src in planted})]
    found = check_floors(planted + bare, known.__contains__)
    expected = ["worker.kernels.cpu:2: worker.kernels imports worker.model.llama",
                "worker.engine.records.sequence:1: worker.engine.records imports worker.engine.core",
                "gateway.web.sse:1: gateway.web imports gateway.app",
                "tenancy.schema:1: tenancy imports admission.gate",
                "common.priorities:1: common imports worker.sample.sampler"]
    for prefix in expected:
        assert any(v.startswith(prefix) for v in found), f"missed {prefix!r} in {found}"
    assert len(found) == len(expected), found
    unplaced = check_floors([Source("worker.newfolder.x", False, "from worker.kernels.cpu import y\n"),
                             Source("worker.kernels.cpu", False, "")],
                            {"worker.kernels.cpu", "worker.newfolder.x"}.__contains__)
    assert unplaced == ["worker.newfolder.x:1: worker.newfolder has no floor in worker's order"], unplaced
    cyclic = [Source("p.a.m", False, "from p.b.n import x\n"),
              Source("p.b.n", False, "from p.a.m import y\n")]
    assert folder_cycles(cyclic, {"p.a.m", "p.b.n"}.__contains__) == ["p.a <-> p.b"]
