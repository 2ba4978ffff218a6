"""The house in wings: the package's shape is a contract (imports go down the data path and never
in a circle, small modules, the public training-side imports unchanged).

The layers are ``LAYERS`` below, lowest first; docs/architecture.md explains the order."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "node_agent"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the node_agent modules it imports, counting imports inside functions and the
    packages whose ``__init__`` an import runs."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def add(src: str, target: str) -> None:
        parts = target.split(".")
        for i in range(2, len(parts) + 1):  # importing a.b.c runs a.b's __init__ too ...
            name = ".".join(parts[:i])
            # ... except a module's own packages, which are loaded before the module itself
            if name in modules and name != src and not src.startswith(name + "."):
                graph[src].add(name)

    def runtime_nodes(tree: ast.AST):
        """Every node but those under ``if TYPE_CHECKING:`` (annotations, never run)."""
        todo = [tree]
        while todo:
            node = todo.pop()
            yield node
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    todo.extend(child.orelse)
                else:
                    todo.append(child)

    for name, path in modules.items():
        for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and node.module.startswith("node_agent")
            ):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    add(name, full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("node_agent"):
                        add(name, alias.name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


#: The data path, lowest first. A module imports modules of its own layer or of layers below it,
#: never above: a layer names wings (``node_agent/<wing>/``) and top-level modules
#: (``node_agent/<module>.py``), and within one layer imports are free. Imports under
#: ``if TYPE_CHECKING:`` are annotations, never run, and are not counted. A new wing or top-level
#: module takes its place here (test_every_wing_has_a_place_in_the_layers).
LAYERS: tuple[tuple[str, ...], ...] = (
    # the data model, files, config and the one subprocess helper: used by everything
    ("model", "yamlfile", "atomic_file", "extras", "heartbeat", "config", "resources", "proc"),
    ("peers",),  # who is on the other end of a local socket, or holds a local port
    ("parsers",),  # pure parsers of tools' output
    ("gpu",),  # the one GPU interface and its backends
    ("host",),  # the host's own files (sysfs, procfs) and tools
    ("kernel_log", "kernel_log_distress"),  # the kernel log and its readers
    ("hardware",),  # SKU descriptions, the driver-line catalog
    ("inventory",),  # the GPUs and the PCI bus, read through gpu/, matched to a SKU
    ("sdc",),  # the SDC probe library and its spool (imported by training jobs)
    ("compute",),  # the compute boundary, the burn engine, the all-reduce
    ("training",),  # training processes on the node: discovery, signals, verdicts
    ("checking",),  # what checks are made of: the context, the registry, their shared parts
    ("checks",),  # one module (or folder) per check -> Result
    ("grading",),  # Results -> Grade
    ("suite",),  # suite definitions naming checks
    ("node",),  # the node a run works against: GPUs, kernel log, ports (this host's or a stand-in)
    ("sim",),  # the stand-in node built from a scenario, and the capture of a real one
    ("environment",),  # what a run has: config, GPU backend, inventory, ports; chosen once
    ("runner",),  # a suite run in an environment: each check isolated and time-bounded
    ("report",),  # a run's report: JSON, terminal, JUnit, HTML
    ("schedulers",),  # the adapters: Slurm, Kubernetes, webhook, log
    ("remediation",),  # Grade -> plan -> guarded actions through an adapter
    ("stopcheck",),  # the stop-check between training runs
    ("service",),  # the daemon: one way in
    ("fleet",),  # many nodes' reports
    ("commands",),  # the command line: the other way in
)


def _unit(module: str) -> str | None:
    """The wing or top-level module a module belongs to (None for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    """Each import that goes up the layers, as "importer -> imported: the rule it breaks". An
    import of a package is left out where the same module imports a module inside it (importing
    ``a.b.c`` runs ``a.b``)."""
    rank = {unit: i for i, layer in enumerate(layers) for unit in layer}
    found = []
    for src in sorted(graph):
        targets = graph[src]
        for dst in sorted(targets):
            if any(t.startswith(dst + ".") for t in targets):
                continue
            low, high = _unit(src), _unit(dst)
            if low is None or high is None or low not in rank or high not in rank:
                continue
            if rank[high] > rank[low]:
                found.append(f"{src} -> {dst}: {low} may not import {high}, a layer above it")
    return found


def test_imports_go_down_the_data_path():
    upward = upward_imports(import_graph())
    if upward:
        pytest.fail(
            f"{len(upward)} import(s) go up the layers (LAYERS in this file; docs/architecture.md):"
            " move the shared part down into a module of its own, or pass it in from above\n  "
            + "\n  ".join(upward),
            pytrace=False,
        )


#: The stand-in is outside the code it stands in for (STYLE.md): the wings a run's node is
#: handed to never import the simulator nor name a scenario; ``open_environment`` alone chooses.
STAND_IN_BLIND = ("checking", "checks", "gpu", "compute", "remediation", "stopcheck", "service")


def stand_in_leaks(modules: dict[str, Path]) -> list[str]:
    """Each module of a stand-in-blind wing that imports ``node_agent.sim`` (annotations
    included) or names ``Scenario``, as "module: what it does"."""
    found = []
    for name, path in sorted(modules.items()):
        if _unit(name) not in STAND_IN_BLIND:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            imported = []
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(m == "node_agent.sim" or m.startswith("node_agent.sim.") for m in imported):
                found.append(f"{name}:{node.lineno}: imports the simulator ({imported[0]})")
            elif "Scenario" in (getattr(node, "id", None), getattr(node, "attr", None)):
                found.append(f"{name}:{node.lineno}: names Scenario")
    return found


def test_nothing_below_the_environment_knows_a_scenario_exists():
    leaks = stand_in_leaks(_modules())
    if leaks:
        pytest.fail(
            "the stand-in leaks below the environment (STAND_IN_BLIND in this file; "
            "docs/architecture.md): let node_agent.sim.node build what the code needs and "
            "hand it in through the node's ports\n  " + "\n  ".join(leaks),
            pytrace=False,
        )


def test_stand_in_leaks_sees_an_import_of_the_simulator_and_a_scenario_named(tmp_path):
    (tmp_path / "checks").mkdir()
    (tmp_path / "sim").mkdir()
    files = {
        "node_agent.checks.leaky": "from node_agent.sim.scenario import load_scenario\n",
        "node_agent.checks.typed": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import node_agent.sim\n"
        ),
        "node_agent.checks.names": "def f(s: 'x') -> None:\n    Scenario(s)\n",
        "node_agent.checks.clean": "from node_agent.checking.ports import Ports\n",
        "node_agent.sim.node": "from node_agent.sim.scenario import Scenario\n",
    }
    modules = {}
    for name, text in files.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(text)
        modules[name] = path
    assert stand_in_leaks(modules) == [
        "node_agent.checks.leaky:1: imports the simulator (node_agent.sim.scenario)",
        "node_agent.checks.names:2: names Scenario",
        "node_agent.checks.typed:3: imports the simulator (node_agent.sim)",
    ]


