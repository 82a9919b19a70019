"""The numeric losses' options as the trainer sees them, all read from the registry
(``smmd_scale.registry``): each option is a train.py flag with the entry's default, type, choices and
help line; the flags reach the built loss; a bad value is one line naming the flag; the HParams
columns and the resume record list exactly the options of the run's losses."""

import argparse
import math

import pytest
from helpers.launching import REPO, train_flags

import smmd_scale
from smmd_scale.registry import NUMERIC_LOSSES, all_options, options_in_use
from smmd_train.components.loss_reporter import LOSS_FLAGS, numeric_loss, objective_record
from smmd_train.config.arguments import build_parser, parse_args
from smmd_train.config.run_config import RunConfig
from smmd_train.monitor.dashboards import LOSS_OPTION_COLUMNS, RUN_HPARAMS, UNUSED_OPTION, loss_option_hparams

ZERO3 = REPO / "ds_configs" / "zero3.json"


def args_with(tmp_path, **options):
    return parse_args(train_flags(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["x"], max_steps=1,
                                  output_dir=tmp_path, **options))


def other_value(option):
    """A valid value of ``option`` other than its default, as a train_flags keyword takes it."""
    if option.kind is bool:
        return not option.default
    if option.choices:
        return next(choice for choice in option.choices if choice != option.default)
    if option.several:
        return [value * 1.5 for value in option.default]
    return 3.5 if option.default is None else option.default * 1.5


def test_every_registered_option_is_a_train_flag_with_the_entry_s_default_and_help():
    actions = {option: action for action in build_parser()._actions for option in action.option_strings}
    assert all_options(), "the registry declares the loss options"
    for option in all_options():
        action = actions[option.flag]
        default = list(option.default) if option.several else option.default
        assert action.default == default and action.help == option.help, option.flag
        if option.kind is bool:
            assert isinstance(action, argparse.BooleanOptionalAction) and f"--no-{option.column}" in actions
        else:
            assert action.type is option.kind and list(action.choices or ()) == list(option.choices)
            assert (action.nargs == "+") is option.several


@pytest.mark.parametrize("name", sorted(NUMERIC_LOSSES))
def test_each_option_s_flag_reaches_the_built_loss(tmp_path, name):
    entry = NUMERIC_LOSSES[name]
    values = {option.column: other_value(option) for option in entry.options}
    args = args_with(tmp_path, numeric_loss=[name], numeric_policy="digits", **values)
    vocab = smmd_scale.NumericVocab(list(range(10)), list(range(10)), 16)
    loss = numeric_loss(RunConfig.from_args(args).loss, vocab)
    for option in entry.options:
        assert getattr(loss, option.keyword) == option.keyword_value(values[option.column]), option.flag


@pytest.mark.parametrize("option", [option for option in all_options() if option.check is not None],
                         ids=lambda option: option.flag)
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_checked_option_s_bad_value_is_one_line_naming_its_flag(tmp_path, capsys, option, value):
    assert option.check(float(value)) is not None  # both values are out of every checked option's range
    with pytest.raises(SystemExit) as exited:
        args_with(tmp_path, **{option.column: value})
    error = capsys.readouterr().err
    assert exited.value.code == 2 and error.count("\n") == 1
    assert f"{option.flag} {float(value)} {option.check(float(value))}" in error


def test_hparams_show_the_options_of_the_run_s_losses_and_mark_the_others_unused(tmp_path):
    assert set(LOSS_OPTION_COLUMNS) <= set(RUN_HPARAMS)
    args = args_with(tmp_path, numeric_loss=["ntl-was:0.3"], ntl_squash_factor=9.0, smmd_sigmas=[1.0, 3.0])
    columns = loss_option_hparams(RunConfig.from_args(args).loss.options, args.numeric_loss)
    assert tuple(columns) == LOSS_OPTION_COLUMNS
    in_use = {option.column for option in options_in_use(args.numeric_loss)}
    assert in_use == {"ntl_reweigh", "ntl_squash_factor"}
    assert columns["ntl_squash_factor"] == 9.0 and columns["ntl_reweigh"] is True
    assert all(columns[column] == UNUSED_OPTION for column in set(columns) - in_use)  # --smmd_sigmas too
    args = args_with(tmp_path, smmd_sigmas=[1.0, 3.0])
    options = RunConfig.from_args(args).loss.options
    assert loss_option_hparams(options, args.numeric_loss)["smmd_sigmas"] == "1 3"
    assert set(loss_option_hparams(options, ()).values()) == {UNUSED_OPTION}


def test_the_resume_record_holds_the_options_of_the_run_s_losses(tmp_path):
    assert LOSS_FLAGS == {name: tuple(option.column for option in entry.options)
                          for name, entry in NUMERIC_LOSSES.items()}
    vocab = smmd_scale.NumericVocab(list(range(10)), list(range(10)), 16)
    args = args_with(tmp_path, numeric_loss=["smmd", "ntl-mse:0.5"], smmd_squash_factor=4.0)
    record = objective_record(RunConfig.from_args(args).loss, vocab)
    options = {option.flag for option in all_options()}
    recorded = {key for key in record if key in options}
    assert recorded == {"--smmd_mode", "--smmd_kernel", "--smmd_sigmas", "--smmd_squash_factor", "--ntl_reweigh"}
    assert math.isclose(record["--smmd_squash_factor"], 4.0)
