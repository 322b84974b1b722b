"""`pdm run mutants [--week W --day D]`: mutation testing of the reference's task bodies.

A mutant is the reference with one small change inside one task body, the kind of slip a
student makes: a comparison one step off (< for <=), an operator swapped (+ for -, // for /),
a small constant off by one, a statement left out. Each mutant is pasted into a copy of the
package as `tiny_llm` and that day's tests run against it (`--impl student`, stopping at the
first failure; a body two days write, such as 3.1's and 3.2's prefill, runs both days' tests,
and so does a line that a later day adds to a body, marked "written in Week W Day D" at its end
or in a comment line above it). A mutant is killed when a test fails, survived when every test passes. A
survivor is either a test to write or a change that cannot matter (an equivalent mutant);
the results list them so each can be looked at.

Not part of CI: each mutant costs one run of its day's tests. Results: JSON (--json-output)
and a table per day.
"""

import argparse
import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "src" / "tiny_llm_ref"
TESTS = ROOT / "tests"
BEGIN = re.compile(r"# BEGIN TASK Week (\d+) Day (\d+), Task (\d+)")
DAY = re.compile(r"Week (\d+) Day (\d+)")  # a body two days write names both
LATER = re.compile(r"written in Week (\d+) Day (\d+)")  # a line a later day adds to a body
END = "# END TASK"
SWAPS = {  # operator -> what a slip turns it into
    "<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
    "+": "-", "-": "+", "*": "/", "/": "*", "//": "/", "%": "//",
}  # fmt: skip
SMALL_INTS = {"0": "1", "1": "0", "2": "1"}
DROPPABLE = (ast.Assign, ast.AugAssign, ast.Expr)  # statements that can be left out


@dataclass
class Mutant:
    module: str  # file name in the package
    line: int  # 1-based line of the change
    source: str  # that line as the reference writes it
    day: tuple[int, int]
    task: int
    what: str  # e.g. "'<' -> '<='"
    text: str  # the whole mutated module
    outcome: str = ""  # killed, survived, timeout (killed), broken (does not import)
    seconds: float = 0.0
    tested_by: tuple = ()  # the days whose tests run: the body's day, and any other it names

    @property
    def label(self) -> str:  # as the results list a survivor
        return f"{self.module}:{self.line} (Task {self.task}) {self.what}"


def task_lines(source: str) -> dict[int, tuple]:
    """line number -> (week, day, task, days named by the marker) for every line of a body."""
    owner, where, above = {}, None, ""
    for number, line in enumerate(source.splitlines(), start=1):
        found = BEGIN.search(line)
        if found:
            days = tuple((int(w), int(d)) for w, d in DAY.findall(line))
            where = (*map(int, found.groups()), days)
        elif line.strip() == END:
            where = None
        elif where is not None:
            marks = LATER.findall(line + (above if above.lstrip().startswith("#") else ""))
            owner[number] = (*where[:3], where[3] + tuple((int(w), int(d)) for w, d in marks))
        above = line
    return owner


def token_mutants(source: str, owner: dict) -> list[tuple[int, str, str]]:
    """(line, description, mutated source) for each operator or small constant in a task."""
    lines = source.splitlines(keepends=True)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        (row, col), (_, end) = tok.start, tok.end
        if row not in owner:
            continue
        if tok.type == tokenize.OP and tok.string in SWAPS:
            new = SWAPS[tok.string]
        elif tok.type == tokenize.NUMBER and tok.string in SMALL_INTS:
            new = SMALL_INTS[tok.string]
        else:
            continue
        changed = lines[row - 1][:col] + new + lines[row - 1][end:]
        mutated = "".join(lines[: row - 1] + [changed] + lines[row:])
        out.append((row, f"{tok.string!r} -> {new!r}", mutated))
    return out


def dropped_statements(source: str, owner: dict) -> list[tuple[int, str, str]]:
    """(line, description, mutated source) for each one-line statement of a task left out."""
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, DROPPABLE) or node.lineno != node.end_lineno:
            continue
        if node.lineno not in owner or isinstance(getattr(node, "value", None), ast.Constant):
            continue  # a docstring or a bare constant: nothing to leave out
        line = lines[node.lineno - 1]
        indent = line[: len(line) - len(line.lstrip())]
        mutated = "".join(lines[: node.lineno - 1] + [f"{indent}pass\n"] + lines[node.lineno :])
        out.append((node.lineno, f"statement left out: {line.strip()[:60]}", mutated))
    return out


