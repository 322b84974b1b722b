"""The command line as a new user meets it: bad input and Ctrl-C in main.py, batch-main.py and
the chunked-prefill benchmark, each run as a subprocess on damaged copies of a tiny checkpoint.

Every bad input ends in one line that says what is wrong (with the file, the tensor or the
numbers) and a non-zero exit, never a traceback; Ctrl-C prints `interrupted` and exits 130,
leaving no process and no temporary file behind. Also pdm's pre_run hook: it syncs only when
pdm.lock or pyproject.toml changed. Not a day file: no network, the same on the skeleton.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import needs_ring, offline_env

from tiny_llm_support import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {
    "main": ["main.py"],
    "batch-main": ["batch-main.py", "--num-prompts", "2", "--max-seq-len", "96", "--plain"],
    "bench": [
        "benches/chunked_prefill.py",
        "--num-seqs", "2", "--prefill-steps", "16", "--repeats", "1", "--warmup", "0",
        "--min-input-len", "8", "--max-input-len", "24",
        "--min-output-len", "2", "--max-output-len", "2", "--no-plot",
    ],
}  # fmt: skip
INTERRUPTED = 130


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("good"))


def env_for(tmp_path: Path, **extra: str) -> dict:
    """No network, no user cache, and a temporary directory of its own to check afterwards."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return offline_env(tmp_path, TMPDIR=str(tmp_path / "tmp"), **extra)


