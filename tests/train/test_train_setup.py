"""What train.py decides before it trains, in one process: its arguments, the one builder of its
command lines, the DeepSpeed config (``--tp``, "auto" values, the CPU settings, flags that contradict
it), and bad options, configs and data failing with a clear error before any model is built, through
train.py's own set-up (``smmd_train.run.prepare_run`` up to its data stage). No launcher: the launch
adds nothing to these checks (test_faults.py shows that a data error on one rank stops every rank)."""

import json
import re

import pytest
from helpers.corpora import write_corpus
from helpers.launching import REPO, TRAIN, train_command, train_flags

from smmd_train.config.arguments import parse_args
from smmd_train.config.deepspeed import CPU_SETTINGS, load_config, resolve_config, set_tensor_parallel
from smmd_train.config.run_config import RunConfig
from smmd_train.distributed.groups import Launch
from smmd_train.monitor.dashboards import RUN_HPARAMS, run_hparams
from smmd_train.run import RunRefused, prepare_run

SEQ_LEN = 48
ZERO3 = REPO / "ds_configs" / "zero3.json"


def argv(tokenizer_dir, corpus, output_dir, **options) -> list:
    values = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=tokenizer_dir, data=[corpus], seq_len=SEQ_LEN,
                  micro_batch_size=2, max_steps=2, output_dir=output_dir)
    values.update(options)
    return train_flags(**values)


def prepared(arguments: list, world_size: int = 1, until: str = "data"):
    """train.py's own set-up (its parser, then ``prepare_run``) up to ``until``, in this process."""
    args = parse_args(arguments)
    return args, prepare_run(RunConfig.from_args(args), Launch(0, world_size, 0, world_size, "single"),
                             until=until).plan


# ------------------------------------------------------------------------------------------------
# The command-line builder
# ------------------------------------------------------------------------------------------------


def test_train_flags_round_trip_through_the_parser(tmp_path):
    flags = train_flags(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["a.jsonl", "b.jsonl"],
                        max_steps=3, output_dir=tmp_path / "run", tp=2, resume=True, framework_loss=False,
                        eval_data=None, smmd_sigmas=(1.0, 3.0))
    assert "--framework_loss" not in flags and "--eval_data" not in flags
    args = parse_args(flags)
    assert args.data == ["a.jsonl", "b.jsonl"] and args.smmd_sigmas == [1.0, 3.0]
    assert args.tp == 2 and args.resume is True and args.max_steps == 3
    assert args.tensorboard_dir is None  # the plan decides where (test_the_tensorboard_section_s_job_name_...)


def test_train_flags_refuse_unknown_options_and_values_for_switches():
    with pytest.raises(ValueError, match=r"train.py has no option --max_step; did you mean \['max_steps'"):
        train_flags(max_step=3)
    with pytest.raises(ValueError, match="--lr takes a value, got True"):
        train_flags(lr=True)


def test_train_command_launchers(tmp_path):
    deepspeed = train_command(processes=2, master_port=29555, model="tiny", max_steps=1)
    assert deepspeed[1:9] == ["--num_nodes", "1", "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port",
                              "29555"]
    assert deepspeed[9] == str(TRAIN) and deepspeed[10:] == ["--model", "tiny", "--max_steps", "1"]
    plain = train_command(launcher="python", model="tiny")
    assert plain[1:] == [str(TRAIN), "--model", "tiny"]
    custom = train_command(launcher=["torchrun", "--nproc_per_node", "8"], model="tiny")
    assert custom == ["torchrun", "--nproc_per_node", "8", str(TRAIN), "--model", "tiny"]
    with pytest.raises(ValueError, match="starts one process, not 2"):
        train_command(launcher="python", processes=2)


def test_numeric_loss_flags_build_the_run_s_numeric_loss(tmp_path):
    import smmd_scale
    from smmd_train.components.loss_reporter import numeric_loss

    def loss_of(args):
        return RunConfig.from_args(args).loss

    vocab = smmd_scale.NumericVocab(list(range(10)), list(range(10)), 20)
    base = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["x"], max_steps=1, output_dir=tmp_path)
    default = parse_args(train_flags(**base))
    assert default.numeric_loss == [("smmd", 1.0)] and isinstance(numeric_loss(loss_of(default), vocab),
                                                                           smmd_scale.SMMDLoss)
    ntl = parse_args(train_flags(**base, numeric_loss=["ntl-mse"], ntl_reweigh=False))
    assert "--no-ntl_reweigh" in train_flags(ntl_reweigh=False) and "--ntl_reweigh" in train_flags(ntl_reweigh=True)
    built = numeric_loss(loss_of(ntl), vocab)
    assert isinstance(built, smmd_scale.NTLoss) and built.kind == "mse" and not built.reweigh
    mixed = parse_args(train_flags(**base, numeric_loss=["smmd", "ntl-was:0.3"], ntl_squash_factor=9.0))
    built = numeric_loss(loss_of(mixed), vocab)
    assert [(term.name, weight) for term, weight in built.weighted_terms()] == [("smmd", 1.0), ("ntl_was", 0.3)]
    assert built.weighted_terms()[1][0].squash_factor == 9.0