def make_mutants(days: set[tuple[int, int]] | None) -> list[Mutant]:
    mutants = []
    for path in sorted(REF.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        owner, lines = task_lines(source), source.splitlines()
        for row, what, text in token_mutants(source, owner) + dropped_statements(source, owner):
            week, day, task, named = owner[row]
            if (days is None or (week, day) in days) and compiles(text):
                line = lines[row - 1].strip()
                m = Mutant(path.name, row, line, (week, day), task, what, text, tested_by=named)
                mutants.append(m)
    return mutants


def compiles(text: str) -> bool:
    """Whether a mutant is still Python (* of an unpacking turned into / is not)."""
    try:
        compile(text, "<mutant>", "exec")
    except SyntaxError:
        return False
    return True


def run_mutant(mutant: Mutant, workdir: Path, timeout: float) -> Mutant:
    """Paste the mutant into a copy of the package and run its day's tests against it."""
    package = Path(tempfile.mkdtemp(dir=workdir)) / "tiny_llm"
    shutil.copytree(REF, package, ignore=shutil.ignore_patterns("__pycache__"))
    for module in [*package.glob("*.py"), *package.glob("csrc/*")]:  # csrc: Week 5's C++
        text = mutant.text if module.name == mutant.module else module.read_text()
        module.write_text(text.replace("tiny_llm_ref", "tiny_llm"), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package.parent), str(ROOT / "src")]))
    env["TINY_LLM_REQUIRE_RANKS"] = "1"  # a two-rank test that cannot start fails, never passes
    tests = [str(TESTS / f"test_week_{w}_day_{d}.py") for w, d in mutant.tested_by]
    cmd = [sys.executable, "-m", "pytest", *tests]
    cmd += ["--impl=student", "-x", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "no:hypothesispytest"]  # 2 s of start-up per mutant; no day's tests use it
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=timeout)
        mutant.outcome = "survived" if done.returncode == 0 else "killed"
        if done.returncode in (2, 3, 4):  # collection or usage error: it does not even import
            mutant.outcome = "broken"
    except subprocess.TimeoutExpired:
        mutant.outcome = "timeout"  # a hang the tests turned into a failure: killed
    mutant.seconds = round(time.monotonic() - start, 1)
    shutil.rmtree(package.parent, ignore_errors=True)
    return mutant


def keyed(items: list, key: Callable[[Any], tuple]) -> dict:
    """key(item) + (n,) -> item, n counting the items before it with the same key (the same
    change twice on one line)."""
    out, seen = {}, Counter()
    for item in items:
        k = key(item)
        out[(*k, seen[k])] = item
        seen[k] += 1
    return out


def reason_keys(mutants: list[Mutant]) -> dict[str, Mutant]:
    """Each mutant under its key in `survivors_why`: its module, the change and the line it
    changes as written (not the line's number, which an edit above it moves), then (2) for the
    second same change of that text, and so on."""
    by_text = keyed(mutants, attrgetter("module", "what", "source"))
    return {
        f"{f}: {what} in `{line}`" + f" ({n + 1})" * bool(n): m
        for (f, what, line, n), m in by_text.items()
    }


def rerun_survivors(path: Path, args) -> int:
    """Run again only the mutants that survived in the results at `path` (after a new test),
    and write the file back with their new outcomes."""
    old = json.loads(path.read_text(encoding="utf-8"))
    days = {tuple(map(int, row["day"].split("."))) for row in old["days"]}
    fresh = keyed(make_mutants(days), attrgetter("module", "line", "what"))
    runs = keyed(old["mutants"], itemgetter("module", "line", "what"))
    if fresh.keys() != runs.keys():
        changed = min(fresh.keys() ^ runs.keys())
        print(f"error: {path}: the reference changed since that run ({changed}): run it anew")
        return 1
    for k, m in fresh.items():
        m.outcome, m.seconds = runs[k]["outcome"], runs[k]["seconds"]
    mutants = list(fresh.values())
    alive = [m for m in mutants if m.outcome == "survived"]
    print(f"mutants: {len(alive)} survivors of {path.name} run again", flush=True)
    with tempfile.TemporaryDirectory(prefix="tiny-llm-mutants-") as tmp:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for m in pool.map(lambda m: run_mutant(m, Path(tmp), args.timeout), alive):
                print(f"  {m.label}: {m.outcome}")
    results = {"days": day_table(mutants, old), "mutants": records(mutants)}
    path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