def run_tool(tmp_path: Path, tool: str, *args: str, env: dict | None = None):
    command = [sys.executable, *TOOLS[tool], *args]
    if tool == "bench":
        command += ["--json-output", str(tmp_path / "bench.json")]
    return subprocess.run(
        command,
        cwd=ROOT,
        env=env or env_for(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def the_error(result, tool: str) -> str:
    """The one error line: stderr's only line (the benchmark may log its progress first)."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], result.stderr[-3000:]
    if tool != "bench":
        assert lines == errors, result.stderr[-3000:]
    return errors[0]


# --- checkpoints that cannot be read ------------------------------------------------------


def damaged_copy(good: Path, tmp_path: Path, how: str) -> Path:
    path = tmp_path / f"ckpt-{how}"
    shutil.copytree(good, path)
    weights = path / "model.safetensors"
    if how == "half":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "five-bytes":
        weights.write_bytes(weights.read_bytes()[:5])
    elif how == "random":
        weights.write_bytes(np.random.RandomState(0).bytes(weights.stat().st_size))
    elif how == "tokenizer":
        (path / "tokenizer.json").write_text('{1: "not json"')
    elif how == "config-list":
        (path / "config.json").write_text("[1, 2, 3]")
    elif how == "config-json":
        (path / "config.json").write_text('{"model_type": "qwen3", ')
    elif how == "int-weight":
        tensors = dict(mx.load(str(weights)))
        tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(mx.int32)
        mx.save_safetensors(str(weights), tensors)
    return path


DAMAGE = {
    "half": r"model\.safetensors: truncated or not a safetensors file \(header says \d+ bytes, file has \d+\)",
    "five-bytes": r"model\.safetensors: not a safetensors file \(5 bytes, too short\)",
    "random": r"model\.safetensors: truncated or not a safetensors file",
    "tokenizer": r"tokenizer\.json: not a valid tokenizer file",
    "config-list": r"config\.json: expected a JSON object of model settings, found a JSON list",
    "config-json": r"config\.json: not valid JSON",
    "int-weight": r"model\.safetensors: tensor model\.norm\.weight is int32, not a floating-point",
}  # fmt: skip


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_checkpoint_that_cannot_be_read_is_named_in_one_line(good, tmp_path, tool, how):
    path = damaged_copy(good, tmp_path, how)
    result = run_tool(tmp_path, tool, "--model", str(path))
    assert result.returncode == 1, result.stderr[-2000:]
    line = the_error(result, tool)
    assert re.search(DAMAGE[how], line), line
    assert str(path) in line


# --- prompts, positions and text --------------------------------------------------------------


def test_main_refuses_an_empty_prompt(tmp_path):
    result = run_tool(
        tmp_path, "main", "--model", "tiny-random", "--prompt", "", "--no-chat-template"
    )
    assert "the prompt is empty" in the_error(result, "main")


def test_main_refuses_a_prompt_longer_than_the_positions(tmp_path):
    result = run_tool(tmp_path, "main", "--model", "tiny-random", "--prompt", "x" * 100_000)
    line = the_error(result, "main")
    assert re.search(r"the prompt has \d+ tokens, more than the model's 2048 positions", line)


def test_main_stops_at_the_position_limit_and_says_so(tmp_path):
    """A prompt 18 positions short of the end: the 64 tokens asked for do not fit."""
    prompt = "a " * 2030  # 2031 tokens with the tiny tokenizer, no template
    result = run_tool(
        tmp_path, "main", "--model", "tiny-random", "--no-chat-template", "--prompt", prompt
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "prompt: 2031 tokens" in result.stdout
    assert re.search(r"\[(\d+) tokens in .*stopped at the 2048-position limit\]", result.stdout)
    assert "[18 tokens in " in result.stdout  # positions 0..2047: 2031 + 18 - 1 fed


def test_text_that_is_not_utf8_is_refused(tmp_path):
    command = [sys.executable, "main.py", "--model", "tiny-random", "--prompt"]
    result = subprocess.run(
        [os.fsencode(a) for a in command] + [b"caf\xe9 au lait"],  # Latin-1, not UTF-8
        cwd=ROOT,
        env=env_for(tmp_path),
        capture_output=True,
        timeout=60,
    )
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2
    assert "argument --prompt: not valid UTF-8 text (byte 0xe9 at character 4)" in err
    assert "Traceback" not in err


def test_batch_main_refuses_max_seq_len_above_the_positions(tmp_path):
    result = run_tool(tmp_path, "batch-main", "--model", "tiny-random", "--max-seq-len", "4096")
    assert result.returncode == 2
    line = the_error(result, "batch-main")
    assert "--max-seq-len 4096 is more than the model's 2048 positions" in line


def test_bench_refuses_requests_longer_than_the_positions(tmp_path):
    result = run_tool(tmp_path, "bench", "--model", "tiny", "--max-input-len", "4000")
    assert result.returncode == 2
    assert "exceeds the model's max_position_embeddings (2048)" in result.stderr
    assert "Traceback" not in result.stderr


# --- MLX that cannot start --------------------------------------------------------------------


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_the_cuda_build_without_a_driver_says_how_to_go_back(tmp_path, tool):
    """An `mlx` whose import fails the way the CUDA build does without libcuda."""
    fake = tmp_path / "fake" / "mlx"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(
        'raise ImportError("libcuda.so.1: cannot open shared object file: No such file or '
        'directory")\n'
    )
    env = env_for(tmp_path, PYTHONPATH=str(tmp_path / "fake"))
    result = run_tool(tmp_path, tool, env=env)
    assert result.returncode == 1
    line = the_error(result, tool)
    assert "libcuda.so.1" in line and "no NVIDIA driver" in line
    assert line.endswith("pdm sync --clean-unselected --reinstall -G dev -G book")


# --- Ctrl-C -----------------------------------------------------------------------------------


def start(tmp_path: Path, *command: str, env: dict | None = None) -> subprocess.Popen:
    """A process in a process group of its own, as a terminal runs a command."""
    return subprocess.Popen(
        [sys.executable, *command],
        cwd=ROOT,
        env=env or env_for(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_line(proc: subprocess.Popen, pattern: str, timeout: float = 60) -> None:
    """Read stdout until a line matches (the process must flush its lines)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if re.search(pattern, line):
            return
        assert line or proc.poll() is None, f"ended before {pattern!r}: {proc.stderr.read()}"
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s")


def ctrl_c(proc: subprocess.Popen, tmp_path: Path, group: bool = True) -> str:
    """SIGINT as the terminal sends it (to the process group), then the checks every Ctrl-C
    must pass; returns stderr."""
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == INTERRUPTED, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.count("interrupted") == 1 and err.rstrip().endswith("interrupted"), err[-3000:]
    assert not list((tmp_path / "tmp").iterdir()), "a temporary file was left behind"
    return err


def processes_mentioning(marker: str) -> list[str]:
    """Command lines of the processes on this machine that contain `marker`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text:
            found.append(text)
    return found


def test_ctrl_c_while_serving(tmp_path):
    proc = start(tmp_path, *TOOLS["batch-main"], "--log-every", "1")
    wait_for_line(proc, r"pass +\d+  decode")
    ctrl_c(proc, tmp_path)


def interrupt_inside(tmp_path: Path, module: str, name: str, argv: list[str]):
    """Run argv[0] as a script whose `module.name` first calls the original, then sends the
    process SIGINT and waits: Ctrl-C at a chosen moment, without timing."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import importlib, os, runpy, signal, sys, time\n"
        f"module = importlib.import_module({module!r})\n"
        f"original = getattr(module, {name!r})\n"
        "def interrupted(*args, **kwargs):\n"
        "    original(*args, **kwargs)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        f"setattr(module, {name!r}, interrupted)\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, str(driver)], cwd=ROOT, env=env_for(tmp_path), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == INTERRUPTED, result.stderr[-3000:]
    assert result.stderr.strip() == "interrupted"
    return result


def test_ctrl_c_while_loading(tmp_path):
    """The signal arrives once the checkpoint is read, before the model is built."""
    result = interrupt_inside(
        tmp_path, "tiny_llm_support.checkpoint", "load_checkpoint", TOOLS["batch-main"]
    )
    assert "model:" not in result.stdout


def test_ctrl_c_while_importing(tmp_path):
    """The signal arrives as the imports that load MLX begin (after startup.start())."""
    interrupt_inside(tmp_path, "tiny_llm_support.startup", "start", ["main.py"])


def test_ctrl_c_in_the_benchmark_stops_parent_and_run(tmp_path):
    """While a run's process serves the trace (in a session of its own, so the terminal's
    Ctrl-C reaches the benchmark alone): one `interrupted`, the run stopped, the benchmark's
    temporary directory removed."""
    args = [*TOOLS["bench"], "--repeats", "3", "--json-output", str(tmp_path / "b.json")]
    proc = start(tmp_path, *args, "--model", "tiny")
    deadline = time.monotonic() + 60
    while not processes_mentioning("--child-spec " + str(tmp_path / "tmp")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    ctrl_c(proc, tmp_path)
    time.sleep(0.5)
    assert not processes_mentioning(str(tmp_path / "tmp")), "a run's process was left"
    assert not (tmp_path / "b.json").exists()


@needs_ring
def test_ctrl_c_stops_every_tensor_parallel_rank(tmp_path):
    """The terminal's Ctrl-C reaches the demo, not the ranks (mlx.launch runs them in a
    session of their own): the demo stops them all."""
    marker = str(tmp_path / "cache")  # on every rank's command line
    proc = start(tmp_path, *TOOLS["batch-main"], "--tp", "2", "--cache-dir", marker)
    wait_for_line(proc, r"tensor parallel: 2 ranks")
    assert len(processes_mentioning(marker)) >= 3  # the demo, mlx.launch, two ranks
    ctrl_c(proc, tmp_path, group=False)
    time.sleep(0.5)
    assert not processes_mentioning(marker), "a rank was left running"


# --- pdm's pre_run hook -----------------------------------------------------------------------


def test_the_pre_run_hook_syncs_only_when_the_lock_or_project_changed(tmp_path):
    """scripts/sync-if-changed.sh, given a stand-in pdm that records its calls and is not on
    PATH: a first sync, none while nothing changes, one after pdm.lock changes."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "scripts", project / "scripts")
    (project / "pdm.lock").write_text("lock 1\n")
    (project / "pyproject.toml").write_text("[project]\n")
    fake = tmp_path / "fake-pdm" / "pdm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    calls = tmp_path / "calls"
    (fake / "core.py").write_text(
        "import os\n"
        "def main(args):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(' '.join(args) + '\\n')\n"
        "    os.makedirs('.venv', exist_ok=True)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake-pdm")}
    hook = ["sh", "scripts/sync-if-changed.sh", sys.executable, "-m", "pdm"]

    def run_hook() -> list[str]:
        subprocess.run(hook, cwd=project, env=env, check=True, timeout=60)
        return calls.read_text().splitlines() if calls.exists() else []

    assert run_hook() == ["sync --quiet -G dev -G book"]  # no environment yet
    assert len(run_hook()) == 1 and len(run_hook()) == 1  # nothing changed
    (project / "pdm.lock").write_text("lock 2\n")
    assert len(run_hook()) == 2
    assert len(run_hook()) == 2
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert len(run_hook()) == 3
    shutil.rmtree(project / ".venv")  # the environment is gone
    assert len(run_hook()) == 4
