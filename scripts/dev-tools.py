"""Developer commands behind `pdm run test`, `test-refsol`, `make-skeleton`, `start-at` and
`check-course`.

Ctrl-C and SIGTERM end every command with one line (`interrupted`, status 130; `terminated`,
143); check-course first stops the pytest runs it started and removes its temporary copies.
"""

import argparse
import importlib
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiny_llm_support import startup

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SRC = ROOT / "src"
DAY_FILE = re.compile(r"test_week_(\d+)_day_(\d+)\.py$")
# a Python stub raises NotImplementedError; a C++ one (Week 5) throws, and MLX raises its message
TASK_MESSAGE = re.compile(r"(NotImplementedError|RuntimeError): Week \d+ Day \d+, Task \d+")
MARK_BEGIN, MARK_END = (
    "BEGIN TASK ",
    "END TASK",
)  # after the comment mark: `# BEGIN TASK`, `// BEGIN TASK`
SOURCES = ("*.py", "csrc/*")  # a package's modules, and Week 5's C++ sources
TASK_TEXT = re.compile(r"Week \d+ Day \d+, Task \d+\b[^\"\\]*: [^\"\\]+$")
LINE_LENGTH = 100  # ruff's line-length: a longer raise line is wrapped the way ruff format does


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


# --- make-skeleton ---------------------------------------------------------------------


class MarkerError(ValueError):
    """A task marker in the reference is unbalanced, has no task text, or repeats one."""


def skeleton_module(text: str, where: str, stub=lambda task: True) -> tuple[str, list[str]]:
    """The student version of one reference module, and the task texts it marks.

    Lines between `# BEGIN TASK <text>` and `# END TASK` become one
    `raise NotImplementedError("<text>")` at the marker's indentation (in C++, between
    `// BEGIN TASK` and `// END TASK`, one `throw std::runtime_error("<text>");`); every other
    line is copied, with the package name tiny_llm_ref rewritten to tiny_llm. A task for which
    stub(text) is false keeps its reference lines (check-course stubs one task at a time).
    """
    cpp = where.endswith((".cpp", ".h"))
    comment, stub_line = ("// ", throw_line) if cpp else ("# ", raise_line)
    begin, end = comment + MARK_BEGIN, comment + MARK_END
    out, tasks, body = [], [], []
    open_at = None  # (line number, indentation, text) of the marker being skipped
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if stripped.startswith(begin.strip()):
            if open_at is not None:
                raise MarkerError(
                    f"{where}:{number}: BEGIN TASK inside the task opened at line {open_at[0]}"
                )
            task = stripped[len(begin) :].strip() if stripped.startswith(begin) else ""
            if not TASK_TEXT.match(task):
                raise MarkerError(
                    f"{where}:{number}: a task marker needs the text 'Week W Day D, Task N: what to "
                    f"write' (no quotes or backslashes), got {task!r}"
                )
            open_at = (number, indent, task)
        elif stripped == end:
            if open_at is None:
                raise MarkerError(f"{where}:{number}: END TASK without a BEGIN TASK")
            if indent != open_at[1]:
                raise MarkerError(
                    f"{where}:{number}: END TASK is not indented like its BEGIN at line {open_at[0]}"
                )
            out += [stub_line(open_at[1], open_at[2])] if stub(open_at[2]) else body
            tasks.append(open_at[2])
            open_at, body = None, []
        elif open_at is None:
            out.append(line.replace("tiny_llm_ref", "tiny_llm"))
        else:
            body.append(line.replace("tiny_llm_ref", "tiny_llm"))
    if open_at is not None:
        raise MarkerError(f"{where}:{open_at[0]}: BEGIN TASK is never closed")
    return "".join(out), tasks


def raise_line(indent: str, task: str) -> str:
    one_line = f'{indent}raise NotImplementedError("{task}")\n'
    if len(one_line) - 1 <= LINE_LENGTH:
        return one_line
    return f'{indent}raise NotImplementedError(\n{indent}    "{task}"\n{indent})\n'


def throw_line(indent: str, task: str) -> str:
    return f'{indent}throw std::runtime_error("{task}");\n'


def package_files(package: Path) -> list[Path]:
    return sorted(p for pattern in SOURCES for p in package.glob(pattern) if p.is_file())


def write_package(files: dict[str, str], target: Path, names=None) -> None:
    """Write `files` (path in the package -> text), or only those in `names`, under target."""
    for name in files if names is None else names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_text(files[name], encoding="utf-8")


