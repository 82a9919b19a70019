"""The typed run configuration (``smmd_train.config.run_config``) built from train.py's real command lines:
flags and the DeepSpeed config's numbers resolved once, a mistyped field name failing where it is
written, and every flag of the parser declared by exactly one field."""

import argparse
import ast
import dataclasses
import json

import pytest
from helpers.launching import REPO, train_flags

from smmd_train.config.arguments import build_parser, parse_args
from smmd_train.config.run_config import PARSER_ONLY, SECTIONS, Optimization, RunConfig, RunRefused

ZERO3 = REPO / "ds_configs" / "zero3.json"


def config_of(tmp_path, **options) -> RunConfig:
    values = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path / "tok", data=["a.jsonl", "b.jsonl"],
                  max_steps=5, output_dir=tmp_path / "run")
    values.update(options)
    return RunConfig.from_args(parse_args(train_flags(**values)))


def test_the_flags_fill_the_sections(tmp_path):
    config = config_of(tmp_path, seq_len=64, tp=2, sp=1, lr=1e-3, numeric_loss=["smmd:0.5", "ntl-was:0.3"],
                       smmd_sigmas=[1.0, 3.0], z_loss=1e-4, resume=True, eval_data=["held.jsonl"])
    assert config.model_data.model == "tiny" and config.model_data.data == ("a.jsonl", "b.jsonl")
    assert config.model_data.seq_len == 64 and config.model_data.eval_data == ("held.jsonl", )
    assert config.model_data.cache_dir == str(tmp_path / "run" / "cache")
    assert (config.optimization.max_steps, config.optimization.lr, config.optimization.warmup_steps) == (5, 1e-3, None)
    assert (config.layout.tp, config.layout.sp) == (2, 1)
    assert config.deepspeed["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": True}
    assert config.loss.numeric_loss == (("smmd", 0.5), ("ntl-was", 0.3))
    assert config.loss.options["smmd_sigmas"] == (1.0, 3.0) and config.loss.options["ntl_squash_factor"] is None
    assert config.loss.z_loss == 1e-4 and config.loss.framework_loss is False
    assert config.checkpointing.resume is True and config.checkpointing.output_dir == str(tmp_path / "run")
    assert config.logging.tensorboard is True
    assert config.logging.tensorboard_dir == str(tmp_path / "run" / "tensorboard")
    assert config.command_line["tp"] == 2 and config.command_line["data"] == ["a.jsonl", "b.jsonl"]


def test_the_deepspeed_config_s_numbers_rule_where_no_flag_is_given(tmp_path):
    raw = json.loads(ZERO3.read_text())
    raw.update(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2,
               tensor_parallel={"autotp_size": 2, "vocab_parallel_lm_head": True})
    raw["optimizer"]["params"]["lr"] = 2e-3
    raw["tensorboard"].update(output_path=str(tmp_path / "tb"), job_name="first")
    (tmp_path / "ds.json").write_text(json.dumps(raw))
    config = config_of(tmp_path, deepspeed_config=tmp_path / "ds.json")
    assert (config.optimization.micro_batch_size, config.optimization.gradient_accumulation_steps) == (3, 2)
    assert (config.optimization.lr, config.optimization.weight_decay) == (2e-3, 0.1)  # weight_decay "auto": the flag's
    assert config.layout.tp == 2 and config.logging.tensorboard_dir == str(tmp_path / "tb" / "first")
    assert config.deepspeed_dict()["optimizer"]["params"]["lr"] == 2e-3


def test_a_flag_that_contradicts_the_deepspeed_config_is_refused_one_line_each(tmp_path):
    raw = json.loads(ZERO3.read_text())
    raw.update(train_micro_batch_size_per_gpu=4)
    raw["optimizer"]["params"]["lr"] = 1e-3
    (tmp_path / "ds.json").write_text(json.dumps(raw))
    with pytest.raises(RunRefused) as refused:
        config_of(tmp_path, deepspeed_config=tmp_path / "ds.json", micro_batch_size=2, lr=3e-4)
    assert str(refused.value).splitlines() == [
        "--micro_batch_size 2 but the DeepSpeed config says train_micro_batch_size_per_gpu=4: drop the flag, or make "
        "them agree, or set train_micro_batch_size_per_gpu to \"auto\"",
        "--lr 0.0003 but the DeepSpeed config says optimizer.params.lr=0.001: drop the flag, or make them agree, or "
        "set optimizer.params.lr to \"auto\""]
    with pytest.raises(RunRefused, match="nowhere.json: no such file"):
        config_of(tmp_path, deepspeed_config=tmp_path / "nowhere.json")


