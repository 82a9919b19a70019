"""The shape of the code: imports in plugin/ run one way (no circle, also through imports inside
functions), and no module reaches for another module's private names."""

import ast

from helpers.launching import REPO

PLUGIN = REPO / "plugin"


def module_name(path) -> str:
    parts = list(path.relative_to(PLUGIN).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PLUGIN.rglob("*.py"))}


def imports_of(name: str, path) -> list:
    """``[(imported module, [names taken from it])]`` for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = ".".join(part for part in (base if node.level else "", node.module or "") if part)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, []) if submodule in MODULES else (source, [alias.name]))
    return [(module, names) for module, names in found if module in MODULES]


def test_plugin_imports_have_no_circle():
    graph = {name: {module for module, _ in imports_of(name, path) if module != name}
             for name, path in MODULES.items()}
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            circle = on_path[on_path.index(name):] + [name]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if name in done:
            return
        on_path.append(name)
        for module in sorted(graph[name]):
            visit(module)
        on_path.pop()
        done.add(name)

    assert {"smmd_scale.loss", "smmd_scale.numeric_loss", "smmd_scale.call_plan"} <= set(graph)
    for name in sorted(graph):
        visit(name)


def test_no_module_imports_a_private_name_of_another():
    offenders = []
    for name, path in MODULES.items():
        for module, names in imports_of(name, path):
            offenders += [f"{name} imports {module}.{taken}" for taken in names
                          if taken.startswith("_") and not taken.startswith("__")]
        tree = ast.parse(path.read_text())
        module_aliases = {alias.asname or alias.name for node in ast.walk(tree)
                          if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names
                          if f"{getattr(node, 'module', None) or ''}.{alias.name}".strip(".").split(".")[-1]
                          in {module.rpartition(".")[2] for module in MODULES}}
        offenders += [f"{name} uses {node.value.id}.{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in module_aliases and node.attr.startswith("_")
                      and not node.attr.startswith("__")]
    assert not offenders, offenders


def test_the_loss_core_runs_one_way():
    """What a loss is knows nothing of calls; the per-call plan and the steps know no concrete loss."""
    direct = {name: {module for module, _ in imports_of(name, path)} for name, path in MODULES.items()}
    assert direct["smmd_scale.call_plan"] <= {"smmd_scale.checks", "smmd_scale.parallel", "smmd_scale.vocab",
                                              "smmd_scale.sequence_shard"}
    assert direct["smmd_scale.steps"] <= {"smmd_scale.call_plan"}
    assert direct["smmd_scale.parallel"] <= {"smmd_scale.checks"}
    assert direct["smmd_scale.sequence_shard"] <= {"smmd_scale.parallel"}  # a call's slice of the sequence
    for op in ("smmd_scale.loss", "smmd_scale.fused_linear", "smmd_scale.steps", "smmd_scale.call_plan",
               "smmd_scale.sequence_shard"):
        assert not direct[op] & {"smmd_scale.numeric_loss", "smmd_scale.smmd", "smmd_scale.ntl"}, op
