"""The shape of the code in plugin/, launch/ and benchmarks/: imports run one way (no circle, also
through imports inside functions), no module reaches for another module's private names, private
upstream APIs are reached only through the inventories (``smmd_scale/compat.py``,
``smmd_train/compat.py``, ``smmd_numeracy/compat.py``), and only the configuration modules turn a
command line into argparse's namespace. Each check is a function of the files it reads,
and each is shown to fail on a planted offence."""

import ast
import functools
import textwrap

from helpers.launching import REPO

PLUGIN = REPO / "plugin"
# The inventories of private upstream APIs: the only modules that may reach for them.
INVENTORIES = {"smmd_scale.compat", "smmd_train.compat", "smmd_numeracy.compat"}
# Underscored names the standard library documents as public.
PUBLIC_UNDERSCORED = {"os._exit"}
# The modules of plugin/, launch/ and benchmarks/ that may turn a command line into argparse's namespace: train.py's
# configuration, the small tools' option dataclasses (smmd_cli.options), and the inventory, which builds
# the namespace DeepSpeed's ds_to_universal entry point takes. Every other module reads typed fields.
NAMESPACE_MODULES = {"smmd_train.config.arguments", "smmd_train.config.run_config", "smmd_cli.options",
                     "smmd_train.compat"}
PARSE_METHODS = {"parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"}


def modules_under(root, folders) -> dict:
    """``{dotted module name: path}`` of every ``.py`` file under ``root / folder``, named from ``root``
    (``smmd_train.compat`` for plugin/smmd_train/compat.py, ``benchmarks.numeracy.runner``, ``launch.train``)."""
    found = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = {**modules_under(PLUGIN, ["smmd_scale", "smmd_train", "smmd_numeracy", "smmd_cli"]),
           **modules_under(REPO, ["launch", "benchmarks"])}


@functools.lru_cache(maxsize=None)
def syntax_tree(path) -> ast.Module:
    return ast.parse(path.read_text())