def records(mutants: list[Mutant]) -> list[dict]:
    """The mutants as the results file lists them: all but the mutated module's text."""
    return [{k: v for k, v in asdict(m).items() if k != "text"} for m in mutants]


def day_table(mutants: list[Mutant], earlier: dict | None) -> list[dict]:
    """A row per day: its mutants killed and survived, and the reasons an earlier results file
    gave for the survivors still alive (`survivors_why`, written by hand: "equivalent: ..." or
    why no test can kill it) with the counts that follow from them. A reason is found under its
    reason_keys key, or under the survivor's label (line number) that files written before used."""
    why = {row["day"]: row.get("survivors_why", {}) for row in (earlier or {}).get("days", [])}
    rows, used = [], set()
    for day in sorted({m.day for m in mutants}):
        name = f"{day[0]}.{day[1]}"
        keys = reason_keys([m for m in mutants if m.day == day])
        mine = [m for m in keys.values() if m.outcome != "broken"]
        killed = sum(m.outcome in ("killed", "timeout") for m in mine)
        alive = {k: m for k, m in keys.items() if m.outcome == "survived"}
        known, reasons = why.get(name, {}), {}
        for k, m in alive.items():
            old = k if k in known else m.label
            if old in known:
                reasons[k] = known[old]
                used.add((name, old))
        same = sum(r.startswith("equivalent") for r in reasons.values())
        killable = len(mine) - same
        rows.append(
            {
                "day": name,
                "mutants": len(mine),
                "killed": killed,
                "survived": len(mine) - killed,
                "killed_fraction": round(killed / len(mine), 3) if mine else None,
                "survivors": [m.label for m in alive.values()],
                "survivors_why": reasons,
                "equivalent": same,
                "killed_of_non_equivalent": round(killed / killable, 3) if killable else None,
            }
        )
    if earlier is not None:
        dropped = sum(map(len, why.values())) - len(used)
        print(f"mutants: {len(used)} survivors' reasons kept, {dropped} dropped", file=sys.stderr)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--week", type=int)
    p.add_argument("--day", type=int)
    p.add_argument("--timeout", type=float, default=300, help="seconds per mutant's test run")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at once")
    p.add_argument("--json-output", type=Path, help="write the results here as JSON")
    p.add_argument(
        "--rerun-survivors",
        type=Path,
        metavar="JSON",
        help="run only the survivors of these results again and update the file",
    )
    p.add_argument(
        "--reasons",
        type=Path,
        metavar="JSON",
        help="keep the survivors' reasons from these results (default: from --json-output's "
        "file, when it exists)",
    )
    args = p.parse_args()
    if args.rerun_survivors:
        return rerun_survivors(args.rerun_survivors, args)
    if args.day is not None and args.week is None:
        p.error("--day needs --week")
    days = None
    if args.week is not None:
        found = {(w, d) for w, d in (m.day for m in make_mutants(None))}
        days = {(w, d) for w, d in found if w == args.week and args.day in (None, d)}
        if not days:
            p.error(f"no task bodies for week {args.week}" + (f" day {args.day}" * bool(args.day)))
    reasons = args.reasons or args.json_output  # read before the run: a bad file fails at once
    earlier = None
    if reasons is not None and (args.reasons is not None or reasons.is_file()):
        earlier = json.loads(reasons.read_text(encoding="utf-8"))
    mutants = make_mutants(days)
    print(f"mutants: {len(mutants)} mutants of the task bodies, {args.jobs} at a time", flush=True)
    with tempfile.TemporaryDirectory(prefix="tiny-llm-mutants-") as tmp:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = pool.map(lambda m: run_mutant(m, Path(tmp), args.timeout), mutants)
            for n, m in enumerate(runs, start=1):
                day = f"{m.day[0]}.{m.day[1]}"
                print(f"  [{n}/{len(mutants)}] {day} {m.module}:{m.line} {m.what}: {m.outcome}")
    table = day_table(mutants, earlier)
    print(f"\n{'day':>5} {'mutants':>8} {'killed':>7} {'survived':>9} {'killed %':>9}")
    for row in table:
        share = f"{100 * row['killed_fraction']:.0f}%" if row["mutants"] else "-"
        print(
            f"{row['day']:>5} {row['mutants']:>8} {row['killed']:>7} {row['survived']:>9} {share:>9}"
        )
        for survivor in row["survivors"]:
            print(f"        survived: {survivor}")
    if args.json_output:
        results = {"days": table, "mutants": records(mutants)}
        args.json_output.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json_output}")
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))  # Ctrl-C: one line, and the temporary copies removed
