"""The batch-main demo: the tiny model end to end, and its error messages.

Not a day file: these tests check the demo script, not an exercise, so they may pass on the
untouched skeleton. They need no network: the tiny checkpoint is made under tmp_path.
"""

import importlib.util
import io
import math
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from contextlib import redirect_stdout
from pathlib import Path

import huggingface_hub
import pytest
from helpers import offline_env

from tiny_llm_support import SHORTCUTS, make_tiny_checkpoint, make_tiny_moe_checkpoint

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


@pytest.mark.parametrize("how", ["directory", "shortcut", "moe-directory"])
def test_hf_layout_checkpoint_loads_like_a_download(demo, tmp_path, monkeypatch, capsys, how):
    """A checkpoint in Hugging Face layout (sharded, with an index) runs when given as a
    directory, and when snapshot_download hands it back for a shortcut name; a Qwen3-MoE
    checkpoint (Week 4 Day 6, one tensor per expert) runs from its directory."""
    make = make_tiny_moe_checkpoint if how == "moe-directory" else make_tiny_checkpoint
    ckpt = make(tmp_path / "Qwen3-local", seed=3, shards=2)
    if how != "shortcut":
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
    assert "pass 1" not in first  # a pass is shown once all its events are in
    assert "prefill request 0 chunk 1: 8 tokens" in first and "8/29 tokens, in progress" in first
    assert "pass 1: prefill req 0 (8 tokens)" in second
    assert "chunk 2: 8 tokens" in second and "16/29 tokens" in second
    last_prefill = next(f for f in frames if "29/29 tokens, done, now decoding" in f)
    assert "chunk 4: 5 tokens" in last_prefill
    assert any("decode 2 rows" in f for f in frames)  # a pass with both requests decoding
    assert "finished 2/2" in frames[-1]
    assert "request 1 finished: 6 tokens" in frames[-1]


# --- the scheduler settings of Week 3 (tiny_llm_support.batch_settings) -------------------

SMALL = ["--num-prompts", "6", "--max-seq-len", "96", "--prefill-step", "16", "--plain"]
PLAIN_LINE = re.compile(r"^\s*[\d.]+s pass\s+(\d+)\s+(prefill|decode|finish)", re.M)


def answers(out: str) -> list[str]:
    """The answer lines (first lines of each answer), in prompt order."""
    return re.findall(r"^answer \d+: (.*)$", out, re.M)


