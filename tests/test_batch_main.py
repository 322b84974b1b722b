"""The batch-main demo: the tiny model end to end, and its error messages.

Not a day file: these tests check the demo script, not an exercise, so they may pass on the
untouched skeleton. They need no network: the tiny checkpoint is made under tmp_path.
"""

import importlib.util
import math
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import huggingface_hub
import pytest
from helpers import offline_env

from tiny_llm_support import SHORTCUTS, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "batch-main.py"
TASK = re.compile(r"Week \d+ Day \d+, Task \d+")
PREFILL_LINE = re.compile(r"prefill req\s+(\d+)\s+chunk (\d+): (\d+) tokens\s+(\d+)/(\d+)")


@pytest.fixture(scope="module")
def demo():
    """batch-main.py imported as a module (its name has a dash), for in-process runs."""
    spec = importlib.util.spec_from_file_location("batch_main", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["batch_main"] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("batch_main", None)


def run_demo(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env or offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_answers(out: str, n: int) -> None:
    for i in range(n):
        assert re.search(rf"^prompt {i}: \S", out, re.M), f"no prompt line for request {i}"
        assert re.search(rf"^answer {i}: \S", out, re.M), f"no answer line for request {i}"
    assert not re.search(rf"^answer {n}: ", out, re.M)


def test_tiny_end_to_end_plain_output(tmp_path):
    step = 16
    env = offline_env(tmp_path)
    del env["TINY_LLM_NO_OPENBLAS"]  # the demo as users start it (it may preload OpenBLAS)
    args = ["--num-prompts", "3", "--max-seq-len", "96", "--prefill-step", str(step)]
    result = run_demo(tmp_path, *args, env=env)
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists()  # the trained tiny model ships in the package
    assert "\x1b[" not in out  # not a terminal: no live view, no escape codes
    assert "note: 'tiny' is a small model trained in the project" in out
    assert "tiny_llm_ref" in out
    assert re.search(r"^blas: ", out, re.M)

    chunks = defaultdict(list)  # request -> [(k, tokens, done, total)]
    for m in PREFILL_LINE.finditer(out):
        chunks[int(m[1])].append(tuple(map(int, m.groups()[1:])))
    assert sorted(chunks) == [0, 1, 2]
    for req, seen in chunks.items():
        total = seen[0][3]
        n = math.ceil(total / step)
        assert n > 1, "the prompts should need several chunks at --prefill-step 16"
        assert [k for k, *_ in seen] == list(range(1, n + 1)), f"request {req}: {seen}"
        done = [min(k * step, total) for k in range(1, n + 1)]
        assert [d for *_, d, _ in seen] == done
        assert [t for _, t, _, _ in seen] == [b - a for a, b in zip([0, *done], done)]
    for req in range(3):
        assert re.search(rf"finish\s+req\s+{req}\s+\d+ tokens", out)
    check_answers(out, 3)
    for what in ("time to first token", "tokens/s", "longest decode gap"):
        assert what in out


def test_prefill_shown_as_it_happened(demo, tmp_path, monkeypatch, capsys):
    """A solution that prefills whole prompts whatever the budget (Week 3 Day 1's) shows one
    chunk per prompt: the display counts the reported chunks, not num_prefill_chunks."""
    import tiny_llm_ref

    chunked = tiny_llm_ref.Request.try_prefill

    def whole_prompt(request):
        step, request.prefill_max_step = request.prefill_max_step, len(request.prompt_tokens)
        try:
            chunked(request)
        finally:
            request.prefill_max_step = step

    monkeypatch.setattr(tiny_llm_ref.Request, "try_prefill", whole_prompt)
    args = ["--num-prompts", "3", "--max-seq-len", "96", "--prefill-step", "16", "--plain"]
    assert demo.main([*args, "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    seen = [tuple(map(int, m.groups())) for m in PREFILL_LINE.finditer(out)]
    assert len(seen) == 3
    for _, k, tokens, done, total in seen:
        assert (k, tokens, done) == (1, total, total)


def test_unfinished_skeleton_names_the_task(tmp_path):
    result = run_demo(
        tmp_path, "--solution", "tiny_llm", "--num-prompts", "2", "--max-seq-len", "96"
    )
    if result.returncode == 0:  # tiny_llm is complete: then it must answer like the reference
        check_answers(result.stdout, 2)
        return
    assert result.returncode == 1
    assert TASK.search(result.stderr), result.stderr
    assert "--solution ref" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_unfinished_package_message(tmp_path):
    """The same error path, deterministic: a stand-in tiny_llm whose model is a stub."""
    pkg = tmp_path / "stub" / "tiny_llm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "class Qwen3Model:\n"
        "    def __init__(self, ckpt, max_seq_len=None):\n"
        "        raise NotImplementedError('Week 1 Day 2, Task 1: precompute the RoPE tables')\n"
    )
    env = offline_env(tmp_path, PYTHONPATH=str(tmp_path / "stub"))
    result = run_demo(tmp_path, "--solution", "tiny_llm", "--num-prompts", "1", env=env)
    assert result.returncode == 1
    assert "Week 1 Day 2, Task 1: precompute the RoPE tables" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_weights_not_available_says_how_to_fetch(demo, tmp_path, monkeypatch, capsys):
    def no_network(repo_id, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    assert demo.main(["--model", "qwen3-0.6b", "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--model tiny" in err
    assert "download Qwen/Qwen3-0.6B" in err
    assert "Traceback" not in err


def test_unknown_model_lists_the_shortcuts(demo, tmp_path, capsys):
    assert demo.main(["--model", "no-such-model", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err
    for name in ["tiny", *SHORTCUTS]:
        assert name in err


@pytest.mark.parametrize("how", ["directory", "shortcut"])
def test_hf_layout_checkpoint_loads_like_a_download(demo, tmp_path, monkeypatch, capsys, how):
    """A checkpoint in Hugging Face layout (sharded, with an index) runs when given as a
    directory, and when snapshot_download hands it back for a shortcut name."""
    ckpt = make_tiny_checkpoint(tmp_path / "Qwen3-local", seed=3, shards=2)
    if how == "directory":
        model = str(ckpt)
    else:
        model = "qwen3-0.6b"
        monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(ckpt))
    args = [
        "--model",
        model,
        "--num-prompts",
        "2",
        "--max-seq-len",
        "80",
        "--plain",
        "--device",
        "cpu",
    ]
    assert demo.main([*args, "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert f"({ckpt})" in out  # the header names the directory it loaded
    assert not (tmp_path / "cache").exists()  # the tiny checkpoint was not used
    check_answers(out, 2)


def test_live_view_draws_passes_prefills_and_slots(tmp_path):
    """The rich view, fed by the reference's batch_generate, on a console in memory."""
    import io

    from rich.console import Console

    import tiny_llm_ref
    from tiny_llm_support import load_checkpoint
    from tiny_llm_support.batch_recorder import BatchRecorder
    from tiny_llm_support.batch_views import LiveView

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "tiny"))
    model = tiny_llm_ref.Qwen3Model(ckpt)
    console = Console(file=io.StringIO(), width=120, color_system=None, markup=False)
    rec, view = BatchRecorder(), LiveView(console, "test", 2, batch_size=2)
    frames = []

    def on_step(step):
        rec.on_step(step)
        view.show(step, rec)
        if step.kind in ("prefill", "decode", "finish"):  # not the scheduling events
            with console.capture() as capture:
                console.print(view.render(rec))
            frames.append(capture.get())

    prompts = [list(range(1, 30)), list(range(40, 50))]
    with view:
        tiny_llm_ref.batch_generate(
            model, ckpt.tokenizer, prompts, 64, 2, 8, on_step=on_step, max_new_tokens=6
        )
    first, second = frames[0], frames[1]  # request 0: chunk 1, then a decode-less chunk 2
    assert "pass 1: prefill req 0 (8 tokens)" in first
    assert "prefill request 0 chunk 1: 8 tokens" in first and "8/29 tokens, in progress" in first
    assert "chunk 2: 8 tokens" in second and "16/29 tokens" in second
    last_prefill = next(f for f in frames if "29/29 tokens, done, now decoding" in f)
    assert "chunk 4: 5 tokens" in last_prefill
    assert any("decode 2 rows" in f for f in frames)  # a pass with both requests decoding
    assert "finished 2/2" in frames[-1]
    assert "request 1 finished: 6 tokens" in frames[-1]
