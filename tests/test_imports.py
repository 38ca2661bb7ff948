"""The package's imports run one way: no import circles, and no module imports from a layer above its own.

Every import of an `rlhf` module counts, also one inside a function (an import made at use is still a
dependency: it only hides a circle from the interpreter). The layers are docs/layout.md section, bottom up.
"""

import ast
import pathlib
import re

from tests.conftest import ROOT

PACKAGE = pathlib.Path(ROOT) / "rlhf"

# bottom up; a module belongs to the layer of its longest listed prefix
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations", ("rlhf", "rlhf.registry", "rlhf.clock", "rlhf.contain", "rlhf.procs", "rlhf.devices", "rlhf.run_dir",
                     "rlhf.progress", "rlhf.stacks", "rlhf.exits", "rlhf.errors", "rlhf.weights", "rlhf.pieces", "rlhf.batch",
                     "rlhf.analysis", "rlhf.hosts")),
    ("math, models, tasks", ("rlhf.algorithms", "rlhf.models", "rlhf.tasks")),
    ("config", ("rlhf.config",)),
    ("tracing", ("rlhf.tracing",)),
    ("faults", ("rlhf.faults", "rlhf.stages")),
    ("engines", ("rlhf.rollout", "rlhf.train", "rlhf.envs", "rlhf.data", "rlhf.evaluation", "rlhf.trainers", "rlhf.diagnosis",
                 "rlhf.trackers")),
    ("storage", ("rlhf.checkpoint",)),
    ("transport", ("rlhf.transport", "rlhf.batch.client")),
    ("services", ("rlhf.services", "rlhf.sim")),
    ("control", ("rlhf.control",)),
    ("entry points", ("rlhf.control.launch", "rlhf.services.sglang_launch", "rlhf.checkpoint.export", "rlhf.cli",
                      "rlhf.cli_args", "rlhf.inputs", "rlhf.report", "rlhf.control.sim_launch")),
]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported rlhf module: line}."""
    mods = modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule; `from mod import name`, the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                if target.split(".")[0] == "rlhf":
                    dep = resolve(target)
                    if dep and dep != name:
                        edges.setdefault(dep, node.lineno)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int:
    best, level = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    return level


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    graph = import_graph()
    found = cycles(graph)
    detail = [" -> ".join(c) + "; edges: " + ", ".join(f"{a} imports {b} (line {graph[a][b]})" for a in c
                                                       for b in c if b in graph[a]) for c in found]
    assert not found, "import circles:\n" + "\n".join(detail)


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower():
    graph = import_graph()
    unplaced = sorted(m for m in graph if layer_of(m) < 0)
    assert not unplaced, f"modules in no layer (add them to LAYERS and docs/layout.md): {unplaced}"
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]}) at line {line}"
              for m, deps in sorted(graph.items()) for d, line in sorted(deps.items()) if layer_of(d) > layer_of(m)]
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def test_the_checks_see_a_circle_and_an_upward_import():
    """The walk itself: a planted circle is found, and an import from a higher layer is one."""
    graph = {"rlhf.a": {"rlhf.b": 1}, "rlhf.b": {"rlhf.c": 2}, "rlhf.c": {"rlhf.a": 3}, "rlhf.d": {}}
    assert cycles(graph) == [["rlhf.a", "rlhf.b", "rlhf.c"]]
    assert layer_of("rlhf.rollout.engine.decode") < layer_of("rlhf.services.metaserver") < layer_of("rlhf.cli")
    real = import_graph()
    assert "rlhf.rollout.engine.engine" in real["rlhf.rollout.engine"]  # a package's __init__ importing its rooms
    assert "rlhf.config.sections" in real["rlhf.config.presets"]


def test_the_layout_page_names_every_layer_and_the_largest_rooms():
    layout = (pathlib.Path(ROOT) / "docs" / "layout.md").read_text(encoding="utf-8")
    for i, (name, _) in enumerate(LAYERS):
        assert f"{i} {name}" in layout, f"docs/layout.md does not name layer {i} {name!r}"
    sizes = sorted(((len(p.read_text(encoding="utf-8").splitlines()), p) for p in PACKAGE.rglob("*.py")), reverse=True)
    for lines, path in sizes[:5]:  # the largest rooms, each with its line count (kept within 10 % of the file's)
        rel = path.relative_to(PACKAGE.parent).as_posix()
        listed = re.search(rf"{re.escape(rel)} (\d+)\b", layout)
        assert listed, f"docs/layout.md should list {rel} ({lines} lines) among the largest rooms"
        assert abs(int(listed.group(1)) - lines) <= 0.1 * lines, f"{rel} has {lines} lines; the README says {listed.group(1)}"


def test_every_call_to_the_train_ranks_goes_through_the_worker_group():
    """The control layer calls the train ranks only through WorkerGroup (control/workers.py), so one place fans a
    call out and the stall watchdog watches every call made on all ranks. Its clients are read only where the
    group's own machinery is built and closed (lifecycle: the watchdog's heartbeats, cleanup)."""
    allowed = {"rlhf/control/workers.py": None, "rlhf/control/lifecycle.py": 2}
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        hits = re.findall(r"workers\.clients|workers\[\w+\]\.call", path.read_text(encoding="utf-8"))
        if hits and rel not in allowed:
            found[rel] = len(hits)
        elif rel in allowed and allowed[rel] is not None:
            assert len(hits) <= allowed[rel], f"{rel} reads workers.clients {len(hits)} times"
    assert not found, f"calls to the train ranks outside WorkerGroup: {found}"
