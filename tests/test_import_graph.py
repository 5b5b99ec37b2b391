"""No import cycles in grpo_fast: the graph of every import statement (function-level ones included), read from the
source with `ast`, has no strongly connected component of more than one module and no module importing itself.

Module names follow pyproject's package-dir: kernels/ installs as grpo_fast.kernels and benchmarks/ as
grpo_fast.benchmarks. An edge of `from pkg import name` goes to the module pkg.name when there is one, else to pkg;
imports of modules outside these folders (torch, triton, ...) are not edges.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = {"grpo_fast": "grpo_fast", "grpo_fast.kernels": "kernels", "grpo_fast.benchmarks": "benchmarks"}


def module_files(root: str, package_dirs: dict) -> dict:
    """{module name: file} of the .py files under each package folder (`__init__.py` is its package)."""
    files = {}
    for package, folder in package_dirs.items():
        top = os.path.join(root, folder)
        for directory, subdirectories, names in os.walk(top):
            subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
            parts = package.split(".") + os.path.relpath(directory, top).split(os.sep)
            parts = [p for p in parts if p != "."]
            for name in names:
                if name.endswith(".py"):
                    files[".".join(parts + ([] if name == "__init__.py" else [name[:-3]]))] = os.path.join(
                        directory, name)
    return files


def import_graph(files: dict) -> dict:
    """{module: set of modules it imports} over every Import / ImportFrom in each file, at any depth."""
    graph = {module: set() for module in files}
    for module, path in files.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                       # relative: up level - 1 packages from this module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            else:
                continue
            graph[module].update(target for target in targets if target in files)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components that form a cycle (two or more modules, or one importing itself), each
    as a sorted list of module names."""
    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for successor in graph[todo.pop()]:
                if successor not in seen:
                    seen.add(successor)
                    todo.append(successor)
        return seen

    reach = {module: reachable(module) for module in graph}
    components = {frozenset([m] + [n for n in reach[m] if m in reach[n]]) for m in graph if m in reach[m]}
    return sorted(sorted(component) for component in components)


def restricted(graph: dict, keep) -> dict:
    return {m: {n for n in targets if keep(n)} for m, targets in graph.items() if keep(m)}


def describe(found: list) -> str:
    return "import cycles:\n" + "\n".join("  " + " <-> ".join(component) for component in found)


def outside_trainer(module: str) -> bool:
    return module.split(".")[:2] != ["grpo_fast", "train"]


GRAPH = import_graph(module_files(ROOT, PACKAGE_DIRS))


def test_no_import_cycle_in_grpo_fast():
    found = cycles(GRAPH)
    assert not found, describe(found)


def test_no_import_cycle_outside_the_trainer():
    """The loss library, the kernels, the integrations, the benchmark harness and the command line."""
    assert {"grpo_fast.chunked", "grpo_fast.backends.triton_ops", "grpo_fast.kernels.launch"} <= set(GRAPH)
    assert "grpo_fast.kernels" in GRAPH["grpo_fast.backends.triton_ops"]       # resolved to kernels/
    found = cycles(restricted(GRAPH, outside_trainer))
    assert not found, describe(found)


def test_the_checker_finds_a_cycle(tmp_path):
    """Two modules that import each other, one of them inside a function and one relatively, and a third that
    imports both without being part of the cycle."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\nfrom pkg.b import name\n")
    graph = import_graph(module_files(str(tmp_path), {"pkg": "pkg"}))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a", "pkg.b"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert "pkg.a <-> pkg.b" in describe(cycles(graph))


def room_graph(graph: dict, room) -> dict:
    """The graph of `room(module)` (a folder or a module, or None to leave the module out): an edge from one room
    to another wherever a module of the first imports one of the second."""
    rooms = {}
    for module, targets in graph.items():
        if room(module) is not None:
            rooms.setdefault(room(module), set()).update(
                room(t) for t in targets if room(t) is not None and room(t) != room(module))
    return rooms


def package_room(depth: int, package: tuple):
    """Rooms one level below `package`: grpo_fast.train.run.atomic -> grpo_fast.train.run at depth 3."""
    def room(module):
        parts = module.split(".")
        if tuple(parts[: len(package)]) != package or len(parts) == len(package):
            return None                                          # outside, or the package's own face (__init__)
        return ".".join(parts[:depth])
    return room


def test_each_folder_stands_above_all_it_imports():
    """Drawn as floors, with each folder and module one room, no import runs back up: the rooms of grpo_fast/
    and those of grpo_fast/train/ (its stage folders, the loop, the config) form no cycle. A low helper the
    stages use (run/atomic, run/errors) and the top of the trainer that imports the TrainConfig
    (saved/checkpoint, saved/export) live in different folders for this reason."""
    for package in (("grpo_fast",), ("grpo_fast", "train")):
        rooms = room_graph(GRAPH, package_room(len(package) + 1, package))
        assert "grpo_fast.train.run" in rooms or package == ("grpo_fast",)
        found = cycles(rooms)
        assert not found, f"under {'.'.join(package)}: " + describe(found)


def test_the_floor_check_finds_an_import_running_up():
    """A stage folder's module importing the top of a trainer that imports the stage: no module cycle, a room
    cycle."""
    graph = {"p.low.a": set(), "p.low.b": {"p.top.c"}, "p.top.c": {"p.low.a"}}
    assert cycles(graph) == []
    assert cycles(room_graph(graph, package_room(2, ("p",)))) == [["p.low", "p.top"]]