def generate_skeleton(stub=lambda task: True) -> dict[str, str]:
    """file name -> text of every module of the student package, from the reference."""
    files, seen = {}, {}
    for path in package_files(SRC / "tiny_llm_ref"):
        where = path.relative_to(ROOT).as_posix()
        name = path.relative_to(SRC / "tiny_llm_ref").as_posix()
        files[name], tasks = skeleton_module(path.read_text(encoding="utf-8"), where, stub)
        for task in tasks:
            if task in seen:
                raise MarkerError(f"{where}: task text {task!r} is also used in {seen[task]}")
            seen[task] = where
    return files


def cmd_make_skeleton(args: argparse.Namespace) -> int:
    try:
        files = generate_skeleton()
    except MarkerError as e:
        sys.exit(f"error: {e}")
    target = SRC / "tiny_llm"
    for stale in set(p.relative_to(target).as_posix() for p in package_files(target)) - set(files):
        (target / stale).unlink()
        print(f"removed src/tiny_llm/{stale}")
    for name, text in files.items():
        path = target / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            write_package(files, target, [name])
            print(f"wrote src/tiny_llm/{name}")
    print(
        f"make-skeleton: src/tiny_llm/ holds {len(files)} modules generated from src/tiny_llm_ref/"
    )
    return 0


def cmd_start_at(args: argparse.Namespace) -> int:
    """src/tiny_llm/ ready to start at day W.D: the reference's body in every task of an
    earlier day, a stub in every task from W.D on. A module the student changed (not what
    make-skeleton or start-at at some day would write) is refused, all or nothing, unless
    --force."""
    start, days = (args.week, args.day), day_files()
    if start not in days:
        have = ", ".join(f"{w}.{d}" for w, d in days)
        sys.exit(f"error: there is no day {args.week}.{args.day}; the days are {have}")
    try:
        ours = [generate_skeleton(stub=lambda t, d=day: max(task_days(t)) >= d) for day in days]
        wanted = ours[list(days).index(start)]
    except MarkerError as e:
        sys.exit(f"error: {e}")
    target = SRC / "tiny_llm"
    current = {n: (target / n).read_text(encoding="utf-8") for n in wanted if (target / n).exists()}
    to_write = [n for n, text in wanted.items() if current.get(n) != text]
    yours = [n for n in to_write if n in current and all(current[n] != o[n] for o in ours)]
    if yours and not args.force:
        for name in yours:
            print(
                f"src/tiny_llm/{name} holds your own changes: --force replaces it", file=sys.stderr
            )
        print("start-at: nothing written", file=sys.stderr)
        return 1
    write_package(wanted, target, to_write)
    print(f"start-at {args.week}.{args.day}: the tasks of every day before it hold the reference's")
    print(
        f"code, the rest are stubs; {len(to_write)} modules written: {', '.join(to_write) or '-'}"
    )
    print(f"next: pdm run test --week {args.week} --day {args.day}")
    return 0


def check_skeleton_is_generated() -> tuple[list[str], list[str]]:
    """Problems where the committed skeleton differs from a fresh generation; all task texts."""
    try:
        files = generate_skeleton()
    except MarkerError as e:
        return [str(e)], []
    problems = []
    committed = {
        p.relative_to(SRC / "tiny_llm").as_posix() for p in package_files(SRC / "tiny_llm")
    }
    for name in sorted(committed - set(files)):
        problems.append(f"src/tiny_llm/{name} has no reference module in src/tiny_llm_ref/")
    for name, want in files.items():
        path = SRC / "tiny_llm" / name
        if not path.exists():
            problems.append(f"src/tiny_llm/{name} is missing: run `pdm run make-skeleton`")
            continue
        have = path.read_text(encoding="utf-8").splitlines()
        for number, (a, b) in enumerate(zip(have, want.splitlines()), start=1):
            if a != b:
                problems.append(
                    f"src/tiny_llm/{name}:{number} differs from the generated skeleton "
                    f"(run `pdm run make-skeleton`): has {a.strip()!r}, generated {b.strip()!r}"
                )
                break
        else:
            if len(have) != len(want.splitlines()):
                problems.append(f"src/tiny_llm/{name}: length differs from the generated skeleton")
    stubs = r'(?:NotImplementedError|runtime_error)\(\s*"([^"]+)"'
    tasks = [t for text in files.values() for t in re.findall(stubs, text)]
    return problems, tasks


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
    problems += [
        f"tiny_llm has {name}, tiny_llm_ref does not" for name in have.keys() - want.keys()
    ]
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


