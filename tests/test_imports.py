"""The package's import layering, read from the source with ast (nothing is imported).

Every import of every megalite module counts, at module level and inside functions, with
relative imports resolved. The rules:
- each module sits on a layer (LAYERS, by module prefix) and imports only its own layer or
  lower ones;
- there is no cycle among modules;
- nothing in megalite imports `tools` or `tests`;
- `megalite.cpu` (an opt-in backend, if one exists) is imported only by `megalite.run`;
- every megalite module is placed in LAYERS, so a new top-level module has to be placed;
- a test file takes what it shares with others from tests/helpers/, never from another test
  file or a conftest.

When a module moves, update LAYERS: the longest matching prefix places a module.
"""

import ast
import os

import pytest

import megalite

PACKAGE_DIR = os.path.dirname(os.path.abspath(megalite.__file__))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Module prefix -> layer, lowest first.
LAYERS = {
    "megalite": 0,  # the package's __init__ (a version string)
    "megalite.errors": 0,
    "megalite.config": 1,
    "megalite.parallel_state": 2,
    "megalite.data": 2,
    "megalite.arguments": 2,  # the command line makes a RunConfig and nothing else
    "megalite.kernels": 3,
    "megalite.tensor_parallel": 4,
    "megalite.model": 5,
    "megalite.pipeline_parallel": 6,
    "megalite.data_parallel": 6,
    "megalite.checkpoint": 7,
    "megalite.run": 8,
    "megalite.cpu": 8,  # and imported by megalite.run only (ONLY_IMPORTED_BY)
    "megalite.convert": 9,
    "megalite.plan": 9,
}

# Module prefix -> the prefixes of the only megalite modules that may import it.
ONLY_IMPORTED_BY = {"megalite.cpu": ("megalite.run",)}

FORBIDDEN_TOP_LEVEL = ("tools", "tests")


def _under(module, prefix):
    return module == prefix or module.startswith(prefix + ".")


def _longest_prefix(module, table):
    matches = [prefix for prefix in table if _under(module, prefix)]
    return max(matches, key=len) if matches else None


def layer_of(module):
    prefix = _longest_prefix(module, LAYERS)
    if prefix is None or (prefix == "megalite" and module != "megalite"):
        return None  # only the package's own __init__ sits on the "megalite" row
    return LAYERS[prefix]


def package_modules(package_dir=PACKAGE_DIR):
    """Module name -> (source path, is_package) for every .py file of the package."""
    modules = {}
    root = os.path.dirname(package_dir)
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join(parts)] = (path, is_package)
    return modules


