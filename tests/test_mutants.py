"""Tests for scripts/mutants.py's bookkeeping (no mutant is run): the keys, and the survivors'
reasons a full run carries over from the results file it replaces."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "mutants", Path(__file__).resolve().parent.parent / "scripts" / "mutants.py"
)
mutants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)


def mutant(line: int, source: str, what: str, outcome: str):
    return mutants.Mutant("m.py", line, source, (1, 2), 1, what, "", outcome)


def test_keyed_counts_the_same_key_again():
    assert mutants.keyed(["a", "b", "a"], lambda s: (s,)) == {
        ("a", 0): "a",
        ("b", 0): "b",
        ("a", 1): "a",
    }


def test_a_full_run_keeps_the_reasons_of_its_survivors_by_line_text(capsys):
    """A survivor whose line moved keeps its reason, and so does one in an old file keyed by
    line number; the reason of a mutant now killed is dropped, and stderr counts both."""
    earlier = [
        mutant(10, "y = x - 1", "'-' -> '+'", "survived"),  # moves to line 12
        mutant(20, "z = y * 2", "'*' -> '/'", "survived"),  # now killed
    ]
    old_keys = list(mutants.reason_keys(earlier))
    assert old_keys == ["m.py: '-' -> '+' in `y = x - 1`", "m.py: '*' -> '/' in `z = y * 2`"]
    why = {old_keys[0]: "equivalent: moved", old_keys[1]: "equivalent: killed now"}
    why["m.py:30 (Task 1) '1' -> '0'"] = "equivalent: an old file's key"
    now = [
        mutant(12, "y = x - 1", "'-' -> '+'", "survived"),
        mutant(22, "z = y * 2", "'*' -> '/'", "killed"),
        mutant(30, "w = 1", "'1' -> '0'", "survived"),
        mutant(31, "v = w - w", "'-' -> '+'", "survived"),  # no reason yet
    ]
    [row] = mutants.day_table(now, {"days": [{"day": "1.2", "survivors_why": why}]})
    assert row["survivors"] == [
        "m.py:12 (Task 1) '-' -> '+'",
        "m.py:30 (Task 1) '1' -> '0'",
        "m.py:31 (Task 1) '-' -> '+'",
    ]
    assert row["survivors_why"] == {
        "m.py: '-' -> '+' in `y = x - 1`": "equivalent: moved",
        "m.py: '1' -> '0' in `w = 1`": "equivalent: an old file's key",
    }
    assert (row["mutants"], row["killed"], row["equivalent"]) == (4, 1, 2)
    assert row["killed_of_non_equivalent"] == 0.5
    assert "2 survivors' reasons kept, 1 dropped" in capsys.readouterr().err


def test_the_same_change_twice_in_one_line_text_is_counted():
    keys = mutants.reason_keys(
        [mutant(5, "a = b - c - d", "'-' -> '+'", "survived") for _ in range(2)]
    )
    assert list(keys) == [
        "m.py: '-' -> '+' in `a = b - c - d`",
        "m.py: '-' -> '+' in `a = b - c - d` (2)",
    ]