def test_upward_imports_sees_an_import_above_and_allows_its_own_layer_and_below():
    layers = (("model", "config"), ("gpu",), ("checks",))
    graph = {
        "node_agent.config": {"node_agent.model"},  # the same layer
        "node_agent.checks.xid": {"node_agent.checks.base", "node_agent.gpu"},  # own wing, below
        "node_agent.gpu.nvml": {"node_agent.checks", "node_agent.checks.rdma"},  # up
        "node_agent.gpu": {"node_agent"},  # the package itself
    }
    assert upward_imports(graph, layers) == [
        "node_agent.gpu.nvml -> node_agent.checks.rdma: gpu may not import checks, a layer above it"
    ]


def test_every_wing_has_a_place_in_the_layers():
    placed = {unit for layer in LAYERS for unit in layer}
    units = {u for m in _modules() if (u := _unit(m)) is not None}
    assert units - placed == set(), "place each in LAYERS, between what it imports and its users"
    assert placed - units == set(), "LAYERS names what no longer exists"
    assert len(placed) == sum(map(len, LAYERS)), "a name in two layers"


def test_no_import_circles_even_through_imports_inside_functions():
    assert find_cycles(import_graph()) == []


def test_find_cycles_sees_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_top_level_stays_small_and_wings_hold_the_rest():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    wings = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert len(top) <= 16, top
    assert len(wings) >= 9, wings


def test_every_wing_says_what_it_does():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init} has no docstring saying what the wing does"


def test_no_module_over_a_thousand_lines():
    long = {
        str(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 1000
    }
    assert long == {}


def _new_modules_after(statement: str) -> list[str]:
    code = textwrap.dedent(f"""
        import sys
        before = set(sys.modules)
        {statement}
        print("\\n".join(sorted(set(sys.modules) - before)))
        """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_heartbeat_imports_nothing_outside_the_standard_library():
    new = _new_modules_after("from node_agent.heartbeat import Heartbeat")
    foreign = [
        m
        for m in new
        if m.split(".")[0] not in sys.stdlib_module_names
        and m not in ("node_agent", "node_agent.heartbeat")
    ]
    assert foreign == []


def test_sdc_spool_names_import_without_torch():
    """The daemon reads verdicts through node_agent.sdc without paying for torch."""
    new = _new_modules_after("from node_agent.sdc import Verdict, write_verdict, default_spool_dir")
    assert "torch" not in new
    assert "node_agent.sdc.spool" in new


def test_shipped_data_is_read_through_resources_never_imported_as_a_package():
    """node_agent.suites and node_agent.graders exist only in an install (pyproject's
    package-dir); a work tree run with nothing installed has neither, so code that imports them
    or asks importlib.resources for them breaks there (the GPU host's "No module named
    node_agent.graders"). node_agent.resources is the one place that finds them either way."""
    offenders = []
    for root in ("node_agent", "bench", "scripts"):
        for path in sorted((REPO / root).rglob("*")):
            if path.suffix not in (".py", "") or not path.is_file() or path.name == "resources.py":
                continue
            try:
                tree = ast.parse(path.read_text())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # not Python (a shell script)
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names = [node.value]
                bad = [
                    n
                    for n in names
                    if n.startswith(("node_agent.suites", "node_agent.graders")) and " " not in n
                ]
                if bad:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {bad[0]}")
    assert offenders == []


def test_every_wing_ships_in_the_wheel():
    """pyproject.toml lists packages by hand: a new wing missing there works in the work tree
    and in an editable install, and is absent from the wheel an operator installs."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    wings = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "node_agent").rglob("__init__.py")
    }
    assert wings - listed == set()
