"""Scaling sweeps (``bash launch/scaling.sh``): planning and validation in process (bad sweeps fail
before any launch, configurations that cannot run are refused with the reason), the table's
arithmetic, the launcher command for a multi-node world size; and one real sweep (world sizes 1
and 2 under the deepspeed launcher) read back through a served TensorBoard's HTTP API, as the
browser reads it."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest
from helpers.corpora import write_corpus
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment, run

from smmd_train.distributed.launcher import free_port, launch_command
from smmd_train.monitor.metrics_file import read_metrics
from smmd_train.tools.scaling import (
    Config,
    format_table,
    main,
    parse_args,
    plan_sweep,
    read_hostfile,
    scaling_table,
    write_scaling_view,
)

ZERO3 = REPO / "ds_configs" / "zero3.json"


def sweep(**values):
    defaults = dict(world_sizes=[1, 2, 4], tp=[1], sp=[1], weak=False, global_batch=None, output_dir="out",
                    hostfile=None, slots=None, rerun=False, timeout_minutes=1.0)
    return Namespace(**{**defaults, **values})


def train_options(tokenizer_dir, corpus, max_steps=3, **extra):
    options = ["--deepspeed_config", str(ZERO3), "--model", "tiny", "--tokenizer", str(tokenizer_dir), "--data",
               str(corpus), "--seq_len", "48"] + (["--max_steps", str(max_steps)] if max_steps else [])
    for name, value in extra.items():
        options += [f"--{name}", str(value)]
    return options


def test_the_command_line_splits_sweep_and_train_py_options():
    sweep_args, train_argv = parse_args(["--world_sizes", "1,2,4", "--tp", "1,2", "--weak", "--max_steps", "5",
                                         "--output_dir", "out", "--model", "tiny", "--fused_linear"])
    assert (sweep_args.world_sizes, sweep_args.tp, sweep_args.weak, sweep_args.output_dir) == ([1, 2, 4], [1, 2],
                                                                                                True, "out")
    assert train_argv == ["--max_steps", "5", "--model", "tiny", "--fused_linear"]
    for bad in ("1,x", "0,2", ""):
        with pytest.raises(SystemExit):
            parse_args(["--world_sizes", bad, "--output_dir", "out"])


def test_placement_on_one_machine_and_across_a_hostfile(tmp_path):
    configs, refused, warnings = plan_sweep(sweep(world_sizes=[1, 2, 4], tp=[1, 2], slots=4), "cuda", "zero3-smmd")
    assert [(c.name, c.nodes, c.per_node) for c in configs] == [
        ("ws1-tp1-zero3-smmd", 1, 1), ("ws1-tp2-zero3-smmd", 1, 1), ("ws2-tp1-zero3-smmd", 1, 2),
        ("ws2-tp2-zero3-smmd", 1, 2), ("ws4-tp1-zero3-smmd", 1, 4), ("ws4-tp2-zero3-smmd", 1, 4)]
    assert refused == {"ws1-tp2-zero3-smmd": "TP 2 is larger than the world size 1"} and warnings == []
    _, refused, _ = plan_sweep(sweep(world_sizes=[6], tp=[4], slots=8), "cuda")
    assert refused == {"ws6-tp4": "TP 4 does not divide the world size 6"}

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=4\nnode-b slots=4  # same size\n")
    assert read_hostfile(str(hostfile)) == [("node-a", 4), ("node-b", 4)]
    configs, _, _ = plan_sweep(sweep(world_sizes=[2, 4, 8], hostfile=str(hostfile)), "cuda")
    assert [(c.world_size, c.nodes, c.per_node) for c in configs] == [(2, 1, 2), (4, 1, 4), (8, 2, 4)]
    command = launch_command("train.py", "--x", processes=4, nodes=2, hostfile=str(hostfile), master_port=1234)
    assert command[1:] == ["--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "4", "--master_port",
                           "1234", "train.py", "--x"]
    # More ranks than this machine's cores: allowed on CPU, with a warning about what it measures.
    _, _, warnings = plan_sweep(sweep(world_sizes=[1, 64], slots=2), "cpu")
    assert warnings == ["world size 64 > 2 CPU cores: its ranks share cores, so its tokens/s per rank measure "
                        "contention as much as scaling"]


def test_sequence_parallel_layouts_are_planned_and_named():
    configs, refused, _ = plan_sweep(sweep(world_sizes=[1, 2, 4], tp=[1, 2], sp=[1, 2], slots=4), "cuda")
    names = [config.name for config in configs]
    assert names[:4] == ["ws1-tp1", "ws1-tp1-sp2", "ws1-tp2", "ws1-tp2-sp2"] and len(names) == 12
    assert refused == {"ws1-tp1-sp2": "TP 1 x SP 2 is larger than the world size 1",
                       "ws1-tp2": "TP 2 is larger than the world size 1",
                       "ws1-tp2-sp2": "TP 2 x SP 2 is larger than the world size 1",
                       "ws2-tp2-sp2": "TP 2 x SP 2 is larger than the world size 2"}
    layout = {config.name: (config.layout, config.dp) for config in configs}
    assert layout["ws4-tp1-sp2"] == ("tp1-sp2", 2) and layout["ws4-tp2"] == ("tp2", 2)
    assert layout["ws4-tp2-sp2"] == ("tp2-sp2", 1)  # planned here; train.py's plan refuses TP with SP


@pytest.mark.parametrize("case, pattern", [
    (dict(world_sizes=[16], slots=8), r"world size 16 does not fit: 1 node\(s\) of 8 slots \(this machine\)"),
    (dict(world_sizes=[12], hostfile="HOSTFILE"), r"world size 12 does not fit: 2 node\(s\) of 8 slots .*whole nodes"),
    (dict(world_sizes=[24], hostfile="HOSTFILE"), r"world size 24 does not fit: 2 node\(s\)"),
])
def test_world_sizes_the_machine_cannot_place_are_refused(tmp_path, case, pattern):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=8\nb slots=8\n")
    if case.get("hostfile"):
        case = {**case, "hostfile": str(hostfile)}
    with pytest.raises(ValueError, match=pattern):
        plan_sweep(sweep(**case), "cuda")


def test_a_bad_hostfile_line_is_named(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=8\nb slots=eight\n")
    with pytest.raises(ValueError, match=r"hostfile:2: expected '<host> slots=<N>', got 'b slots=eight'"):
        read_hostfile(str(hostfile))


def test_table_speedup_and_efficiency_against_the_smallest_world_size():
    configs = [Config(1, 1, 1, 1), Config(1, 2, 1, 1), Config(2, 1, 1, 2), Config(2, 2, 1, 2), Config(4, 1, 1, 4),
               Config(4, 2, 1, 4)]

    def finished(tokens_per_second, world_size):
        return {"status": "ok", "summary": {"summary/tokens_per_second": tokens_per_second,
                                            "summary/tokens_per_second_per_rank": tokens_per_second / world_size,
                                            "summary/peak_memory_gib": 1.0}}

    results = {"ws1-tp1": finished(100.0, 1), "ws2-tp1": finished(180.0, 2), "ws2-tp2": finished(120.0, 2),
               "ws4-tp1": {"status": "failed (exit 1)", "summary": None}, "ws4-tp2": finished(200.0, 4),
               "ws1-tp2": {"status": "refused: TP 2 is larger than the world size 1"}}
    rows = {row["name"]: row for row in scaling_table(configs, results)}
    assert rows["ws2-tp1"]["speedup"] == pytest.approx(1.8) and rows["ws2-tp1"]["efficiency"] == pytest.approx(0.9)
    assert rows["ws2-tp2"]["efficiency"] == pytest.approx(0.6)  # TP is measured against the same baseline
    assert rows["ws4-tp2"]["ideal_tokens_per_second"] == pytest.approx(400.0)
    assert rows["ws4-tp2"]["efficiency"] == pytest.approx(0.5) and rows["ws1-tp1"]["efficiency"] == 1.0
    assert "efficiency" not in rows["ws4-tp1"] and rows["ws4-tp1"]["status"] == "failed (exit 1)"
    table = format_table(list(rows.values()))
    assert "| ws2-tp1 | 2 | 1 x 1 x 2 | 1 | 180 | 90 | 1.80 | 0.90 | 1.00 | ok |" in table
    assert "| ws4-tp1 | 4 | 1 x 1 x 4 | 1 | - | - | - | - | - | failed (exit 1) |" in table
    assert ("| ws1-tp2 | 1 | 2 x 1 x - | 1 | - | - | - | - | - | refused: TP 2 is larger than the world size 1 |"
            in table)


def test_the_scaling_view_has_one_point_per_world_size(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    configs = [Config(1, 1, 1, 1), Config(2, 1, 1, 2), Config(4, 1, 1, 4)]
    results = {config.name: {"status": "ok", "summary": {
        "summary/tokens_per_second": 100.0 * config.world_size ** 0.5,
        "summary/tokens_per_second_per_rank": 100.0 / config.world_size ** 0.5}} for config in configs}
    (run_dir, ) = write_scaling_view(tmp_path, scaling_table(configs, results), sweep())
    assert run_dir.name == "scaling-tp1"
    view = EventAccumulator(str(run_dir))
    view.Reload()
    efficiency = view.Scalars("scaling/efficiency")
    assert [event.step for event in efficiency] == [1, 2, 4]
    assert [event.value for event in efficiency] == pytest.approx([1.0, 2 ** -0.5, 0.5])
    assert [event.value for event in view.Scalars("scaling/ideal_tokens_per_second")] == pytest.approx([100, 200, 400])


def test_bad_sweeps_fail_before_anything_is_launched(tmp_path, tokenizer_dir, capsys):
    corpus = write_corpus(tmp_path / "train.jsonl", 100)
    out = tmp_path / "sweep"
    bad = {
        # train.py's own checks, per configuration: TP 4 would leave 2 of the tiny model's 4 ranks without
        # a KV head (TP 2 of the same sweep could run; an uneven split alone is no refusal).
        "heads": (["--world_sizes", "4", "--tp", "4", "--slots", "4"], [],
                  r"no configuration can run: ws4-tp4-zero3-smmd: --tp 4 is more than the model's "
                  r"num_key_value_heads=2: .* use --tp 2 or less"),
        "tp_above_world": (["--world_sizes", "1,2", "--tp", "4"], [],
                           r"ws1-tp4-zero3-smmd: TP 4 is larger than the world size 1; ws2-tp4-zero3-smmd: TP 4"),
        "machine": (["--world_sizes", "1,8", "--hostfile", str(tmp_path / "hostfile")], [],
                    r"world size 8 does not fit: 1 node\(s\) of 2 slots"),
        "owned": (["--world_sizes", "1"], ["--tensorboard_dir", "x"], r"the sweep sets --tensorboard_dir for each run"),
        "accumulation": (["--world_sizes", "1"], ["--gradient_accumulation_steps", "2"],
                         r"strong scaling sets --gradient_accumulation_steps per run"),
        "global_batch": (["--world_sizes", "1,2", "--global_batch", "3"], [],
                         r"--global_batch 3 is not a multiple of data-parallel size 2 x micro batch 1 "
                         r"\(ws2-tp1-zero3-smmd\)"),
        "weak_with_global_batch": (["--world_sizes", "1", "--weak", "--global_batch", "4"], [],
                                   r"--global_batch is for strong scaling"),
        "scheduler": (["--world_sizes", "1"], ["--deepspeed_config", str(tmp_path / "scheduled.json")],
                      r"ws1-tp1-zero3-smmd: the DeepSpeed config has a \"scheduler\" section"),
    }
    (tmp_path / "hostfile").write_text("only-node slots=2\n")
    (tmp_path / "scheduled.json").write_text(json.dumps({**json.loads(ZERO3.read_text()), "scheduler": {}}))
    for name, (sweep_flags, extra, pattern) in bad.items():
        code = main([*sweep_flags, "--output_dir", str(out), *train_options(tokenizer_dir, corpus), *extra])
        error = capsys.readouterr().err
        assert code == 2 and re.search(pattern, error), (name, error)
        assert not out.exists(), name  # nothing launched, nothing written
    # A different sweep in a directory that holds one is refused too.
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"world_sizes": [8]}))
    assert main(["--world_sizes", "1", "--output_dir", str(out), *train_options(tokenizer_dir, corpus)]) == 2
    assert "holds a sweep with other settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # train.py's parser names an option it does not know
        main(["--world_sizes", "1", "--output_dir", str(out), *train_options(tokenizer_dir, corpus), "--no_such_flag"])
    assert "unknown option --no_such_flag" in capsys.readouterr().err


@pytest.mark.slow
def test_a_sweep_of_world_sizes_1_and_2_in_a_served_tensorboard(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "train.jsonl", 300)
    out = tmp_path / "sweep"
    command = ["bash", REPO / "launch" / "scaling.sh", "--world_sizes", "1,2", "--max_steps", "3", "--output_dir", out,
               *train_options(tokenizer_dir, corpus, max_steps=None, micro_batch_size=2, lr=3e-3)]
    completed = run(command, timeout=600, env=environment(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    assert "| ws2-tp1-zero3-smmd | 2 | 1 x 1 x 2 | 1 |" in completed.stdout
    names = ("ws1-tp1-zero3-smmd", "ws2-tp1-zero3-smmd")
    table = json.loads((out / "scaling.json").read_text())
    rows = {row["name"]: row for row in table["rows"]}
    assert table["settings"]["global_batch"] == 4  # the largest data-parallel size x micro batch 2
    assert [rows[name]["status"] for name in names] == ["ok", "ok"]
    # Strong scaling: both runs trained 4 sequences per step (2 x 2 accumulated on one rank, 2 x 1 x 2 ranks).
    configs = {name: json.loads((out / "runs" / name / "run_config.json").read_text()) for name in rows}
    assert [configs[name]["deepspeed_config"]["train_batch_size"] for name in names] == [4, 4]
    assert [configs[name]["deepspeed_config"]["gradient_accumulation_steps"] for name in names] == [2, 1]
    # The learning rate is non-zero from the first step, and the runs trained.
    for name in rows:
        records = read_metrics(out / "runs" / name)
        steps = [record for record in records if "loss/total" in record]
        assert steps[0]["train/lr"] > 0 and steps[-1]["loss/ce"] < steps[0]["loss/ce"]

    # A re-run of the same sweep launches nothing: both runs have finished.
    again = run(command, timeout=300, env=environment(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    assert again.stdout.count("ok (earlier)") == 2 and "deepspeed" not in again.stdout.split("|")[0]

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out / "tensorboard"),
                               "--host", "127.0.0.1", "--port", str(port)], env=environment(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def get(path, body=None):
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                             headers={"Content-Type": "application/json"} if body else {})
            with urllib.request.urlopen(request, timeout=hang_guard(30)) as response:
                return json.loads(response.read())

        deadline = time.monotonic() + hang_guard(90)
        while True:
            try:
                runs = get("/data/runs")
                if {*names, "scaling-tp1"} <= set(runs):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "TensorBoard did not serve the sweep"
            time.sleep(1)
        # The scaling view: one point per world size, x = world size.
        points = get("/data/plugin/scalars/scalars?run=scaling-tp1&tag=scaling/efficiency")
        assert [step for _, step, _ in points] == [1, 2] and points[0][2] == 1.0
        # The event file keeps a scalar as float32 (add_scalar's simple_value): 6e-8 relative.
        assert points[1][2] == pytest.approx(rows[names[1]]["efficiency"], rel=1e-6)
        throughput = get(f"/data/plugin/scalars/scalars?run={names[1]}&tag=perf/tokens_per_second")
        assert [step for _, step, _ in throughput] == [2, 3]  # the warm-up step is not charted
        # The Custom Scalars layout and the HParams experiment, as the dashboard requests them.
        layout = get("/data/plugin/custom_scalars/layout")
        titles = {chart["title"] for category in layout["category"] for chart in category["chart"]}
        assert "efficiency: per-rank tokens/s / the baseline's (1 = linear)" in titles and "CE (mean per target " \
            "token)" in titles
        experiment = get("/data/plugin/hparams/experiment", json.dumps({"experimentName": ""}).encode())
        assert {info["name"] for info in experiment["hparamInfos"]} >= {"world_size", "tp_size", "fused_linear"}
        groups = get("/data/plugin/hparams/session_groups", json.dumps({
            "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"], "colParams": [],
            "startIndex": 0, "sliceSize": 10}).encode())
        sessions = {session["name"]: group for group in groups["sessionGroups"] for session in group["sessions"]}
        assert set(names) <= set(sessions) and len(groups["sessionGroups"]) == len(sessions)  # a row per run
        assert sessions[names[1]]["hparams"]["world_size"] == "2"
    finally:
        server.terminate()
        server.wait(timeout=hang_guard(30))


@pytest.mark.slow
def test_a_sweep_over_sequence_parallel_degrees(tmp_path, tokenizer_dir):
    """launch/scaling.sh --sp 1,2 on 2 ranks: SP 1 (2 data-parallel replicas) and SP 2 (one sequence
    split over both ranks) train the same global batch, and the run records its SP degree."""
    corpus = write_corpus(tmp_path / "train.jsonl", 300)
    out = tmp_path / "sweep"
    command = ["bash", REPO / "launch" / "scaling.sh", "--world_sizes", "2", "--sp", "1,2", "--max_steps", "2",
               "--output_dir", out, *train_options(tokenizer_dir, corpus, max_steps=None, micro_batch_size=2)]
    completed = run(command, timeout=600, env=environment(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    assert "| ws2-tp1-sp2-zero3-smmd | 2 | 1 x 2 x 1 | 1 |" in completed.stdout
    rows = {row["name"]: row for row in json.loads((out / "scaling.json").read_text())["rows"]}
    assert [rows[name]["status"] for name in ("ws2-tp1-zero3-smmd", "ws2-tp1-sp2-zero3-smmd")] == ["ok", "ok"]
    configs = [json.loads((out / "runs" / name / "run_config.json").read_text())
               for name in ("ws2-tp1-zero3-smmd", "ws2-tp1-sp2-zero3-smmd")]
    assert [(config["sp_size"], config["dp_size"], config["deepspeed_config"]["train_batch_size"])
            for config in configs] == [(1, 2, 4), (2, 1, 4)]
    assert (out / "tensorboard" / "scaling-tp1-sp2").is_dir()
