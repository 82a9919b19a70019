"""Rules of the repository itself: the README's commands are the ones CI runs, code is shared by
importing installed packages (no sys.path edits, no importing scripts), the documents that
docstrings cite exist in the repository, and neither code nor committed results hold a path of the
machine they were written on."""

import re

from helpers.launching import REPO

# This file names the patterns it looks for, so it is left out.
SOURCES = sorted(path for folder in ("plugin", "launch", "benchmarks", "tests")
                 for path in (REPO / folder).rglob("*.py") if path.name != "test_repository.py")
RESULTS = sorted(path for folder in ("benchmarks/results", "benchmarks/numeracy/results")
                 for path in (REPO / folder).rglob("*") if path.suffix in (".json", ".md"))
# An absolute path under a machine's own folders: a work, scratch or temporary directory, or a home.
MACHINE_PATH = re.compile(r"(?<![\w.$])/(?:work|tmp|scratch|root|home|Users)/")


def test_readme_commands_are_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert len(readme.splitlines()) <= 150
    assert "`bash launch/demo.sh`" in readme and "`bash .ci/run`" in readme
    test_command = re.search(r"^    (python -m pytest -q tests.*)$", readme, re.MULTILINE).group(1)
    assert test_command in ci.splitlines()
    assert "ruff check ." in ci.splitlines() and "ruff check ." in readme
    fast_loop = re.search(r'^    (python -m pytest -q -m "not slow"( -n \d+ --dist loadfile)?)$', readme, re.MULTILINE)
    assert fast_loop is not None


def test_code_is_shared_through_packages_not_paths():
    for path in SOURCES:
        text = path.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text, path
        assert "spec_from_file_location" not in text and "runpy" not in text, path


def test_cited_documents_exist_and_nothing_cites_what_is_not_in_the_repository():
    texts = {path: path.read_text() for path in [*SOURCES, REPO / "README.md", *(REPO / "docs").glob("*.md")]}
    cited = set()
    for path, text in texts.items():
        assert "DESIGN.md" not in text, path
        assert not re.search(r"\bissue \d+", text), path
        cited |= set(re.findall(r"\bdocs/[a-z_]+\.md", text))
    assert cited, "nothing cites docs/"
    for document in cited:
        assert (REPO / document).is_file(), document


def test_neither_code_defaults_nor_committed_results_hold_a_machine_path():
    assert len(RESULTS) >= 20, "the results folders moved: point RESULTS at them"
    for path in RESULTS:
        assert not MACHINE_PATH.search(path.read_text()), path
    for path in SOURCES:
        if path.parts[len(REPO.parts)] != "tests":  # tests may name a stand-in path for a launcher to pick up
            assert not re.search(r"[\"']" + MACHINE_PATH.pattern, path.read_text()), path
    planted = '{"command": ["--data", "/tmp/run/train.jsonl"], "model": "/work/models/x"}'
    assert len(MACHINE_PATH.findall(planted)) == 2 and not MACHINE_PATH.search("ds_configs/zero3.json $HOME/x")