def imported_names(module, path, is_package):
    """(line, absolute name) for each import in the file, at any depth; `from a import b`
    gives `a.b` (import_graph falls back to `a` when `a.b` is no module)."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return names


def import_graph(package_dir=PACKAGE_DIR):
    """Module -> {imported megalite module: first line}, and the list of (module, line,
    name) imports of tools/tests."""
    modules = package_modules(package_dir)
    graph, forbidden = {}, []
    for module, (path, is_package) in modules.items():
        edges = {}
        for line, name in imported_names(module, path, is_package):
            top = name.split(".")[0]
            if top in FORBIDDEN_TOP_LEVEL:
                forbidden.append((module, line, name))
            if top != "megalite":
                continue
            # `from a import b`: the edge goes to a.b if that is a module, else to a.
            target = name
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target != module and target in modules:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph, forbidden


def find_cycles(graph):
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def unplaced_modules(package_dir=PACKAGE_DIR):
    return sorted(module for module in package_modules(package_dir) if layer_of(module) is None)


def upward_imports(graph):
    """`module (layer a) -> target (layer b), line n` for each import of a higher layer."""
    violations = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            module_layer, target_layer = layer_of(module), layer_of(target)
            if module_layer is None or target_layer is None:
                continue  # reported by test_every_module_has_a_layer
            if target_layer > module_layer:
                violations.append(f"{module} (layer {module_layer}) -> {target} (layer {target_layer}), line {line}")
    return violations


def restricted_imports(graph):
    """`module -> target` for each import of a module only its owners may import."""
    violations = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            restricted = _longest_prefix(target, ONLY_IMPORTED_BY)
            if restricted is None or _under(module, restricted):
                continue
            if not any(_under(module, owner) for owner in ONLY_IMPORTED_BY[restricted]):
                owners = ", ".join(ONLY_IMPORTED_BY[restricted])
                violations.append(f"{module} -> {target}, line {line} (only {owners} may)")
    return violations


def test_every_module_has_a_layer():
    unplaced = unplaced_modules()
    if unplaced:
        pytest.fail("megalite modules missing from LAYERS in tests/test_imports.py (place each on a layer): "
                    + ", ".join(unplaced), pytrace=False)


def test_no_import_from_a_higher_layer():
    violations = upward_imports(import_graph()[0])
    if violations:
        pytest.fail("imports from a higher layer:\n  " + "\n  ".join(violations), pytrace=False)


def test_restricted_modules_imported_only_by_their_owners():
    violations = restricted_imports(import_graph()[0])
    if violations:
        pytest.fail("imports of restricted modules:\n  " + "\n  ".join(violations), pytrace=False)


def test_no_import_of_tools_or_tests():
    lines = [f"{module}, line {line}: imports {name}" for module, line, name in import_graph()[1]]
    if lines:
        pytest.fail("megalite imports tools or tests:\n  " + "\n  ".join(lines), pytrace=False)


def test_tests_share_code_only_through_helpers():
    """Imports of `tests.*` outside tests.helpers: a test module or conftest used as a library."""
    lines = []
    for folder, dirs, files in os.walk(TESTS_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            module = "tests." + os.path.relpath(path, TESTS_DIR)[: -len(".py")].replace(os.sep, ".")
            lines += [f"{os.path.relpath(path, TESTS_DIR)}, line {line}: imports {imported}"
                      for line, imported in imported_names(module, path, is_package=False)
                      if _under(imported, "tests") and not _under(imported, "tests.helpers")]
    if lines:
        pytest.fail("tests import other test files; move what they share to tests/helpers/:\n  "
                    + "\n  ".join(lines), pytrace=False)


def test_no_import_cycles():
    cycles = find_cycles(import_graph()[0])
    if cycles:
        pytest.fail("import cycles among modules:\n  " + "\n  ".join(" <-> ".join(cycle) for cycle in cycles),
                    pytrace=False)


def _write(root, path, text=""):
    path = root / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """A made-up megalite: function-level and relative imports count, `from a import b` finds the
    module b, and each rule reports what it should."""
    _write(tmp_path, "megalite/__init__.py")
    _write(tmp_path, "megalite/errors.py")
    _write(tmp_path, "megalite/config/__init__.py", "from .rules import check\n")
    _write(tmp_path, "megalite/config/rules.py", "def check():\n    from ..model import gpt\n")
    _write(tmp_path, "megalite/model/__init__.py")
    _write(tmp_path, "megalite/model/gpt.py", "from megalite.config import rules\nimport megalite.cpu.ops\n")
    _write(tmp_path, "megalite/cpu/__init__.py")
    _write(tmp_path, "megalite/cpu/ops.py", "import tools.bench\n")
    _write(tmp_path, "megalite/run/__init__.py", "from megalite.cpu import ops\n")
    _write(tmp_path, "megalite/newthing.py", "from megalite import errors\n")
    graph, forbidden = import_graph(str(tmp_path / "megalite"))
    assert graph["megalite.config"] == {"megalite.config.rules": 1}
    assert graph["megalite.config.rules"] == {"megalite.model.gpt": 2}
    assert graph["megalite.model.gpt"] == {"megalite.config.rules": 1, "megalite.cpu.ops": 2}
    assert graph["megalite.newthing"] == {"megalite.errors": 1}
    assert upward_imports(graph) == [
        "megalite.config.rules (layer 1) -> megalite.model.gpt (layer 5), line 2",
        "megalite.model.gpt (layer 5) -> megalite.cpu.ops (layer 8), line 2"]
    assert restricted_imports(graph) == ["megalite.model.gpt -> megalite.cpu.ops, line 2 (only megalite.run may)"]
    assert forbidden == [("megalite.cpu.ops", 1, "tools.bench")]
    assert find_cycles(graph) == [["megalite.config.rules", "megalite.model.gpt"]]
    assert unplaced_modules(str(tmp_path / "megalite")) == ["megalite.newthing"]
    assert layer_of("megalite.run.training") == 8 and layer_of("megalite.plan.dry_run") == 9