@pytest.mark.parametrize("entries, message", [
    (["smd"], r"'smd' is not one of smmd, ntl-was, ntl-mse.*; did you mean smmd\?"),
    (["ntl-was:abc"], r"the weight after ':' must be a number"),
    (["smmd:-1"], r"must be a finite number >= 0"),
    (["smmd", "smmd:2"], r"names each loss once"),
])
def test_bad_numeric_loss_flags_are_named(tmp_path, capsys, entries, message):
    with pytest.raises(SystemExit):
        parse_args(train_flags(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["x"], max_steps=1,
                               output_dir=tmp_path, numeric_loss=entries))
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("options, message", [
    ({"warmup_steps": -1}, r"--warmup_steps -1 must be >= 0"),
    ({"min_lr_ratio": 1.5}, r"--min_lr_ratio 1.5 must be in \[0, 1\]"),
    ({"min_lr_ratio": -0.1}, r"--min_lr_ratio -0.1 must be in \[0, 1\]"),
])
def test_bad_schedule_flags_are_named(tmp_path, capsys, options, message):
    with pytest.raises(SystemExit):
        parse_args(train_flags(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["x"], max_steps=1,
                               output_dir=tmp_path, **options))
    assert re.search(message, capsys.readouterr().err)


def test_a_negative_numeric_max_value_is_named_by_its_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(train_flags(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["x"], max_steps=1,
                               output_dir=tmp_path, numeric_max_value=-5))
    assert "--numeric_max_value -5 must be a finite number >= 0" in capsys.readouterr().err


def test_a_preset_needs_a_tokenizer(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(train_flags(deepspeed_config=ZERO3, model="tiny", data=["x.jsonl"], max_steps=1,
                               output_dir=tmp_path))
    assert re.search(r"--model tiny is a preset .* pass --tokenizer", capsys.readouterr().err)


def test_a_typo_d_flag_is_one_line_naming_the_close_options_on_rank_zero_only(tmp_path, capsys, monkeypatch):
    arguments = ["--deepspeed_config", str(ZERO3), "--modle", "tiny", "--data", "x", "--max_steps", "1",
                 "--output_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exited:
        parse_args(arguments)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "unknown option --modle; did you mean --model" in error
    # A prefix is a typo too (argparse would otherwise take --max_step for --max_steps).
    with pytest.raises(SystemExit):
        parse_args([*arguments[:2], "--model", "tiny", "--tokenizer", str(tmp_path), "--data", "x", "--max_step", "1",
                    "--output_dir", str(tmp_path)])
    assert "unknown option --max_step; did you mean --max_steps" in capsys.readouterr().err
    # The other ranks of a launch parse the same line: they exit alike, without printing it again.
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exited:
        parse_args(arguments)
    assert exited.value.code == 2 and capsys.readouterr().err == ""


def test_framework_loss_says_that_it_does_not_evaluate(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "data.jsonl", 20)
    _, plan = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", framework_loss=True, eval_data=[corpus]),
                       until="plan")
    assert [warning for warning in plan.warnings if "--eval_data is not evaluated with --framework_loss" in warning]
    _, plan = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", eval_data=[corpus]), until="plan")
    assert not [warning for warning in plan.warnings if "--framework_loss" in warning]


@pytest.mark.parametrize("options, message", [
    (["--z_loss", "-1"], "--z_loss -1.0 must be a finite number >= 0"),
    (["--z_loss", "nan"], "--z_loss nan must be a finite number >= 0"),
    (["--label_smoothing", "1"], "--label_smoothing 1.0 must be in [0, 1)"),
    (["--label_smoothing", "0.1", "--framework_loss"], "not with --framework_loss"),
])
def test_bad_ce_options_are_named(tmp_path, capsys, options, message):
    with pytest.raises(SystemExit):
        parse_args([*argv(tmp_path, "d.jsonl", tmp_path / "run"), *options])
    assert message in capsys.readouterr().err


def test_ce_options_reach_the_installed_loss_and_hparams(tmp_path, tokenizer_dir):
    from smmd_train.components.loss_reporter import ce_options

    corpus = write_corpus(tmp_path / "data.jsonl", 20)
    args, plan = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", z_loss=1e-4, label_smoothing=0.1),
                          until="plan")
    assert ce_options(RunConfig.from_args(args).loss) == {"z_loss": 1e-4, "label_smoothing": 0.1}
    hparams = run_hparams(RunConfig.from_args(args), plan, "single")
    assert hparams["z_loss"] == 1e-4 and hparams["label_smoothing"] == 0.1
    args, _ = prepared(argv(tokenizer_dir, corpus, tmp_path / "run"), until="plan")
    assert ce_options(RunConfig.from_args(args).loss) == {}
    # --tp_exchange_capacity tokens: the exchange's rows passed to every call (no host read under TP on a GPU;
    # tests/loss/test_accelerator_plan.py counts that); not the objective, so not an HParams column
    args = parse_args([*argv(tokenizer_dir, corpus, tmp_path / "run"), "--tp_exchange_capacity", "tokens"])
    assert ce_options(RunConfig.from_args(args).loss) == {"numeric_capacity": "tokens"}
    assert "tp_exchange_capacity" not in run_hparams(RunConfig.from_args(args), plan, "single")
    # counted: no capacity for every call; each micro-batch's bound is set per call (test_loss_reporter)
    args = parse_args([*argv(tokenizer_dir, corpus, tmp_path / "run"), "--tp_exchange_capacity", "counted"])
    assert ce_options(RunConfig.from_args(args).loss) == {}
    with pytest.raises(SystemExit):
        parse_args([*argv(tokenizer_dir, corpus, tmp_path / "run"), "--tp_exchange_capacity", "all"])


