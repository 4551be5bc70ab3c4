"""The shape of the tree: imports go only downward through the layers below, and no module
imports itself back through others (no cycle), lazy imports inside functions included.

The allowed direction is written once, as data (`LAYERS`): a module may import its own package and
any package of a lower layer, never a higher one and never a peer package of its own layer. What the
layers are for is said in each package's `__init__`; ARCHITECTURE.md draws the picture, and its
package table must name every package (`test_the_architecture_page_names_every_package`).
"""
from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Lowest first. Each entry: the packages (or top-level modules) of one layer.
LAYERS: list[tuple[str, ...]] = [
    ("workers",),  # the package itself: its `__init__` only describes the subpackages below
    ("workers.in_rank", "workers.files"),  # in the training process; what a folder holds (neither imports the other)
    ("workers.device",),  # what a slot is: its device, capacity and binding
    ("workers.state",),  # the slots' state in Redis behind its store: keys, registration, leases, views, health
    ("workers.process",),  # the training processes a slot starts: launch, memory, names, files
    ("workers.warm",),  # the slot's warm interpreter and the ranks it forks
    ("workers.slot",),  # the slot worker's rank task
    ("scheduler.embedded",),  # the command's machine: the embedded cluster, every worker's command line
    ("celeryconfig",),  # the Celery app's settings, read from the environment
    ("scheduler.errors",),  # the one error vocabulary of every layer above
    ("scheduler.inputs",),  # what the user gives: config file, arguments, results folder
    ("scheduler.search", "scheduler.launch"),  # pure decisions: the search; DeepSpeed's runner
    ("scheduler.report",),  # what a run leaves: records, summary, plots
    ("scheduler.cluster",),  # the control path: jobs, queues, dispatch, leases in Redis
    ("deploy",),  # workers started and cleaned up over SSH
    ("tasks",),  # the Celery app: thin tasks over the layers below
    ("scheduler",),  # the commands: autotune, run, status (+ its live view), resources
]
SOURCES = ("workers", "scheduler", "deploy", "tasks", "celeryconfig.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for source in SOURCES:
        root = ROOT / source
        for path in ([root] if root.suffix == ".py" else sorted(root.rglob("*.py"))):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every project module `name` imports, at any depth (functions' lazy imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return {_owner(target) for target in targets if _owner(target)} - {name}


def _owner(target: str) -> str | None:
    """The project module a dotted import name refers to (a name imported from a module is its module)."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the layer entry it belongs to): the longest entry that is the module or a package above it."""
    best: tuple[int, str] | None = None
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (index, entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer or sideways into a peer package of the same layer."""
    wrong = []
    for module, targets in graph.items():
        layer, entry = layer_of(module)
        for target in sorted(targets):
            target_layer, target_entry = layer_of(target)
            if target_layer > layer or (target_layer == layer and target_entry != entry):
                wrong.append(f"{module} -> {target}")
    return wrong


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among modules: for each module on one, its shortest cycle (a breadth-first
    search back to it), each cycle once and from its smallest module. Every elementary cycle would
    be exponentially many in a planted graph's tangles; one shortest cycle per module names each
    tangle's edges all the same."""
    found, seen = [], set()
    for start in sorted(graph):
        parents: dict[str, str] = {}
        queue = deque([start])
        while queue and start not in parents:
            node = queue.popleft()
            for target in sorted(graph.get(node, ())):
                if target not in parents:
                    parents[target] = node
                    queue.append(target)
        if start not in parents:
            continue
        cycle, node = [], parents[start]
        while node != start:
            cycle.append(node)
            node = parents[node]
        cycle = [start] + cycle[::-1]
        first = cycle.index(min(cycle))
        cycle = cycle[first:] + cycle[:first]
        if tuple(cycle) not in seen:
            seen.add(tuple(cycle))
            found.append(cycle + [cycle[0]])
    return found


def test_every_module_belongs_to_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def packages_missing_from(layers: list[tuple[str, ...]]) -> list[str]:
    """The tree's packages that no entry of `layers` names: such a package would silently take the
    rules of the package above it."""
    entries = {entry for layer in layers for entry in layer}
    return sorted(name for name, path in MODULES.items() if path.name == "__init__.py" and name not in entries)


def test_every_package_has_its_own_layer_entry() -> None:
    assert packages_missing_from(LAYERS) == []


def test_the_layer_check_sees_a_package_left_out() -> None:
    dropped = [tuple(entry for entry in layer if entry != "workers.warm") for layer in LAYERS]
    assert packages_missing_from(dropped) == ["workers.warm"]


def test_imports_only_go_downward() -> None:
    assert upward_imports(GRAPH) == []


def test_no_module_imports_itself_back() -> None:
    assert cycles(GRAPH) == []


def test_the_checks_see_a_planted_upward_import_and_cycle() -> None:
    planted = {name: set(targets) for name, targets in GRAPH.items()}
    planted["scheduler.search.space"].add("scheduler.cluster.dispatch")  # search reaching into the cluster
    planted["workers.slot.rank"].add("scheduler.errors")  # the slot importing the scheduler
    planted["workers.state.registry"].add("workers.slot.rank")  # the slots' state importing the rank task
    planted["workers.in_rank.entry"].add("workers.files.paths")  # the training process importing a peer
    planted["workers.process.launch"].add("scheduler.embedded.local_cluster")  # a slot importing the command side
    assert sorted(upward_imports(planted)) == ["scheduler.search.space -> scheduler.cluster.dispatch",
                                               "workers.in_rank.entry -> workers.files.paths",
                                               "workers.process.launch -> scheduler.embedded.local_cluster",
                                               "workers.slot.rank -> scheduler.errors",
                                               "workers.state.registry -> workers.slot.rank"]
    planted["scheduler.search.ranking"].add("scheduler.search.space")
    planted["scheduler.search.space"].add("scheduler.search.ranking")
    assert ["scheduler.search.ranking", "scheduler.search.space", "scheduler.search.ranking"] in cycles(planted)


#: The slots' state has one owner: from outside `workers.state`, only its store (and the store's twin) is
#: imported, beside what holds no slot state: the keyspace, how to connect, the URL and TLS rules, and
#: where a launch's ranks meet. Registrations, gang leases, views and health marks stay behind the store.
STATE_DOORS = {"workers.state", "workers.state.store", "workers.state.memory_store", "workers.state.keys",
               "workers.state.connection", "workers.state.redis_url", "workers.state.redis_tls",
               "workers.state.rendezvous"}


def past_the_slot_store(graph: dict[str, set[str]]) -> list[str]:
    """Every import, from a module outside `workers.state`, of one of its modules that is no door."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  if not module.startswith("workers.state") for target in targets
                  if target.startswith("workers.state.") and target not in STATE_DOORS)


def test_the_slots_state_is_reached_only_through_its_store() -> None:
    assert past_the_slot_store(GRAPH) == []


def test_the_store_check_sees_a_planted_reach_past_the_store() -> None:
    planted = {name: set(targets) for name, targets in GRAPH.items()}
    planted["scheduler.cluster.finish"].add("workers.state.gang")  # a lease released past the store
    planted["workers.state.store"].add("workers.state.slot_view")  # the store itself may
    assert past_the_slot_store(planted) == ["scheduler.cluster.finish -> workers.state.gang"]


#: An import of one of the store's insides, as Python written inside a script or template says it.
_INSIDE_IMPORT = re.compile(r"(?:from|import) workers\.state\.(?:registry|gang|slot_view|slot_health|rank_groups)\b"
                            r"|from workers\.state import [^\n]*\b(?:registry|gang|slot_view|slot_health|rank_groups)\b")


def scripts_past_the_slot_store(texts: dict[str, str]) -> list[str]:
    """The scripts (path -> text) whose embedded Python imports the store's insides."""
    return sorted(path for path, text in texts.items() if _INSIDE_IMPORT.search(text))


#: The product's scripts and templates: path -> text.
SCRIPTS = {str(path.relative_to(ROOT)): path.read_text() for source in SOURCES[:-1]
           for path in sorted((ROOT / source).rglob("*")) if path.suffix in (".sh", ".sbatch", ".service", ".conf")}


def test_scripts_beside_the_code_reach_the_slots_state_through_its_store() -> None:
    """Python embedded in a shell script or a template (the Slurm job's wait for its workers) is no
    module the import graph sees; it is held to the same doors by what it names."""
    assert "deploy/templates/autotune.sbatch" in SCRIPTS and scripts_past_the_slot_store(SCRIPTS) == []


def test_the_script_check_sees_a_planted_import() -> None:
    sbatch = "deploy/templates/autotune.sbatch"
    planted = {**SCRIPTS, sbatch: SCRIPTS[sbatch].replace("from workers.state.store import",
                                                          "from workers.state.registry import")}
    assert scripts_past_the_slot_store(planted) == [sbatch]
    assert scripts_past_the_slot_store({"a.sh": "# the mark (workers.state.slot_health) lapses"}) == []


@pytest.mark.parametrize("package", sorted(name for name, path in MODULES.items() if path.name == "__init__.py"))
def test_each_package_says_what_it_is_what_it_may_import_and_who_imports_it(package: str) -> None:
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert len(doc) > 80, f"{package}/__init__.py: a docstring saying what the package is for"
    if package.startswith(("scheduler.", "workers.")):
        assert "Imports" in doc and "Imported by" in doc, f"{package}: say what it may import and what imports it"


def test_every_workers_module_is_in_a_subpackage() -> None:
    """`workers/` holds subpackages only, each one concern with its import rules in LAYERS: a module
    dropped at its top level belongs to none of them."""
    assert [name for name in MODULES if name.count(".") == 1 and name.startswith("workers.")
            and MODULES[name].name != "__init__.py"] == []


def test_the_architecture_page_names_every_package() -> None:
    """ARCHITECTURE.md's package table rows are the tree's packages: a package added, moved or
    removed without the page changing fails here."""
    rows = re.findall(r"^\| `([a-z_/]+)/`(?: \(top\))? \|", (ROOT / "ARCHITECTURE.md").read_text(), re.MULTILINE)
    packages = sorted(name for name, path in MODULES.items()
                      if path.name == "__init__.py" and name.count(".") <= 1)
    assert sorted(row.replace("/", ".") for row in rows) == packages


#: What runs inside the user's training process (`workers.in_rank`): imported into someone else's
#: program, so it must not drag Celery, Redis or the scheduler in with it.
IN_TRAINING = tuple(name for name in MODULES if name.startswith("workers.in_rank."))
#: What the slot's warm interpreter and the ranks it forks run (`workers.warm`): a forked rank carries
#: everything these imported, so they are held to the training process's rule.
IN_WARM_RANK = ("workers.warm.warm_preload", "workers.warm.warm_rank")
HEAVY = ("celery", "redis", "kombu", "psutil", "scheduler", "tasks", "deploy")


def _third_party(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def light_problems(graph: dict[str, set[str]], roots: tuple[str, ...], allowed: set[str]) -> list[str]:
    """What `roots` reach, transitively, outside `allowed` (and the bare packages above them), and
    the heavy third-party packages any of `roots` imports."""
    reached, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    packages = {"workers", "workers.in_rank", "workers.warm"}
    problems = [f"{module}: reached, keep it out" for module in sorted(reached - allowed - packages)]
    for module in roots:
        problems += [f"{module} imports {name}" for name in sorted(_third_party(MODULES[module]) & set(HEAVY))]
    return problems


@pytest.mark.parametrize(("roots", "allowed"), [(IN_TRAINING, set(IN_TRAINING)),
                                                (IN_WARM_RANK, {*IN_WARM_RANK, *IN_TRAINING})],
                         ids=["training process", "warm rank"])
def test_what_runs_in_the_training_process_stays_light(roots: tuple[str, ...], allowed: set[str]) -> None:
    assert light_problems(GRAPH, roots, allowed) == []


def test_the_light_check_sees_a_planted_heavy_import() -> None:
    planted = {name: set(targets) for name, targets in GRAPH.items()}
    planted["workers.in_rank.metrics"].add("workers.state.keys")  # Redis's keyspace in the training process
    planted["workers.warm.warm_rank"].add("workers.process.launch")  # psutil in every forked rank
    assert "workers.state.keys: reached, keep it out" in light_problems(planted, IN_TRAINING, set(IN_TRAINING))
    assert "workers.process.launch: reached, keep it out" in light_problems(planted, IN_WARM_RANK,
                                                                              {*IN_WARM_RANK, *IN_TRAINING})