def imports_of(name: str, path, modules: dict) -> list:
    """``[(imported module, [names taken from it], the name it is bound to or None)]`` for every import
    of one of ``modules`` in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(syntax_tree(path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], alias.asname) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = ".".join(part for part in (base if node.level else "", node.module or "") if part)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, [], alias.asname or alias.name) if submodule in modules
                             else (source, [alias.name], None))
    return [(module, names, bound) for module, names, bound in found if module in modules]


def import_circle(modules: dict):
    """The first import circle among ``modules`` as ``[a, b, ..., a]``, or None."""
    graph = {name: {module for module, _, _ in imports_of(name, path, modules) if module != name}
             for name, path in modules.items()}
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            return on_path[on_path.index(name):] + [name]
        if name in done:
            return None
        on_path.append(name)
        for module in sorted(graph[name]):
            circle = visit(module)
            if circle:
                return circle
        on_path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        circle = visit(name)
        if circle:
            return circle
    return None


def private_cross_module_names(modules: dict) -> list:
    """``["a imports b._x", "a uses b._x"]`` for every private name one of ``modules`` takes from another."""
    offenders = []
    for name, path in modules.items():
        imports = imports_of(name, path, modules)
        for module, names, _ in imports:
            offenders += [f"{name} imports {module}.{taken}" for taken in names if _is_private(taken)]
        bound = {alias: module for module, _, alias in imports if alias}
        offenders += [f"{name} uses {bound[node.value.id]}.{node.attr}"
                      for node in ast.walk(syntax_tree(path))
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in bound and _is_private(node.attr)]
    return offenders


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_upstream_uses(path, project_packages=("smmd_scale", "smmd_train", "smmd_numeracy", "smmd_cli", "benchmarks",
                                                   "launch")) -> list:
    """``["file:line: what"]`` for every private upstream API the file reaches for outside an inventory:

    * ``thing._name`` on anything but ``self``, ``cls`` or a module of the project (those are
      :func:`private_cross_module_names`' business);
    * ``self._name`` / ``cls._name`` that the file never defines: inherited from an upstream class;
    * a private method that nothing in the file calls: an override of an upstream class's hook;
    * ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with a private name;
    * an import of a private upstream module or name (``import torch._dynamo``, ``from x import _y``,
      ``importlib.import_module("torch._dynamo")``).
    """
    tree = syntax_tree(path)
    project = set()  # names the file binds to the project's own modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in project_packages):
            project |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            project |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                        if alias.name.split(".")[0] in project_packages}
    defined, referenced = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute):
            (defined if isinstance(node.ctx, ast.Store) else referenced).add(node.attr)
        elif isinstance(node, ast.Name):
            (defined if isinstance(node.ctx, ast.Store) else referenced).add(node.id)
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls"):
                if node.attr not in defined:
                    found.append(f"{where}: {owner}.{node.attr} (inherited)")
            elif owner not in project and f"{owner}.{node.attr}" not in PUBLIC_UNDERSCORED:
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef):
            found += [f"{path}:{item.lineno}: {node.name}.{item.name} (overrides an upstream hook)"
                      for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and _is_private(item.name) and item.name not in referenced]
        elif isinstance(node, ast.Call) and node.args:
            function = ast.unparse(node.func)
            first, second = node.args[0], node.args[1] if len(node.args) > 1 else None
            if (function in ("getattr", "setattr", "hasattr", "delattr") and isinstance(second, ast.Constant)
                    and isinstance(second.value, str) and _is_private(second.value)):
                found.append(f"{where}: {ast.unparse(node)}")
            elif (function.endswith("import_module") and isinstance(first, ast.Constant)
                  and isinstance(first.value, str) and any(_is_private(part) for part in first.value.split("."))):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {alias.name}" for alias in node.names
                      if any(_is_private(part) for part in alias.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if module.split(".")[0] not in project_packages:
                found += [f"{where}: from {module} import {alias.name}" for alias in node.names
                          if any(_is_private(part) for part in [*module.split("."), alias.name])]
    return found


def namespace_uses(path) -> list:
    """``["file:line: what"]`` for every place the file parses a command line into argparse's namespace
    (``parser.parse_args(...)`` and the other ``parse_*`` methods) or names ``Namespace``."""
    found = []
    for node in ast.walk(syntax_tree(path)):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PARSE_METHODS:
            found.append(f"{where}: {ast.unparse(node.func)}(...)")
        elif (isinstance(node, ast.Attribute) and node.attr == "Namespace") or (
                isinstance(node, ast.Name) and node.id == "Namespace"):
            found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found += [f"{where}: from argparse import Namespace" for alias in node.names if alias.name == "Namespace"]
    return found


def test_imports_have_no_circle():
    assert {"smmd_scale.loss", "smmd_scale.numeric_loss", "smmd_scale.call_plan", "launch.train",
            "benchmarks.numeracy.run_study", "benchmarks.numeracy.study_a"} <= set(MODULES)
    circle = import_circle(MODULES)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_module_imports_a_private_name_of_another():
    offenders = private_cross_module_names(MODULES)
    assert not offenders, offenders


def test_private_upstream_apis_are_reached_only_through_the_inventories():
    assert INVENTORIES <= set(MODULES)
    offenders = [use for name, path in MODULES.items() if name not in INVENTORIES
                 for use in private_upstream_uses(path)]
    assert not offenders, offenders


def test_only_the_configuration_modules_read_argparse_s_namespace():
    assert NAMESPACE_MODULES <= set(MODULES)
    assert {"launch.export_hf", "benchmarks.bench_loss", "benchmarks.numeracy.study_a"} <= set(MODULES)
    offenders = [use for name, path in MODULES.items() if name not in NAMESPACE_MODULES
                 for use in namespace_uses(path)]
    assert not offenders, offenders


def test_the_loss_core_runs_one_way():
    """What a loss is knows nothing of calls; the per-call plan and the steps know no concrete loss."""
    direct = {name: {module for module, _, _ in imports_of(name, path, MODULES)} for name, path in MODULES.items()}
    assert direct["smmd_scale.call_plan"] <= {"smmd_scale.checks", "smmd_scale.parallel", "smmd_scale.vocab",
                                              "smmd_scale.sequence_shard", "smmd_scale.block_plan"}
    assert direct["smmd_scale.steps"] <= {"smmd_scale.call_plan", "smmd_scale.block_plan"}
    assert direct["smmd_scale.block_plan"] == set()  # the plan is a function of shapes and the device alone
    # (compat: the inventory of torch's private calls; the exchange's device-side checks use its assert)
    assert direct["smmd_scale.parallel"] <= {"smmd_scale.checks", "smmd_scale.compat"}
    assert direct["smmd_scale.sequence_shard"] <= {"smmd_scale.parallel"}  # a call's slice of the sequence
    for op in ("smmd_scale.loss", "smmd_scale.fused_linear", "smmd_scale.steps", "smmd_scale.call_plan",
               "smmd_scale.sequence_shard"):
        assert not direct[op] & {"smmd_scale.numeric_loss", "smmd_scale.smmd", "smmd_scale.ntl"}, op


# ----------------------------------------------------------------------------------------------
# Each check fails on a planted offence
# ----------------------------------------------------------------------------------------------

def _plant(root, files: dict) -> dict:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(textwrap.dedent(text))
    return modules_under(root, sorted({relative.split("/")[0] for relative in files}))


def test_a_planted_circle_and_private_cross_module_name_are_found(tmp_path):
    """The shape of the circle that benchmarks/numeracy had: a runner imports a study inside a
    function, the study imports the runner's helpers (one of them private)."""
    modules = _plant(tmp_path, {
        "study/__init__.py": "",
        "study/run_all.py": """
            def main():
                from study import tier_a
                return tier_a.main()

            def _run_logged():
                pass
            """,
        "study/tier_a.py": """
            from .run_all import _run_logged
            from . import report

            def main():
                return report._fmt(_run_logged())
            """,
        "study/report.py": "def _fmt(value):\n    return str(value)\n",
    })
    assert import_circle(modules) == ["study.run_all", "study.tier_a", "study.run_all"]
    assert sorted(private_cross_module_names(modules)) == ["study.tier_a imports study.run_all._run_logged",
                                                           "study.tier_a uses study.report._fmt"]
    del modules["study.run_all"]
    assert import_circle(modules) is None


def test_planted_private_upstream_accesses_are_found(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(textwrap.dedent("""
        import argparse
        import importlib
        import os

        import torch
        import torch._dynamo
        import torch.distributed as dist
        from deepspeed.utils import _private_helper
        from smmd_train import compat
        from . import sibling


        class Formatter(argparse.HelpFormatter):
            def _get_help_string(self, action):
                return action.help

            def _ours(self):
                return self._width + self._own

            def __init__(self):
                self._own = 1
                self._ours()


        def reach(model, dataset, layer):
            importlib.import_module("torch._dynamo")
            groups = dist.distributed_c10d._world.pg_map
            fingerprint = getattr(dataset, "_fingerprint", None)
            layer._all_to_all_groups.pop("name", None)
            model.config._attn_implementation
            compat.dataset_fingerprint(dataset), sibling._helper, torch.nn.functional.relu
            os._exit(0)
        """))
    found = sorted(use.split(":", 2)[2].strip() for use in private_upstream_uses(path))
    assert found == sorted([
        "import torch._dynamo", "from deepspeed.utils import _private_helper",
        "Formatter._get_help_string (overrides an upstream hook)", "self._width (inherited)",
        "importlib.import_module('torch._dynamo')", "dist.distributed_c10d._world",
        "getattr(dataset, '_fingerprint', None)", "layer._all_to_all_groups",
        "model.config._attn_implementation"]), found
    # A real module with one of the accesses its inventory wraps put back is refused.
    data = (PLUGIN / "smmd_train" / "data" / "packing.py").read_text()
    assert "compat.dataset_fingerprint(dataset)" in data
    (tmp_path / "data.py").write_text(data.replace("compat.dataset_fingerprint(dataset)", "dataset._fingerprint", 1))
    found = [use.split(":", 2)[2].strip() for use in private_upstream_uses(tmp_path / "data.py")]
    assert found == ["dataset._fingerprint"]


def test_planted_namespace_reads_are_found(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(textwrap.dedent("""
        import argparse
        from argparse import Namespace
        from types import SimpleNamespace

        from smmd_cli.options import parse_options


        def main(argv, parser, Options):
            args = parser.parse_args(argv)
            known, rest = parser.parse_known_args(argv)
            made = argparse.Namespace(model="tiny")
            options, _ = parse_options(Options, argv)
            return SimpleNamespace(weak=True), args, known, made, options
        """))
    found = sorted(use.split(":", 2)[2].strip() for use in namespace_uses(path))
    assert found == sorted(["from argparse import Namespace", "parser.parse_args(...)", "parser.parse_known_args(...)",
                            "argparse.Namespace"]), found
    # A real tool with a parser of its own put back is refused.
    tool = (PLUGIN / "smmd_train" / "tools" / "gguf_convert.py").read_text()
    assert not namespace_uses(PLUGIN / "smmd_train" / "tools" / "gguf_convert.py")
    (tmp_path / "gguf_convert.py").write_text(tool + "\n\nARGS = argparse.ArgumentParser().parse_args()\n")
    found = [use.split(":", 2)[2].strip() for use in namespace_uses(tmp_path / "gguf_convert.py")]
    assert found == ["argparse.ArgumentParser().parse_args(...)"]
    # So is a benchmark that parses its own command line again, and a study that hands a namespace on.
    study = REPO / "benchmarks" / "numeracy" / "study_a.py"
    assert not namespace_uses(study)
    planted = {"study_a.py": study.read_text().replace("def run_grid(tier: str, options,",
                                                       "def run_grid(tier: str, options: argparse.Namespace,", 1),
               "bench_loss.py": (REPO / "benchmarks" / "bench_loss.py").read_text()
               + "\n\nARGS = argparse.ArgumentParser().parse_known_args()\n"}
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    found = [use.split(":", 2)[2].strip() for name in planted for use in namespace_uses(tmp_path / name)]
    assert found == ["argparse.Namespace", "argparse.ArgumentParser().parse_known_args(...)"]


def ignore_index_literals(source: str) -> list:
    """Line numbers of ``-100`` written as a number in code (not in strings or comments)."""
    import io
    import tokenize

    tokens = [token for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    return [number.start[0] for minus, number in zip(tokens, tokens[1:])
            if minus.string == "-" and number.type == tokenize.NUMBER and number.string == "100"]


def test_the_ignore_index_is_written_once():
    """``IGNORE_INDEX`` (smmd_scale.numeric_loss) is the one -100 in the installed packages' code."""
    found = {str(path.relative_to(PLUGIN)): lines for path in sorted(PLUGIN.rglob("*.py"))
             if (lines := ignore_index_literals(path.read_text()))}
    assert list(found) == ["smmd_scale/numeric_loss.py"] and len(found["smmd_scale/numeric_loss.py"]) == 1, found
    assert ignore_index_literals("x = f(y, -100)  # -100\ns = '-100'\n") == [1]  # the finder finds, and only code


# ----------------------------------------------------------------------------------------------
# The trainer's rooms and floors
# ----------------------------------------------------------------------------------------------

# The trainer's rooms (a folder each) and top-level modules, by floor, lowest first. A module imports
# its own room and the rooms of lower floors, never a room on its floor or above: the floors run one way.
TRAINER_FLOORS = [("compat", "moved", "loss_modules"), ("model", "monitor"), ("distributed", ), ("config", "data"),
                  ("components", ), ("checkpoint", ), ("plan", ), ("run", ), ("tools", ), ("train", "commands")]
TRAINER_ROOMS = ("config", "data", "distributed", "model", "checkpoint", "monitor", "components", "tools")


def room_of(module: str, package: str = "smmd_train") -> str:
    """``"config"`` for smmd_train.config.arguments, ``"plan"`` for smmd_train.plan; ``""`` for the package."""
    return module[len(package) + 1:].split(".")[0] if module.startswith(package + ".") else ""


def upward_imports(modules: dict, floors=TRAINER_FLOORS, package: str = "smmd_train") -> list:
    """``["a imports b (floor i -> j)"]`` for every import from a room to another on its floor or above, and
    ``["a: in no floor"]`` for a module of ``package`` whose room is on no floor."""
    floor_of = {room: floor for floor, rooms in enumerate(floors) for room in rooms}
    found = []
    for name, path in modules.items():
        room = room_of(name, package)
        if not room:
            continue
        if room not in floor_of:
            found.append(f"{name}: in no floor")
            continue
        for module, _, _ in imports_of(name, path, modules):
            other = room_of(module, package)
            if other and other != room and floor_of.get(other, len(floors)) >= floor_of[room]:
                found.append(f"{name} imports {module} (floor {floor_of[room]} -> {floor_of.get(other)})")
    return found


def test_the_trainer_s_floors_run_one_way():
    trainer = {name for name in MODULES if name.startswith("smmd_train.")}
    assert {f"smmd_train.{room}" for room in TRAINER_ROOMS} <= trainer
    assert {room_of(name) for name in trainer} == {room for rooms in TRAINER_FLOORS for room in rooms}
    offenders = upward_imports(MODULES)
    assert not offenders, offenders


def test_a_planted_upward_import_is_found(tmp_path):
    """A preset that reaches up into the checkpoint room, and a module in a room on no floor."""
    modules = _plant(tmp_path, {
        "smmd_train/__init__.py": "",
        "smmd_train/model/__init__.py": "",
        "smmd_train/model/presets.py": "from ..checkpoint.commits import committed\n",
        "smmd_train/checkpoint/__init__.py": "",
        "smmd_train/checkpoint/commits.py": "from ..model import presets\ncommitted = presets\n",
        "smmd_train/attic/old.py": "",
    })
    assert upward_imports(modules) == ["smmd_train.attic.old: in no floor",
                                       "smmd_train.model.presets imports smmd_train.checkpoint.commits "
                                       "(floor 1 -> 5)"]


def test_the_trainer_s_map_names_every_room():
    described = (PLUGIN / "smmd_train" / "__init__.py").read_text()
    rooms = sorted(path.parent.name for path in (PLUGIN / "smmd_train").glob("*/__init__.py"))
    assert rooms == sorted(TRAINER_ROOMS)
    for room in [*rooms, "train", "run", "plan", "commands", "compat", "moved", "loss_modules"]:
        assert f"``{room}``" in described, f"smmd_train/__init__.py does not name {room}"