def test_help_shows_each_option_s_default(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("--seq_len SEQ_LEN tokens per packed training sequence (default: 1024)",
                     "--lr LR peak learning rate (AdamW) (default: 0.0003)",
                     "--numeric_policy {integers,digits,floats}", "(default: integers)", "(default: smmd)"):
        assert expected in text, expected


@pytest.mark.parametrize("model, tokenizer, message", [
    ("8b", "tokenizer", r"--model 8b: no such folder, and not a preset; presets: tiny, 10m, 125m, .*, 70b\. .*download "
                        r"it first"),
    ("tinny", "tokenizer", r"--model tinny: no such folder, and not a preset \(did you mean the preset tiny\?\)"),
    ("meta-llama/Llama-3-8B", None, r"--model meta-llama/Llama-3-8B: no such folder, and not a preset; presets:"),
    ("empty_dir", None, r"--model .*empty_dir has no config.json: it is not a Hugging Face model folder"),
    ("tiny", "missing_tokenizer", r"--tokenizer .*missing_tokenizer: no such folder"),
])
def test_a_missing_model_or_tokenizer_folder_is_one_line_with_the_presets(tmp_path, tokenizer_dir, model, tokenizer,
                                                                           message):
    (tmp_path / "empty_dir").mkdir()
    model = str(tmp_path / model) if model == "empty_dir" else model
    tokenizer = {"tokenizer": tokenizer_dir, None: None}.get(tokenizer, tmp_path / str(tokenizer))
    arguments = argv(tokenizer, tmp_path / "data.jsonl", tmp_path / "run", model=model)
    with pytest.raises(RunRefused) as refused:
        prepared(arguments, until="plan")
    assert re.search(message, str(refused.value)) and "\n" not in str(refused.value), str(refused.value)


# ------------------------------------------------------------------------------------------------
# The DeepSpeed config: --tp, "auto" values, the CPU settings
# ------------------------------------------------------------------------------------------------


def resolve(config, world_size=2, accelerator="cpu", **overrides):
    values = dict(world_size=world_size, micro_batch_size=2, gradient_accumulation_steps=3, learning_rate=1e-3,
                  weight_decay=0.1, bf16_supported=True, hidden_size=64, accelerator=accelerator)
    values.update(overrides)
    return resolve_config(config, **values)


def test_tp_flag_sets_autotp_without_editing_json():
    raw = load_config(ZERO3)
    assert "tensor_parallel" not in raw
    for tp in (2, 4):
        config, topology = resolve(set_tensor_parallel(raw, tp), world_size=8)
        assert config["tensor_parallel"] == {"autotp_size": tp, "vocab_parallel_lm_head": True}
        assert (topology.tp_size, topology.dp_size) == (tp, 8 // tp)
        assert config["train_batch_size"] == 2 * 3 * (8 // tp)
    assert "tensor_parallel" not in set_tensor_parallel({"tensor_parallel": {"autotp_size": 2}}, 1)
    assert set_tensor_parallel({"tensor_parallel": {"autotp_size": 2}}, None) == {"tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ValueError, match=r"--tp 0 must be a positive int"):
        set_tensor_parallel(raw, 0)


def test_one_config_serves_gpu_and_cpu_and_the_differences_are_the_cpu_settings():
    raw = load_config(ZERO3)
    on_gpu, _ = resolve(raw, accelerator="cuda")
    on_cpu, _ = resolve(raw, accelerator="cpu")
    assert on_gpu["bf16"]["enabled"] is True and on_cpu["bf16"]["enabled"] is False
    changed = {(path, key) for path, key, _ in CPU_SETTINGS}
    assert changed == {(("optimizer", "params"), "torch_adam"), (("zero_optimization", ), "overlap_comm")}
    for path, key, value in CPU_SETTINGS:
        gpu_section, cpu_section = on_gpu, on_cpu
        for name in path:
            gpu_section, cpu_section = gpu_section[name], cpu_section[name]
        assert cpu_section[key] == value and gpu_section.get(key) != value
    # Nothing else differs between the two.
    for path, key, _ in CPU_SETTINGS:
        for section in (on_gpu, on_cpu):
            for name in path:
                section = section[name]
            section.pop(key, None)
    on_gpu.pop("bf16"), on_cpu.pop("bf16")
    assert on_gpu == on_cpu
    assert '"auto"' not in json.dumps(on_cpu)


def test_offload_config_is_zero3_plus_offload():
    base, offload = load_config(ZERO3), load_config(REPO / "ds_configs" / "zero3_offload.json")
    for key in ("offload_param", "offload_optimizer"):
        assert offload["zero_optimization"].pop(key)["device"] == "cpu"
    assert offload == base


# ------------------------------------------------------------------------------------------------
# Bad configs and data: a clear error before training starts
# ------------------------------------------------------------------------------------------------


def _config(tmp_path, edit):
    config = load_config(ZERO3)
    edit(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _small_hf_model(directory, vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(directory)
    return directory


def _wordy_tokenizer(directory):
    """A tokenizer of a few words and no numbers."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "cat": 4}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(directory)
    return directory


def _non_utf8(path):
    lines = [json.dumps({"text": "fine line 1"}).encode(), json.dumps({"text": "fine line 2"}).encode(),
             b'{"text": "broken \xff\xfe bytes"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


BAD_SETUPS = {
    "autotp_size_does_not_divide_world": (lambda tmp, tok: {"tp": 2}, r"autotp_size=2 \(--tp\) must divide the world "
                                                                     r"size 1"),
    "zero_stage_2": (lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c["zero_optimization"].update(
        stage=2))}, r"zero_optimization.stage=2: train.py runs ZeRO stage 3"),
    "offload_on_the_cpu_accelerator": (
        lambda tmp, tok: {"deepspeed_config": REPO / "ds_configs" / "zero3_offload.json"},
        r"offloads to the CPU, but this run already trains on the CPU"),
    "batch_sizes_do_not_multiply_out": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c.update(train_batch_size=7))},
        r"train_batch_size=7 but train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 x data-parallel "
        r"size 1"),
    "invalid_json_config": (
        lambda tmp, tok: {"deepspeed_config": (tmp / "broken.json", (tmp / "broken.json").write_text("{"))[0]},
        r"is not valid JSON"),
    "missing_config": (lambda tmp, tok: {"deepspeed_config": tmp / "nowhere.json"}, r"nowhere.json: no such file"),
    "tokenizer_larger_than_model": (
        lambda tmp, tok: {"model": _small_hf_model(tmp / "small", 100), "tokenizer": tok},
        r"the tokenizer has \d+ tokens but the model's embedding has 100 rows"),
    "missing_text_field": (lambda tmp, tok: {"text_field": "body"}, r"'body'.*text"),
    "empty_dataset": (lambda tmp, tok: {"data": [(tmp / "empty.jsonl", (tmp / "empty.jsonl").write_text(""))[0]]},
                      r"empty"),
    "dataset_smaller_than_one_block": (
        lambda tmp, tok: {"data": [write_corpus(tmp / "tiny.jsonl", 1)]}, r"too small|fewer"),
    "non_utf8_line": (lambda tmp, tok: {"data": [_non_utf8(tmp / "bad.jsonl")]}, r"bad.jsonl.*line 3.*UTF-8"),
    "scheduler_section": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c.update(scheduler={"type": "WarmupLR"}))},
        r"has a \"scheduler\" section, but train.py schedules the learning rate itself"),
    "tp_above_the_kv_heads": (lambda tmp, tok: {"tp": 4, "world_size": 4},
                              r"--tp 4 is more than the model's num_key_value_heads=2: AutoTP splits attention by "
                              r"whole key/value heads .* use --tp 2 or less"),
    "sp_with_tp": (lambda tmp, tok: {"tp": 2, "sp": 2, "world_size": 4},
                   r"--sp 2 with --tp 2: DeepSpeed cannot combine Ulysses sequence parallelism with AutoTP"),
    "sp_does_not_divide_the_sequence": (lambda tmp, tok: {"sp": 2, "seq_len": 47, "world_size": 2},
                                        r"--seq_len 47 must be a multiple of --sp 2"),
    "sp_does_not_divide_the_world": (lambda tmp, tok: {"sp": 2, "world_size": 3},
                                     r"--sp 2 must divide the world size 3"),
    # Options of the numeric loss and vocabulary: the loss is built in the plan, before the model.
    # smmd_scale's refusals reach the user in the words of train.py's flags, not the library's keywords.
    "smmd_sigmas_negative": (lambda tmp, tok: {"smmd_sigmas": [-1.0]},
                             r"^--smmd_sigmas -1.0 must be a non-empty sequence of finite positive numbers$"),
    "ntl_squash_factor_below_one": (lambda tmp, tok: {"numeric_loss": ["ntl-was"], "ntl_squash_factor": 0.5},
                                    r"^--ntl_squash_factor 0.5 must be a finite number > 1 .*, or leave the flag out "
                                    r"for the raw distances$"),
    "number_level_ntl_on_integers": (lambda tmp, tok: {"numeric_loss": ["ntl-number"]},
                                     r"number-level NTL .* needs a vocabulary of the ten digits .*; build it with "
                                     r"--numeric_policy digits from a tokenizer that spells numbers digit by digit$"),
    "no_numeric_token": (lambda tmp, tok: {"tokenizer": _wordy_tokenizer(tmp / "words")},
                         r"^no numeric token found under --numeric_policy integers with --numeric_max_value 999 "
                         r"among \d+ tokens of \w+; try --numeric_policy digits or --numeric_policy floats, or a "
                         r"larger --numeric_max_value$"),
    # Flags that contradict a number in the DeepSpeed config, each named with the config's value.
    "lr_contradicts_the_config": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c["optimizer"]["params"].update(lr=1e-3)),
                          "lr": 3e-4},
        r"--lr 0.0003 but the DeepSpeed config says optimizer.params.lr=0.001"),
    "weight_decay_contradicts_the_config": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c["optimizer"]["params"].update(
            weight_decay=0.0)), "weight_decay": 0.1},
        r"--weight_decay 0.1 but the DeepSpeed config says optimizer.params.weight_decay=0.0"),
    "micro_batch_contradicts_the_config": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c.update(train_micro_batch_size_per_gpu=4))},
        r"--micro_batch_size 2 but the DeepSpeed config says train_micro_batch_size_per_gpu=4"),
    "accumulation_contradicts_the_config": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c.update(gradient_accumulation_steps=4)),
                          "gradient_accumulation_steps": 2},
        r"--gradient_accumulation_steps 2 but the DeepSpeed config says gradient_accumulation_steps=4"),
    "tp_contradicts_the_config": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c.update(tensor_parallel={
            "autotp_size": 2, "vocab_parallel_lm_head": True})), "tp": 1, "world_size": 2},
        r"--tp 1 but the DeepSpeed config says tensor_parallel.autotp_size=2"),
    "tensorboard_dir_contradicts_the_config": (
        lambda tmp, tok: {"deepspeed_config": _config(tmp, lambda c: c["tensorboard"].update(
            output_path=str(tmp / "tb"), job_name="a")), "tensorboard_dir": tmp / "elsewhere"},
        r"--tensorboard_dir .*elsewhere but the DeepSpeed config's tensorboard section says output_path="),
}


@pytest.mark.parametrize("setup", sorted(BAD_SETUPS))
def test_bad_configs_and_data_fail_before_training(tmp_path, tokenizer_dir, setup):
    make, pattern = BAD_SETUPS[setup]
    options = make(tmp_path, tokenizer_dir)
    world_size = options.pop("world_size", 1)
    arguments = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 200), tmp_path / "run", **options)
    with pytest.raises((ValueError, FileNotFoundError)) as failure:
        prepared(arguments, world_size=world_size)
    assert re.search(pattern, str(failure.value)), str(failure.value)
    assert isinstance(failure.value, RunRefused)  # train.py prints it as refusal lines, no traceback
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was trained


def test_a_refusal_is_one_line_per_problem(tmp_path, tokenizer_dir):
    def edit(config):
        config.update(train_micro_batch_size_per_gpu=4)
        config["optimizer"]["params"]["lr"] = 1e-3

    arguments = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 200), tmp_path / "run",
                     deepspeed_config=_config(tmp_path, edit), lr=3e-4)
    with pytest.raises(RunRefused) as failure:
        prepared(arguments, until="plan")
    lines = str(failure.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith("--micro_batch_size 2") and lines[1].startswith("--lr 0.0003")


def test_the_config_s_numbers_rule_when_no_flag_contradicts_them(tmp_path, tokenizer_dir):
    def edit(config):
        config.update(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2)
        config["optimizer"]["params"]["lr"] = 1e-3
        config["tensorboard"].update(output_path=str(tmp_path / "tb"), job_name="first")

    arguments = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 200), tmp_path / "run",
                     deepspeed_config=_config(tmp_path, edit), micro_batch_size=None, lr=1e-3)
    args, plan = prepared(arguments, until="plan")
    assert plan.ds_config["train_micro_batch_size_per_gpu"] == 3 and plan.ds_config["train_batch_size"] == 6
    assert plan.tensorboard_dir == str(tmp_path / "tb" / "first") and plan.warnings == []
    # HParams record what the run uses: the resolved config's numbers, not the flags' defaults.
    hparams = run_hparams(RunConfig.from_args(args), plan, "single")
    assert (hparams["micro_batch"], hparams["grad_accum"], hparams["lr"]) == (3, 2, 1e-3)
    assert args.micro_batch_size == 1  # the flag's default, which the config overrode without a word


def test_the_tensorboard_section_s_job_name_alone_names_the_run_under_the_output_dir(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "train.jsonl", 200)
    plain = prepared(argv(tokenizer_dir, corpus, tmp_path / "run"), until="plan")[1]
    assert plain.tensorboard_dir == str(tmp_path / "run" / "tensorboard")  # neither flag nor config: the default
    config = _config(tmp_path, lambda c: c["tensorboard"].update(job_name="ws1-smmd"))
    arguments = argv(tokenizer_dir, corpus, tmp_path / "run", deepspeed_config=config)
    assert prepared(arguments, until="plan")[1].tensorboard_dir == str(tmp_path / "run" / "ws1-smmd")
    agreeing = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 200), tmp_path / "run",
                    deepspeed_config=config, tensorboard_dir=tmp_path / "run" / "ws1-smmd")
    assert prepared(agreeing, until="plan")[1].tensorboard_dir == str(tmp_path / "run" / "ws1-smmd")


def test_the_plan_holds_the_numeric_vocabulary_and_loss(tmp_path, tokenizer_dir):
    import smmd_scale

    corpus = write_corpus(tmp_path / "train.jsonl", 200)
    _, plan = prepared(argv(tokenizer_dir, corpus, tmp_path / "run"), until="plan")
    assert isinstance(plan.numeric_loss, smmd_scale.SMMDLoss) and plan.loss.terms() == (("smmd", 1.0), )
    assert plan.numeric_loss.vocab is plan.numeric_vocab and len(plan.numeric_vocab.token_ids) > 0
    assert plan.numeric_vocab.vocab_size == plan.model_config.vocab_size
    _, ce_only = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", numeric_loss=["smmd:0"]), until="plan")
    assert [weight for _, weight in ce_only.numeric_loss.weighted_terms()] == [0.0]
    _, framework = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", framework_loss=True), until="plan")
    assert framework.numeric_loss is None


def test_shuffled_numeric_values_are_the_value_control_and_refused_where_they_would_change_nothing(tmp_path,
                                                                                                      tokenizer_dir):
    import torch

    corpus = write_corpus(tmp_path / "train.jsonl", 200)
    args, parsed = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", numeric_loss=["dist2:0.3"]), until="plan")
    control = argv(tokenizer_dir, corpus, tmp_path / "run", numeric_loss=["dist2:0.3"], numeric_values="shuffled",
                   numeric_values_seed=3)
    shuffled_args, shuffled = prepared(control, until="plan")
    # the same tokens, their values permuted by the seed, and the loss the run installs reads those
    vocab = shuffled.numeric_vocab
    assert vocab.token_id_list == parsed.numeric_vocab.token_id_list and len(vocab) > 900
    assert torch.equal(vocab.values, parsed.numeric_vocab.shuffled(3).values)
    assert not torch.equal(vocab.values, parsed.numeric_vocab.values)
    assert shuffled.numeric_loss.vocab is vocab and parsed.numeric_loss.vocab is parsed.numeric_vocab
    # the resume record and the HParams column tell the control from the run it controls
    record, parsed_record = (plan.loss.objective_record(plan.numeric_vocab) for plan in (shuffled, parsed))
    assert record["--numeric_values"] == "shuffled (seed 3)" and parsed_record["--numeric_values"] == "parsed"
    assert record["numeric vocabulary"] != parsed_record["numeric vocabulary"]
    assert run_hparams(RunConfig.from_args(shuffled_args), shuffled, "python")["numeric_values"] == "shuffled (seed 3)"
    assert run_hparams(RunConfig.from_args(args), parsed, "python")["numeric_values"] == "parsed"
    # where nothing trained reads a value, the control would silently be the run it controls: refused
    for options, names in ((dict(numeric_loss=["smmd:0"]), "--numeric_loss smmd:0 with a weight above 0"),
                           (dict(framework_loss=True), "with --framework_loss")):
        with pytest.raises(RunRefused, match=f"--numeric_values shuffled would change nothing.*{names}"):
            prepared(argv(tokenizer_dir, corpus, tmp_path / "run", numeric_values="shuffled", **options),
                     until="plan")


def test_the_value_control_of_a_digit_loss_that_reads_no_value_is_refused(tmp_path):
    from helpers.style_tokenizers import qwen_style

    qwen_style().save_pretrained(tmp_path / "tokenizer")
    corpus = write_corpus(tmp_path / "train.jsonl", 200)
    options = dict(numeric_policy="digits", numeric_values="shuffled")
    _, plan = prepared(argv(tmp_path / "tokenizer", corpus, tmp_path / "run", numeric_loss=["del", "dist2:0.3"],
                            **options), until="plan")
    assert sorted(plan.numeric_vocab.values.tolist()) == list(range(10)) and plan.numeric_loss.reads_values
    with pytest.raises(RunRefused, match=r"no loss of --numeric_loss del:1 with a weight above 0 reads the numeric "
                                         r"tokens' values \(DEL reads which digit a token is"):
        prepared(argv(tmp_path / "tokenizer", corpus, tmp_path / "run", numeric_loss=["del"], **options), until="plan")
    with pytest.raises(SystemExit):
        parse_args(argv(tmp_path / "tokenizer", corpus, tmp_path / "run", numeric_values_seed=-1))


def test_a_numeric_term_that_can_drown_ce_warns_with_its_size_and_the_study_s_setting(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "train.jsonl", 50)

    def warnings(**options):
        return prepared(argv(tokenizer_dir, corpus, tmp_path / "run", **options), until="plan")[1].warnings

    # The tokenizer's 0..999 values, a vocabulary of 1536 rows (1512 tokens padded): CE starts at ln 1536 = 7.3.
    assert warnings(numeric_loss=["ntl-mse:0.5"]) == [
        "--numeric_loss ntl-mse:0.5: ntl-mse grows with the numeric values (0..999 here): up to 1.01e+06 per "
        "position, 5.04e+05 at weight 0.5, against CE's ln(vocab_size) = 7.3 for a uniform prediction, so it can "
        "drown CE; the numeracy study (benchmarks/numeracy) used ntl-mse:0.0001 on the values 0..999, chosen on "
        "validation"]
    raw_was = warnings(numeric_loss=["smmd", "ntl-was:0.3"])
    assert len(raw_was) == 1 and raw_was[0].startswith(
        "--numeric_loss ntl-was:0.3: ntl-was grows with the numeric values (0..999 here): up to 1.01e+03 per position, "
        "303 at weight 0.3")
    assert raw_was[0].endswith("used ntl-was:0.3 with --ntl_squash_factor 9 (distances mapped onto [1, 9], so at most "
                               "9.09 per position)")
    # Bounded losses, a term too light to matter (1e-6 x 1.01e6 = 1 < 7.3), and CE alone: no warning.
    for options in ({}, {"numeric_loss": ["ntl-was:0.3"], "ntl_squash_factor": 9.0},
                    {"numeric_loss": ["ntl-mse:0.000001"]}, {"numeric_loss": ["ntl-mse:0"]}):
        assert warnings(**options) == [], options


@pytest.mark.parametrize("flag, value, replacement", [
    ("--smmd_weight", "0.5", "the weights in --numeric_loss"),
    ("--smmd_policy", "digits", "--numeric_policy"),
    ("--smmd_max_value", "9", "--numeric_max_value"),
])
def test_the_spellings_removed_in_0_3_are_refused_by_name(tmp_path, capsys, flag, value, replacement):
    """Kept through 0.2.0 with a warning, refused since 0.3.0 in one line naming what replaced them."""
    arguments = ["--deepspeed_config", str(ZERO3), "--model", "tiny", "--tokenizer", str(tmp_path), "--data", "x",
                 "--max_steps", "1", "--output_dir", str(tmp_path), flag, value]
    with pytest.raises(SystemExit) as exited:
        parse_args(arguments)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{flag} was removed in 0.3.0; use {replacement}" in error


@pytest.mark.parametrize("tp", [2, 3])
def test_uneven_tensor_parallelism_is_planned(tmp_path, tokenizer_dir, tp):
    """AutoTP splits what does not divide: a SmolLM2-shaped checkpoint (9 heads over 3 KV heads, tied)
    with GPT-2's 50,257-token vocabulary plans at TP 2 and 3; TP 4 would leave a rank without a head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "smollm-shaped"
    LlamaForCausalLM(LlamaConfig(vocab_size=50257, hidden_size=72, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
                     ).save_pretrained(model_dir)
    corpus = write_corpus(tmp_path / "train.jsonl", 50)
    _, plan = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", model=model_dir, tp=tp), world_size=tp,
                       until="plan")
    assert plan.topology.tp_size == tp and plan.model_config.vocab_size == plan.numeric_vocab.vocab_size == 50257
    with pytest.raises(RunRefused, match=r"--tp 4 is more than the model's num_key_value_heads=3: .* rank 3 would "
                                         r"hold none; use --tp 3 or less \(it need not divide 3\)"):
        prepared(argv(tokenizer_dir, corpus, tmp_path / "run", model=model_dir, tp=4), world_size=4, until="plan")


def test_a_tp_degree_with_two_problems_names_both(tmp_path, tokenizer_dir):
    arguments = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 50), tmp_path / "run", tp=3)
    with pytest.raises(RunRefused) as refused:
        prepared(arguments, world_size=2, until="plan")
    lines = str(refused.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("--tp 3 is more than the model's num_key_value_heads=2")
    assert lines[1].startswith("tensor_parallel.autotp_size=3 (--tp) must divide the world size 2")


def test_a_sequence_longer_than_the_model_s_positions_warns(tmp_path, tokenizer_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "short-context"
    LlamaForCausalLM(LlamaConfig(vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
                     ).save_pretrained(model_dir)
    corpus = write_corpus(tmp_path / "train.jsonl", 50)
    _, plan = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", model=model_dir), until="plan")
    assert [warning for warning in plan.warnings if warning.startswith("--seq_len")] == [
        f"--seq_len {SEQ_LEN} is longer than the model's max_position_embeddings=32: it was not trained on positions "
        "past 32 (rotary positions extrapolate poorly, learned ones fail); use --seq_len 32 or less, or a model (or "
        "rope_scaling in its config.json) with a longer context"]
    _, fits = prepared(argv(tokenizer_dir, corpus, tmp_path / "run", model=model_dir, seq_len=32), until="plan")
    assert not [warning for warning in fits.warnings if warning.startswith("--seq_len")]


def test_a_good_setup_plans_the_run(tmp_path, tokenizer_dir):
    arguments = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 200), tmp_path / "run", tp=2)
    args, plan = prepared(arguments, world_size=4)
    assert (plan.topology.tp_size, plan.topology.dp_size) == (2, 2) and plan.pretrained_dir is None
    # The preset's vocabulary is the tokenizer's padded to a multiple of 64, the same at every TP degree.
    assert plan.model_config.vocab_size == -(-len(plan.tokenizer) // 64) * 64
    assert plan.ds_config["train_batch_size"] == 2 * 2 and plan.warnings == []
    assert plan.ds_config["optimizer"]["params"]["lr"] == args.lr
    # train.py writes TensorBoard and schedules the rate itself: DeepSpeed's writer and scheduler stay off.
    assert plan.tensorboard is True and "tensorboard" not in plan.ds_config and "scheduler" not in plan.ds_config
    assert plan.warmup_steps == 1  # the default 100, capped at 10% of --max_steps 2 (rounded up), silently
    # What the run records for TensorBoard's HParams view: the experiment's columns, from the plan.
    hparams = run_hparams(RunConfig.from_args(args), plan, "single")
    assert tuple(hparams) == RUN_HPARAMS and hparams["numeric_loss"] == "1 smmd"
    assert (hparams["world_size"], hparams["tp_size"], hparams["global_batch"], hparams["warmup_steps"]) == (4, 2, 4, 1)


def test_an_explicit_warmup_longer_than_a_tenth_of_the_run_is_capped_with_a_warning(tmp_path, tokenizer_dir):
    arguments = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 200), tmp_path / "run", max_steps=50,
                     warmup_steps=20)
    _, plan = prepared(arguments)
    assert plan.warmup_steps == 5
    assert plan.warnings == ["--warmup_steps 20 -> 5: warmup is at least one step and at most 10% of --max_steps 50"]


# ------------------------------------------------------------------------------------------------
# The learning-rate schedule train.py hands to deepspeed.initialize
# ------------------------------------------------------------------------------------------------


def test_schedule_trains_from_the_first_step_warms_up_linearly_then_decays_to_the_floor():
    import torch

    from smmd_train.components.schedule import lr_factor, warmup_cosine

    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([parameter], lr=0.5)
    scheduler = warmup_cosine(4, 20, 0.1)(optimizer)
    used = []
    for step in range(1, 21):  # the rate each optimizer step uses, read before it as train.py does
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        if step == 10:  # a resumed run continues the schedule from the checkpointed state
            state = scheduler.state_dict()
            scheduler = warmup_cosine(4, 20, 0.1)(optimizer)
            scheduler.load_state_dict(state)
            optimizer.param_groups[0]["lr"] = scheduler.get_last_lr()[0]
    assert used[:4] == pytest.approx([0.125, 0.25, 0.375, 0.5])
    assert lr_factor(12, 4, 20, 0.1) == pytest.approx(0.55) and used[11] == pytest.approx(0.5 * 0.55)
    assert used[-1] == pytest.approx(0.05)
    assert all(earlier > later for earlier, later in zip(used[3:], used[4:]))


def test_bf16_auto_means_native_bf16(monkeypatch):
    """V100 and T4 report bf16 as supported but emulate it: "auto" turns bf16 on from Ampere (8.0) on."""
    import torch

    from smmd_train.run import native_bf16

    class Accelerator:
        def __init__(self, name, reports):
            self.name, self.reports = name, reports

        def device_name(self):
            return self.name

        def is_bf16_supported(self):
            return self.reports

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, native in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert native_bf16(Accelerator("cuda", True)) is native, capability
    assert native_bf16(Accelerator("cpu", True)) and not native_bf16(Accelerator("xpu", False))


def test_tensor_parallelism_across_nodes_is_refused_before_the_model(tmp_path, tokenizer_dir):
    arguments = argv(tokenizer_dir, write_corpus(tmp_path / "train.jsonl", 200), tmp_path / "run", tp=2)
    config = RunConfig.from_args(parse_args(arguments))
    with pytest.raises(RunRefused, match=r"--tp 2 spans nodes: this node runs 1 ranks.*use --tp 1 or less"):
        prepare_run(config, Launch(0, 4, 0, 1, "slurm"), until="plan")
    assert prepare_run(config, Launch(0, 4, 0, 2, "slurm"), until="plan").plan.topology.tp_size == 2


def test_every_loss_that_can_drown_ce_has_the_study_s_setting_to_cite():
    """The warning above cites the numeracy study's setting of each loss whose size follows the values
    (NumericLoss.value_scale not None at the defaults): each has one, kept in the trainer."""
    from smmd_scale import NumericVocab
    from smmd_scale.registry import NUMERIC_LOSSES, build_numeric_loss, options_from
    from smmd_train.components.loss_reporter import STUDY_SETTINGS

    vocab = NumericVocab(list(range(20, 30)), [float(value) for value in range(10)], 40)
    defaults = options_from(lambda option: option.default)
    growing = {name for name in NUMERIC_LOSSES
               if build_numeric_loss(vocab, [(name, 1.0)], defaults, dot_token_ids=[13]).value_scale is not None}
    assert growing == set(STUDY_SETTINGS) == {"ntl-was", "ntl-mse"}