class Runs:
    """The pytest processes of run_days: stop() stops those running, and no more start."""

    lock = threading.Lock()
    running: set[subprocess.Popen] = set()
    stopped = False

    @classmethod
    def run(cls, cmd: list[str], env: dict) -> bool:
        """Run `cmd` to its end; False when stop() came first, so that it never started."""
        with cls.lock:
            if cls.stopped:
                return False
            out = subprocess.DEVNULL
            # a session of its own: Ctrl-C reaches check-course alone, which stops the run
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True
            )
            cls.running.add(proc)
        proc.wait()
        with cls.lock:
            cls.running.discard(proc)
        return True

    @classmethod
    def stop(cls, grace_s: float = 10.0) -> None:
        """Ctrl-C to every run (pytest stops, its tests clean up), then SIGKILL to any run
        still there after grace_s seconds."""
        with cls.lock:
            cls.stopped = True
            running = list(cls.running)
        for proc in running:
            proc.send_signal(signal.SIGINT)
        for proc in running:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_day(path: Path, env: dict, workdir: Path) -> list[tuple[str, str | None]]:
    """Run one test file in its own pytest process with `env`; its (test, failure) pairs."""
    xml = Path(tempfile.mkstemp(suffix=".xml", prefix=path.stem, dir=workdir)[1])
    xml.unlink()  # pytest writes it; a run that dies leaves none
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(path),
        "--impl=student",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
    ]
    if "TINY_LLM_STOP_WHEN_NAMED" in env:
        cmd += ["-p", "stop_when_named"]  # scripts/stop_when_named.py, on PYTHONPATH
    if not Runs.run(cmd, {**env, "TMPDIR": str(workdir)}):  # what tests leave goes with workdir
        return [(path.name, "stopped")]
    if not xml.exists():
        return [(path.name, "pytest did not run")]
    return junit_cases(xml)


def run_days(runs: list[tuple[Path, dict]], workdir: Path) -> list[list[tuple[str, str | None]]]:
    """run_day for every (test file, environment), as many at once as there are CPUs (each is
    its own pytest process); the results in the order of `runs`."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        try:
            return list(pool.map(lambda run: run_day(*run, workdir), runs))
        except BaseException:  # Ctrl-C or SIGTERM: the pool waits for its runs, so stop them
            Runs.stop()
            raise


def env_with_path(first: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(first), str(SRC), env.get("PYTHONPATH", "")])
    return env


def check_skeleton(days: dict, workdir: Path) -> list[str]:
    """Every test of every day fails on the untouched skeleton, naming a task."""
    problems = []
    env = env_with_path(SRC)
    results = run_days([(path, env) for path in days.values()], workdir)
    for (week, day), cases in zip(days, results):
        print(f"  skeleton   week {week} day {day}: {len(cases)} tests", flush=True)
        for name, failure in cases:
            if failure is None:
                problems.append(f"{name} passes on the untouched skeleton")
            elif not TASK_MESSAGE.search(failure):
                problems.append(f"{name} fails on the skeleton without naming a task")
    return problems


def task_days(task: str) -> set[tuple[int, int]]:
    """The days a task text names ("Week 3 Day 1, Task 3 and Week 3 Day 2, Task 1": two)."""
    return {(int(w), int(d)) for w, d in re.findall(r"Week (\d+) Day (\d+)", task)}


def check_each_task_is_tested(days: dict, workdir: Path, tasks: list[str]) -> list[str]:
    """With every other task solved, each task alone left as a stub makes a test of its day
    fail naming it: no task is out of the tests' reach, however far down a call chain. Each
    run stops at the first failure that names its task."""
    runs, owners = [], []  # a run per (task, test file of its days); owners: its task
    for number, task in enumerate(tasks):
        paths = [days[d] for d in sorted(task_days(task)) if d in days]
        if not paths:
            continue
        package = workdir / f"one-task-{number}"
        write_package(generate_skeleton(stub=task.__eq__), package / "tiny_llm")
        env = {**env_with_path(package), "TINY_LLM_STOP_WHEN_NAMED": task}
        env["PYTHONPATH"] += os.pathsep + str(ROOT / "scripts")
        runs += [(path, env) for path in paths]
        owners += [task] * len(paths)
    failures: dict[str, list[str | None]] = {task: [] for task in owners}
    for task, cases in zip(owners, run_days(runs, workdir)):
        failures[task] += [f for _, f in cases]
    problems = []
    for task, found in failures.items():
        named = any(f and task in f for f in found)
        print(f"  one stub   {task[:70]}: {'named' if named else 'NOT NAMED'}", flush=True)
        if not named:
            problems.append(
                f"no test of its day fails naming the task {task!r} when only it is a stub"
            )
    return problems


def check_days_in_order(days: dict, workdir: Path, tasks: list[str]) -> tuple[list[str], dict]:
    """A student can do the days in order: with the tasks of every day up to D solved and all
    later ones stubs, day D's tests pass, or fail only on a task that day D itself names (a task
    that spans two days, like chunking try_prefill, is a stub until its last day). Returns the
    problems and the days where some test failed."""
    runs = []
    for (week, day), path in days.items():
        package = workdir / f"up-to-{week}-{day}"
        solved = lambda task, until=(week, day): max(task_days(task)) <= until
        write_package(generate_skeleton(stub=lambda t, ok=solved: not ok(t)), package / "tiny_llm")
        runs.append((path, env_with_path(package)))
    problems, failed = [], {}
    for (week, day), cases in zip(days, run_days(runs, workdir)):
        print(f"  in order   week {week} day {day}: {len(cases)} tests", flush=True)
        if not cases:
            problems.append(f"{days[week, day].name} ran no tests")
        for name, failure in cases:
            if failure is None:
                continue
            failed[week, day] = days[week, day]
            named = [t for t in tasks if t in failure]
            if not named:
                problems.append(
                    f"week {week} day {day} in order: {name} fails on no task:\n{failure}"
                )
            elif not any((week, day) in task_days(t) for t in named):
                problems.append(
                    f"week {week} day {day} in order: {name} reaches the later task {named[0]!r} "
                    "from given code or an earlier day's task"
                )
    return problems, failed


def check_pasted_reference(days: dict, workdir: Path) -> list[str]:
    """With the reference modules pasted into a copy of tiny_llm, every test of `days` passes.
    check-course passes only the days where a test failed in order: a day whose tests all
    passed with the later days' tasks as stubs never ran those tasks, so pasting them in
    changes nothing that day's tests reach."""
    copy = workdir / "pasted"
    shutil.copytree(SRC / "tiny_llm", copy / "tiny_llm")
    for module in (SRC / "tiny_llm_ref").glob("*.py"):
        if module.name != "__init__.py":
            shutil.copy(module, copy / "tiny_llm" / module.name)
    solved = generate_skeleton(stub=lambda task: False)  # C++: the reference, the module renamed
    write_package(solved, copy / "tiny_llm", [n for n in solved if n.startswith("csrc/")])
    env = env_with_path(copy)
    problems = []
    results = run_days([(path, env) for path in days.values()], workdir)
    for ((week, day), path), cases in zip(days.items(), results):
        print(f"  reference  week {week} day {day}: {len(cases)} tests", flush=True)
        problems += [
            f"{name} fails with the reference pasted in:\n{failure}"
            for name, failure in cases
            if failure is not None
        ]
        if not cases:
            problems.append(f"{path.name} ran no tests")
    return problems


