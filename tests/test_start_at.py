"""`pdm run start-at --week W --day D`: the course started at a later day, run on a copy of the
repository's scripts, packages and day files (the real src/tiny_llm is never touched)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "# a student's own line\n"


@pytest.fixture
def repo(tmp_path):
    """scripts/, src/ and the day files' names (start-at reads which days exist from them)."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    for day in ROOT.glob("tests/test_week_*_day_*.py"):
        (tmp_path / "tests" / day.name).write_text("")
    return tmp_path


def start_at(repo: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(repo / "scripts" / "dev-tools.py"), "start-at", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=repo)


def student(repo: Path, name: str) -> str:
    return (repo / "src" / "tiny_llm" / name).read_text()


def test_earlier_days_are_filled_and_later_ones_stay_stubs(repo):
    done = start_at(repo, "--week", "3", "--day", "2")
    assert done.returncode == 0, done.stderr
    assert "pdm run test --week 3 --day 2" in done.stdout
    kv = student(repo, "kv_cache.py")  # Week 2 Day 1's tasks: filled
    assert 'NotImplementedError("Week 2 Day 1' not in kv, (
        "a task of a day before 3.2 must hold the reference's code"
    )
    assert 'NotImplementedError("Week 1' not in student(repo, "attention.py")
    request = student(repo, "request.py")  # 3.1's tasks filled; 3.2's try_prefill a stub
    assert 'NotImplementedError("Week 3 Day 1, Task 4' not in request
    assert "Week 3 Day 2" in request and "NotImplementedError" in request
    assert "tiny_llm_ref" not in kv, "the reference's package name must become tiny_llm"


def test_a_changed_module_is_refused_and_nothing_is_written(repo):
    path = repo / "src" / "tiny_llm" / "attention.py"
    path.write_text(path.read_text() + MARK)
    before = {p.name: p.read_text() for p in (repo / "src" / "tiny_llm").glob("*.py")}
    refused = start_at(repo, "--week", "2", "--day", "1")
    assert refused.returncode == 1
    assert "src/tiny_llm/attention.py holds your own changes" in refused.stderr
    after = {p.name: p.read_text() for p in (repo / "src" / "tiny_llm").glob("*.py")}
    assert after == before, "a refusal must write nothing at all"
    forced = start_at(repo, "--week", "2", "--day", "1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert MARK not in path.read_text() and 'NotImplementedError("Week 1' not in path.read_text()


def test_a_module_already_as_wanted_is_not_the_students(repo):
    assert start_at(repo, "--week", "3", "--day", "2").returncode == 0
    again = start_at(repo, "--week", "2", "--day", "1")  # filled modules go back to stubs
    assert again.returncode == 0, again.stderr
    assert 'NotImplementedError("Week 2 Day 1' in student(repo, "kv_cache.py")


@pytest.mark.parametrize("args", [["--week", "9", "--day", "1"], ["--week", "3"]])
def test_a_day_without_tests_is_refused_before_anything_is_written(repo, args):
    before = {p.name: p.read_text() for p in (repo / "src" / "tiny_llm").glob("*.py")}
    refused = start_at(repo, *args)
    assert refused.returncode != 0
    assert "no day 9.1" in refused.stderr or "--day" in refused.stderr
    after = {p.name: p.read_text() for p in (repo / "src" / "tiny_llm").glob("*.py")}
    assert after == before