def demo_run(demo, capsys, tmp_path, *args: str) -> str:
    code = demo.main([*SMALL, *args, "--cache-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


@pytest.fixture(scope="module")
def eager_answers(demo, tmp_path_factory):
    """The answers of the default settings (alternate policy, eager, dense caches)."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert demo.main([*SMALL, "--cache-dir", str(tmp_path_factory.mktemp("cache"))]) == 0
    return answers(out.getvalue())


def test_compile_pads_and_answers_like_eager(demo, capsys, tmp_path, eager_answers):
    out = demo_run(demo, capsys, tmp_path, "--compile")
    assert "compiled, padded chunks" in out
    compiles = re.search(r"^compiled: (\d+) variants compiled, (\d+) reused", out, re.M)
    assert compiles and int(compiles[1]) > 0 and int(compiles[2]) > 0
    assert answers(out) == eager_answers  # greedy text is the same, padding or not


def test_hybrid_policy_shows_decode_rows_and_chunks_in_one_pass(
    demo, capsys, tmp_path, eager_answers
):
    out = demo_run(demo, capsys, tmp_path, "--policy", "hybrid", "--log-every", "1")
    assert "hybrid policy (one pass: decode rows + prompt chunks, 16 rows)" in out
    kinds = defaultdict(set)  # pass number -> what its lines report
    for number, kind in PLAIN_LINE.findall(out):
        kinds[int(number)].add(kind)
    assert any({"prefill", "decode"} <= k for k in kinds.values()), "no pass held both"
    assert answers(out) == eager_answers


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_small_page_pool_completes_every_prompt_with_preemptions(
    demo, capsys, tmp_path, eager_answers, policy
):
    """8 pages of 16 tokens hold one request of --max-seq-len 96 and a bit: the others wait
    or are preempted, and every answer is what the unbounded run gave (greedy)."""
    out = demo_run(demo, capsys, tmp_path, "--max-pages", "8", "--policy", policy)
    assert "paged KV: 8 pages of 16 tokens (128 in all) per layer, read in place" in out
    check_answers(out, 6)
    assert answers(out) == eager_answers
    assert re.search(r"pass\s+\d+\s+request \d+ preempted: its pages went back", out)
    assert re.search(r"pass\s+\d+\s+request \d+ waits for free pages", out)
    pool = re.search(r"^page pool: (\d+) preemptions \((\d+) tokens prefilled again\)", out, re.M)
    assert pool and int(pool[1]) > 0 and int(pool[2]) > 0
    assert re.search(r"^req .* preempted\s+stop$", out, re.M)  # the summary's column
    assert re.search(r"^pages: at most 8 of 8 in use per layer, 0 at the end", out, re.M)


def test_gather_reads_pages_without_flash_attention(demo, capsys, tmp_path, eager_answers):
    out = demo_run(demo, capsys, tmp_path, "--page-size", "8", "--gather")
    assert "paged KV: pages of 8 tokens per layer, gathered" in out
    assert answers(out) == eager_answers


def test_prefix_cache_shares_the_paragraph_and_answers_the_same(demo, capsys, tmp_path):
    """Week 4 Day 4: with the four Harrowfield prompts in (a longer --max-seq-len), the later
    three find the paragraph's full pages cached; the answers are those of the same pool
    without the cache. Off unless asked for."""
    wider = ["--num-prompts", "10", "--max-seq-len", "320", "--prefill-step", "64"]
    plain = demo_run(demo, capsys, tmp_path, *wider, "--page-size", "16")
    assert "read in place, no prefix cache" in plain and "prefix cache:" not in plain
    out = demo_run(demo, capsys, tmp_path, *wider, "--page-size", "16", "--prefix-cache")
    assert "paged KV: pages of 16 tokens per layer, read in place, prefix cache" in out
    assert "4 sharing the Harrowfield paragraph" in out
    check_answers(out, 10)
    assert answers(out) == answers(plain)
    found = re.search(r"^prefix cache: (\d+) tokens found cached at admissions", out, re.M)
    assert found and int(found[1]) > 0 and int(found[1]) % 16 == 0
    # the prompt tokens run through the model: fewer by exactly what was found
    prefilled = [int(re.search(r"^prefill: (\d+) tokens", o, re.M)[1]) for o in (plain, out)]
    assert prefilled[0] - prefilled[1] == int(found[1])


def test_speculative_brings_the_hybrid_policy(demo):
    """Week 4 Day 5: the policy is alternate unless --speculative asks for hybrid."""
    plain = demo.parse_args(SMALL)
    assert (plain.policy, plain.speculative, plain.num_draft_tokens) == ("alternate", None, None)
    spec = demo.parse_args([*SMALL, "--speculative", "ngram"])
    assert (spec.policy, spec.speculative, spec.num_draft_tokens) == ("hybrid", "ngram", 4)
    apart = demo.parse_args([*SMALL, "--speculative", "ngram", "--policy", "alternate"])
    assert apart.policy == "alternate", "an explicit --policy alternate stays (4.5 runs under it)"


@pytest.mark.parametrize("source, how", [("ngram", "prompt lookup"), ("tiny", "draft model tiny")])
def test_speculative_answers_like_plain_decoding(
    demo, capsys, tmp_path, eager_answers, source, how
):
    """Week 4 Day 5: guesses checked in the hybrid pass change no greedy answer; the run ends
    with the guesses made and kept (the draft is the model itself: it guesses right)."""
    out = demo_run(demo, capsys, tmp_path, "--speculative", source, "--num-draft-tokens", "3")
    assert f"speculative decoding: {how}, up to 3 guesses per request and pass" in out
    assert "hybrid policy" in out
    check_answers(out, 6)
    assert answers(out) == eager_answers
    counts = re.search(r"^speculative decoding: (\d+) tokens proposed, (\d+) accepted", out, re.M)
    assert counts, out
    proposed, accepted = int(counts[1]), int(counts[2])
    assert 0 < accepted <= proposed
    if source == "tiny":
        assert accepted > proposed / 2


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--max-pages", "4"],
            "--max-pages 4 of 16 tokens hold 64 tokens, but one request may grow to "
            "--max-seq-len 96 tokens (6 pages)",
        ),
        (["--gather"], "--gather is about reading KV pages: add --max-pages N"),
        (
            ["--prefix-cache"],
            "--prefix-cache shares KV pages between prompts, and dense caches have none: add "
            "--max-pages N",
        ),
        (["--policy", "fastest"], "invalid choice: 'fastest'"),
        (
            ["--num-draft-tokens", "2"],
            "--num-draft-tokens is how many tokens --speculative guesses: add --speculative ngram",
        ),
    ],
)
def test_scheduler_settings_checked_before_anything_runs(demo, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args([*SMALL, *args])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def student_with(tmp_path: Path, unfinished: str) -> dict:
    """An environment whose tiny_llm is the reference except one module, taken from the
    skeleton: a student who has written every day but that one."""
    package = tmp_path / "student" / "tiny_llm"
    shutil.copytree(ROOT / "src" / "tiny_llm_ref", package)
    shutil.copy(ROOT / "src" / "tiny_llm" / f"{unfinished}.py", package / f"{unfinished}.py")
    return offline_env(tmp_path, PYTHONPATH=str(tmp_path / "student"))


@pytest.mark.parametrize(
    "unfinished, args, task",
    [
        ("shape_stable", ["--compile"], "Week 3 Day 3, Task"),
        ("stall_free", ["--policy", "hybrid"], "Week 3 Day 4, Task"),
        ("flash_attention", ["--max-pages", "8"], "Week 3 Day 5, Task"),
        ("memory_planning", ["--max-pages", "8", "--gather"], "Week 3 Day 6, Task"),
        ("prefix_cache", ["--max-pages", "8", "--prefix-cache"], "Week 4 Day 4, Task"),
        ("speculative", ["--speculative", "ngram"], "Week 4 Day 5, Task"),
    ],
)
def test_a_setting_whose_day_is_not_written_names_the_task(tmp_path, unfinished, args, task):
    env = student_with(tmp_path, unfinished)
    result = run_demo(tmp_path, *SMALL, "--solution", "tiny_llm", *args, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tiny_llm is not finished yet: "), lines
    assert task in lines[0]
    if unfinished == "flash_attention":  # pages read in place by default: say how to avoid it
        assert "--gather serves the pages without Week 3 Day 5" in lines[0]
    if unfinished == "prefix_cache":
        assert "--no-prefix-cache serves the pages without Week 4 Day 4" in lines[0]
    if unfinished == "speculative":
        assert "without --speculative batch-main runs without Week 4 Day 5" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr


def test_live_view_shows_pass_composition_and_the_page_pool(tmp_path):
    """Hybrid passes drawn whole (decode rows + chunk = rows), the pool's pages and the
    preemptions in the header, the scheduling events at the bottom."""
    from rich.console import Console

    import tiny_llm_ref
    from tiny_llm_support import load_checkpoint
    from tiny_llm_support.batch_recorder import BatchRecorder
    from tiny_llm_support.batch_views import LiveView

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "tiny"))
    model = tiny_llm_ref.Qwen3Model(ckpt)
    pools = model.create_kv_pools(page_size=4, max_pages=8)
    console = Console(file=io.StringIO(), width=140, color_system=None, markup=False)
    prompts = [list(range(5, 5 + n)) for n in (10, 12, 9, 14)]
    rec, view = BatchRecorder(), LiveView(console, "test", len(prompts), 3, pools)
    frames = []

    def on_step(step):
        rec.on_step(step)
        view.show(step, rec)
        with console.capture() as capture:
            console.print(view.render(rec))
        frames.append(capture.get())

    with view:
        tiny_llm_ref.batch_generate(
            model, ckpt.tokenizer, prompts, 64, 3, 8, pools=pools, on_step=on_step,
            max_new_tokens=12, ignore_eos=True, policy="hybrid",
        )  # fmt: skip
    text = "\n".join(frames)
    both = re.findall(
        r"pass \d+: decode (\d+) rows \+ prefill req \d+ \((\d+) tokens\) = (\d+) rows", text
    )
    assert both and all(int(d) + int(c) == int(total) for d, c, total in both)
    assert all(int(total) <= 8 for _, _, total in both)  # the budget, --prefill-step
    in_use = [int(n) for n in re.findall(r"pages in use (\d+)/8", text)]
    assert in_use and max(in_use) <= 8
    assert re.search(r"preemptions \d+", text) and "preempted: its pages went back" in text
