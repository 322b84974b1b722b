"""Developer commands behind `pdm run test`, `pdm run test-refsol` and `pdm run check-course`."""

import argparse
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SRC = ROOT / "src"
DAY_FILE = re.compile(r"test_week_(\d+)_day_(\d+)\.py$")
TASK_MESSAGE = re.compile(r"NotImplementedError: Week \d+ Day \d+, Task \d+")


def day_files() -> dict[tuple[int, int], Path]:
    found = {}
    for path in sorted(TESTS.glob("test_week_*_day_*.py")):
        week, day = map(int, DAY_FILE.search(path.name).groups())
        found[(week, day)] = path
    return found


def select_files(week: int | None, day: int | None) -> list[Path]:
    """The test files for a week/day choice; a choice with no tests is an error."""
    if day is not None and week is None:
        sys.exit("error: --day needs --week")
    if week is None:
        return [TESTS]
    days = day_files()
    chosen = [p for (w, d), p in days.items() if w == week and (day is None or d == day)]
    if not chosen:
        have = ", ".join(f"--week {w} --day {d}" for w, d in days) or "none"
        what = f"week {week}" + (f" day {day}" if day is not None else "")
        sys.exit(f"error: there are no tests for {what}. Days with tests: {have}")
    return chosen


def run_pytest(files: list[Path], impl: str, extra: list[str], env=None) -> int:
    cmd = [sys.executable, "-m", "pytest", *map(str, files), f"--impl={impl}", *extra]
    return subprocess.call(cmd, cwd=ROOT, env=env)


def cmd_test(args: argparse.Namespace) -> int:
    impl = "ref" if args.ref else "student"
    return run_pytest(select_files(args.week, args.day), impl, args.pytest_args)


# --- check-course ------------------------------------------------------------------------


def public_api(module) -> dict[str, str]:
    """name -> signature text for every public function, class and method of a package."""
    api = {}
    for name in module.__all__:
        obj = getattr(module, name)
        api[name] = _signature(obj)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") or attr == "__init__" or attr == "__call__":
                    api[f"{name}.{attr}"] = _signature(member)
    return api


def _signature(obj) -> str:
    if isinstance(obj, property):
        return "property"
    try:
        # type hints name the package a class lives in; the two packages differ only there
        return str(inspect.signature(obj)).replace("tiny_llm_ref.", "tiny_llm.")
    except (TypeError, ValueError):
        return type(obj).__name__


def check_api() -> list[str]:
    sys.path.insert(0, str(SRC))
    student, ref = importlib.import_module("tiny_llm"), importlib.import_module("tiny_llm_ref")
    problems = []
    modules = lambda pkg: sorted(p.name for p in (SRC / pkg).glob("*.py"))
    if modules("tiny_llm") != modules("tiny_llm_ref"):
        problems.append(f"module lists differ: {modules('tiny_llm')} vs {modules('tiny_llm_ref')}")
    want, have = public_api(ref), public_api(student)
    for name, sig in want.items():
        if name not in have:
            problems.append(f"tiny_llm lacks {name}")
        elif have[name] != sig:
            problems.append(f"{name}: tiny_llm {have[name]} != tiny_llm_ref {sig}")
    problems += [f"tiny_llm has {name}, tiny_llm_ref does not" for name in have.keys() - want.keys()]
    return problems


def junit_cases(xml_path: Path) -> list[tuple[str, str | None]]:
    """(test id, failure text or None when it passed) for every test that ran."""
    cases = []
    for case in ET.parse(xml_path).iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if case.find("skipped") is not None:
            cases.append((case.get("name"), "skipped"))
            continue
        text = None if bad is None else (bad.get("message", "") + "\n" + (bad.text or ""))
        cases.append((f"{case.get('classname')}::{case.get('name')}", text))
    return cases


def run_day(path: Path, env: dict, workdir: Path) -> list[tuple[str, str | None]]:
    xml = workdir / f"{path.stem}.xml"
    cmd = [sys.executable, "-m", "pytest", str(path), "--impl=student", "-q",
           "-p", "no:cacheprovider", f"--junitxml={xml}"]
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not xml.exists():
        return [(path.name, "pytest did not run")]
    return junit_cases(xml)


def env_with_path(first: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(first), str(SRC), env.get("PYTHONPATH", "")])
    return env


def check_skeleton(days: dict, workdir: Path) -> list[str]:
    """Every test of every day fails on the untouched skeleton, naming a task."""
    problems = []
    env = env_with_path(SRC)
    for (week, day), path in days.items():
        cases = run_day(path, env, workdir)
        print(f"  skeleton   week {week} day {day}: {len(cases)} tests", flush=True)
        for name, failure in cases:
            if failure is None:
                problems.append(f"{name} passes on the untouched skeleton")
            elif not TASK_MESSAGE.search(failure):
                problems.append(f"{name} fails on the skeleton without naming a task")
    return problems


def check_pasted_reference(days: dict, workdir: Path) -> list[str]:
    """With the reference modules pasted into a copy of tiny_llm, every test passes."""
    copy = workdir / "pasted"
    shutil.copytree(SRC / "tiny_llm", copy / "tiny_llm")
    for module in (SRC / "tiny_llm_ref").glob("*.py"):
        if module.name != "__init__.py":
            shutil.copy(module, copy / "tiny_llm" / module.name)
    env = env_with_path(copy)
    problems = []
    for (week, day), path in days.items():
        cases = run_day(path, env, workdir)
        print(f"  reference  week {week} day {day}: {len(cases)} tests", flush=True)
        problems += [f"{name} fails with the reference pasted in:\n{failure}"
                     for name, failure in cases if failure is not None]
        if not cases:
            problems.append(f"{path.name} ran no tests")
    return problems


def cmd_check_course(args: argparse.Namespace) -> int:
    days = day_files()
    if args.week is not None:
        days = {k: v for k, v in days.items() if k[0] == args.week and args.day in (None, k[1])}
    print("check-course: API of tiny_llm against tiny_llm_ref", flush=True)
    problems = check_api()
    with tempfile.TemporaryDirectory() as tmp:
        print("check-course: each day's tests on the untouched skeleton", flush=True)
        problems += check_skeleton(days, Path(tmp))
        print("check-course: each day's tests with the reference pasted in", flush=True)
        problems += check_pasted_reference(days, Path(tmp))
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    print(f"check-course: {len(days)} days checked, {len(problems)} problems")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="dev-tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("test", "check-course"):
        p = sub.add_parser(name)
        p.add_argument("--week", type=int)
        p.add_argument("--day", type=int)
    sub.choices["test"].add_argument("--ref", action="store_true", help="test tiny_llm_ref")
    # everything dev-tools does not know goes to pytest, with or without a "--" before it
    # (pdm run swallows the first "--")
    args, extra = parser.parse_known_args()
    if args.command == "test":
        args.pytest_args = [a for a in extra if a != "--"]
        return cmd_test(args)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return cmd_check_course(args)


if __name__ == "__main__":
    sys.exit(main())