def cmd_check_course(args: argparse.Namespace) -> int:
    days = day_files()
    if args.week is not None:
        days = {k: v for k, v in days.items() if k[0] == args.week and args.day in (None, k[1])}
    started = time.monotonic()

    def step(title: str) -> None:
        print(f"check-course [{time.monotonic() - started:4.0f} s]: {title}", flush=True)

    step("src/tiny_llm/ is the skeleton generated from the reference")
    problems, tasks = check_skeleton_is_generated()
    step("API of tiny_llm against tiny_llm_ref")
    problems += check_api()
    with tempfile.TemporaryDirectory() as tmp:
        step("each day's tests on the untouched skeleton")
        problems += check_skeleton(days, Path(tmp))
        step("each task alone as a stub, its day's tests name it")
        problems += check_each_task_is_tested(days, Path(tmp), tasks)
        step("the days in order, later days' tasks left as stubs")
        in_order, failed = check_days_in_order(days, Path(tmp), tasks)
        problems += in_order
        step("the reference pasted in, for the days where a test failed in order")
        problems += check_pasted_reference(failed, Path(tmp))
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    step(f"{len(days)} days checked, {len(problems)} problems")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="dev-tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "make-skeleton", help="write src/tiny_llm/ from the task markers in the reference"
    )
    for name in ("test", "check-course"):
        p = sub.add_parser(name)
        p.add_argument("--week", type=int)
        p.add_argument("--day", type=int)
    sub.choices["test"].add_argument("--ref", action="store_true", help="test tiny_llm_ref")
    p = sub.add_parser("start-at", help="fill src/tiny_llm/ to start the course at a day")
    p.add_argument("--week", type=int, required=True)
    p.add_argument("--day", type=int, required=True)
    p.add_argument("--force", action="store_true", help="replace modules you changed")
    # everything dev-tools does not know goes to pytest, with or without a "--" before it
    # (pdm run swallows the first "--")
    args, extra = parser.parse_known_args()
    if args.command == "test":
        args.pytest_args = [a for a in extra if a != "--"]
        return cmd_test(args)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "make-skeleton":
        return cmd_make_skeleton(args)
    if args.command == "start-at":
        return cmd_start_at(args)
    return cmd_check_course(args)


if __name__ == "__main__":
    sys.exit(startup.run(main))
