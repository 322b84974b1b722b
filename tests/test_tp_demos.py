"""`--tp 2` in the demos (batch-main.py, main.py) and the launcher behind it.

Not a day file: the demos run the reference by default, so these pass on the untouched skeleton.
Each demo runs twice, in one process and as two ranks under mlx.launch on this machine, and
must print the same answers. They need no network: the tiny checkpoint is made under tmp_path.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import needs_ring, offline_env

from tiny_llm_support import make_tiny_checkpoint
from tiny_llm_support.launch import launch_command

ROOT = Path(__file__).resolve().parent.parent
ANSWER_LINES = re.compile(r"^(prompt|answer) \d+: .*$", re.M)

pytestmark = needs_ring


def run(tmp_path: Path, script: str, *args: str) -> str:
    env = offline_env(tmp_path)
    result = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"{script} {' '.join(args)} failed:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stdout


def answers(out: str) -> list[str]:
    return [m.group(0) for m in ANSWER_LINES.finditer(out)]


def test_batch_main_two_ranks_answer_as_one_process(tmp_path):
    args = ["--num-prompts", "2", "--max-seq-len", "72", "--prefill-step", "32"]
    one = run(tmp_path, "batch-main.py", *args)
    two = run(tmp_path, "batch-main.py", *args, "--tp", "2")
    assert "tensor parallel: 2 ranks" in two
    assert len(answers(one)) == 4, one
    assert answers(two) == answers(one), "two ranks must write the text one process writes"
    assert two.count("prompt 0: ") == 1, "only rank 0 prints"


def test_main_two_ranks_write_the_same_text(tmp_path):
    tiny = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    args = ["--model", str(tiny), "--max-tokens", "12"]
    one = run(tmp_path, "main.py", *args)
    two = run(tmp_path, "main.py", *args, "--tp", "2")
    text = lambda out: out.split("tokens\n\n", 1)[1].rsplit("\n[", 1)[
        0
    ]  # between loop: and [n tokens
    assert text(two) == text(one)
    assert two.count("loop: ") == 1, "only rank 0 prints"


def test_main_refuses_unseeded_sampling_over_ranks(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "--tp", "2", "--temperature", "0.7"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "needs --seed" in result.stderr


def test_launch_command_on_this_machine_and_from_a_hostfile(tmp_path):
    local = launch_command(["script.py", "--x"], 2)
    assert local[local.index("--backend") + 1] == "ring"
    assert local[local.index("-n") + 1] == "2"
    assert local[local.index("--hosts") + 1] == "127.0.0.1"
    assert local[local.index("--python") + 1] == sys.executable
    assert int(local[local.index("--starting-port") + 1]) > 0
    assert local[-2:] == ["script.py", "--x"]
    hostfile = tmp_path / "hosts.json"
    remote = launch_command(["script.py"], 2, hostfile)
    assert remote[remote.index("--hostfile") + 1] == str(hostfile)
    assert "-n" not in remote and "--hosts" not in remote
    with pytest.raises(ValueError, match="ranks"):
        launch_command(["script.py"], 0)
