"""CI's last lines: the run's wall and CPU time, also in units of the host probe
(tests/helpers/host_probe.py: CPU seconds of a fresh import of torch, DeepSpeed and transformers' Llama),
so that runs on different hosts compare. Called by .ci/run with bash's ``times`` output in a file."""

import argparse
import json
import re
import time


def seconds(text: str) -> float:
    """``1m2.500s`` (bash's ``times``) in seconds."""
    minutes, rest = re.fullmatch(r"(\d+)m([\d.]+)s", text).groups()
    return 60 * int(minutes) + float(rest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--began", type=int, required=True, help="the run's start (epoch seconds)")
    parser.add_argument("--tests_began", type=int, required=True)
    parser.add_argument("--tests_ended", type=int, required=True)
    parser.add_argument("--probe_start", required=True, help="the probe's JSON before the tests")
    parser.add_argument("--probe_end", required=True, help="the probe's JSON after them")
    parser.add_argument("--times", required=True, help="a file with bash's `times` output")
    options = parser.parse_args()
    lines = open(options.times).read().split("\n")
    children = lines[1].split()  # the second line: the children's user and system time
    cpu = seconds(children[0]) + seconds(children[1])
    wall, tests_wall = time.time() - options.began, options.tests_ended - options.tests_began
    start, end = json.loads(options.probe_start), json.loads(options.probe_end)
    unit = start["cpu_seconds"]
    print(f"host probe: {start['cpu_seconds']} CPU-s ({start['wall_seconds']} s wall) at the start, "
          f"{end['cpu_seconds']} CPU-s ({end['wall_seconds']} s wall) at the end")
    print(f"CI time: {wall:.0f} s wall ({tests_wall} s of tests), {cpu:.0f} CPU-s; in probe units "
          f"({unit} CPU-s): {wall / unit:.0f} wall, {tests_wall / unit:.0f} tests, {cpu / unit:.0f} CPU")


if __name__ == "__main__":
    main()