def test_a_mistyped_field_fails_where_it_is_written(tmp_path):
    config = config_of(tmp_path)
    with pytest.raises(AttributeError, match="lrr"):
        config.optimization.lrr  # noqa: B018  (the read is the test)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optimization.lr = 1.0
    with pytest.raises(AttributeError):  # slots: no instance dict to take a new name, even past the frozen check
        object.__setattr__(config.layout, "tp_size", 2)
    with pytest.raises(TypeError, match="lrr"):
        Optimization(**{**{item.name: 1 for item in dataclasses.fields(Optimization)}, "lrr": 1.0})
    with pytest.raises(TypeError):  # the sections are read-only mappings too
        config.loss.options["smmd_sigmas"] = (1.0, )


def test_every_flag_sets_exactly_one_field():
    """The parser's flags and the fields' declared flags are the same set, each flag in one field (a
    deprecated spelling in its replacement's), apart from :data:`PARSER_ONLY`."""
    declared = {}
    for section in (*SECTIONS.values(), RunConfig):
        for item in dataclasses.fields(section):
            for flag in item.metadata.get("flags", ()):
                declared.setdefault(flag, []).append(f"{section.__name__}.{item.name}")
    assert {flag: fields for flag, fields in declared.items() if len(fields) > 1} == {}
    parser_flags = {option for action in build_parser()._actions for option in action.option_strings
                    if option.startswith("--") and not (isinstance(action, argparse.BooleanOptionalAction)
                                                        and option.startswith("--no-"))}
    assert set(PARSER_ONLY) <= parser_flags
    assert sorted(parser_flags - set(PARSER_ONLY) - set(declared)) == []  # a flag with no field
    assert sorted(set(declared) - parser_flags) == []  # a field naming a flag the parser lacks
    assert not set(PARSER_ONLY) & set(declared)


# Where train.py's parsed command line may be read: the parser's module and the configuration's.
NAMESPACE_READERS = {"plugin/smmd_train/config/arguments.py", "plugin/smmd_train/config/run_config.py"}


def namespace_reads(source: str) -> list:
    """``"line N"`` for each place in ``source`` where the result of ``smmd_train.config.arguments.parse_args``
    (under any name it is imported as) goes anywhere but straight into ``RunConfig.from_args``: directly,
    or through a variable every read of which does."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    parsers = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").rpartition(".")[2] == "arguments" for alias in node.names
               if alias.name == "parse_args"}

    def into_from_args(node) -> bool:
        parent = parents.get(node)
        return (isinstance(parent, ast.Call) and node in parent.args and isinstance(parent.func, ast.Attribute)
                and parent.func.attr == "from_args" and getattr(parent.func.value, "id", None) == "RunConfig")

    found = []
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) in parsers) or into_from_args(call):
            continue
        assigned = parents.get(call)
        if isinstance(assigned, ast.Assign) and [type(target) for target in assigned.targets] == [ast.Name]:
            scope = assigned
            while not isinstance(scope, (ast.FunctionDef, ast.Module)):
                scope = parents[scope]
            name = assigned.targets[0].id
            reads = [node for node in ast.walk(scope) if isinstance(node, ast.Name) and node.id == name
                     and isinstance(node.ctx, ast.Load)]
            found += [f"line {node.lineno}" for node in reads if not into_from_args(node)]
        else:
            found.append(f"line {call.lineno}")
    return found


def test_no_module_but_the_configuration_s_own_reads_the_parsed_command_line():
    planted = ("from smmd_train.config.arguments import parse_args as parse\n"
               "config = RunConfig.from_args(parse(argv))\n"
               "def main(argv):\n    args = parse(argv)\n    run(RunConfig.from_args(args))\n    return args.seq_len\n"
               "def other(argv):\n    return plan(parse(argv))\n")
    assert namespace_reads(planted) == ["line 6", "line 8"]
    offenders = {}
    for folder in ("plugin", "launch", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = str(path.relative_to(REPO))
            if relative not in NAMESPACE_READERS and namespace_reads(path.read_text()):
                offenders[relative] = namespace_reads(path.read_text())
    assert offenders == {}


def test_every_hparams_column_is_a_field_s_or_the_plan_s():
    """The HParams columns the fields declare, and those the plan or the launch decides, are the dashboard's."""
    from smmd_train.monitor.dashboards import RUN_HPARAMS

    declared = []
    for section in SECTIONS.values():
        for item in dataclasses.fields(section):
            column = item.metadata["hparam"]
            declared += [] if column is None else [column] if isinstance(column, str) else list(column)
    of_the_plan = {"world_size", "dp_size", "zero_stage", "offload", "global_batch", "launcher"}
    assert len(declared) == len(set(declared)) and not set(declared) & of_the_plan
    assert set(declared) | of_the_plan == set(RUN_HPARAMS)
