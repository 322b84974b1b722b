"""The command line as a new user meets it: bad input, Ctrl-C and SIGTERM in main.py,
batch-main.py, serve.py, the benchmarks and the dev tools, on damaged copies of a tiny checkpoint.

Every bad input ends in one line that says what is wrong (with the file, the tensor or the
numbers) and a non-zero exit, never a traceback; Ctrl-C prints `interrupted` and exits 130,
leaving no process and no temporary file behind. Also pdm's pre_run hook: it syncs only when
pdm.lock or pyproject.toml changed. Not a day file: no network, the same on the skeleton.
"""

import importlib.util
import json
import math
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
        "-m", "benches", "chunked-prefill",
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
    elif how in EDITS:
        EDITS[how](path)
    return path


def edit_json(file: Path, **values) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **values}))


def poison(path: Path, name: str, value: float) -> None:
    """One element of tensor `name` set to `value` (NaN, inf)."""
    weights = path / "model.safetensors"
    tensors = dict(mx.load(str(weights)))
    flat = tensors[name].flatten()
    flat[3] = value
    tensors[name] = flat.reshape(tensors[name].shape)
    mx.save_safetensors(str(weights), tensors)


def shrink_vocab(path: Path, rows: int) -> None:
    """The config and the (tied) embedding `rows` tokens smaller than the tokenizer, as if
    the tokenizer came from another model."""
    weights = path / "model.safetensors"
    tensors = dict(mx.load(str(weights)))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed[: embed.shape[0] - rows]
    mx.save_safetensors(str(weights), tensors)
    edit_json(path / "config.json", vocab_size=embed.shape[0] - rows)


def shard_elsewhere(path: Path, absolute: bool) -> None:
    """model.safetensors moved to a folder beside the checkpoint, and an index that names it
    there: by an absolute path, or by one that goes up (`../`)."""
    other = path.parent / f"{path.name}-other"
    other.mkdir()
    (path / "model.safetensors").rename(other / "model.safetensors")
    entry = str(other / "model.safetensors") if absolute else f"../{other.name}/model.safetensors"
    names = mx.load(str(other / "model.safetensors"))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, entry)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def template(text: str):
    return lambda path: edit_json(path / "tokenizer_config.json", chat_template=text)


def config(**values):
    return lambda path: edit_json(path / "config.json", **values)


# checkpoints that load without complaint from the files alone, but hold something wrong
EDITS = {
    "nan-weight": lambda path: poison(path, "model.layers.1.mlp.down_proj.weight", math.nan),
    "inf-weight": lambda path: poison(path, "model.norm.weight", -math.inf),
    "big-tokenizer": lambda path: shrink_vocab(path, 8),
    "rope-nan": config(rope_theta=math.nan),
    "layers-1e9": config(num_hidden_layers=1e9),
    "positions-1e12": config(max_position_embeddings=10**12),
    "index-up": lambda path: shard_elsewhere(path, absolute=False),
    "index-absolute": lambda path: shard_elsewhere(path, absolute=True),
    "template-syntax": template("{% if %}{{ messages }}"),
    "template-sandbox": template("{{ messages.__class__.__mro__[1].__subclasses__() }}"),
    "template-raises": template("{{ raise_exception('roles must alternate user/assistant') }}"),
    "template-type": template("{{ messages + 1 }}"),
    "template-loop": template(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
    "template-repeat": template("{{ 'ab' * 10**9 }}"),
    "heads-5": config(num_attention_heads=5, num_key_value_heads=1),
    "kv-heads-1": config(num_key_value_heads=1),
    "mlp-129": config(intermediate_size=129),
    "experts-3": config(
        model_type="qwen3_moe", num_experts=3, num_experts_per_tok=1, moe_intermediate_size=32
    ),
}


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


# --- the bad-input table --------------------------------------------------------------------
# Each kind of bad input that a new user's first hour turned up, as (entry points, arguments,
# exit status, words the error line must hold). Every entry point named runs the case through
# its main(argv), in this process (a subprocess would cost a second or two a case), and must
# end with that status and one error line, no traceback. `@how` in the arguments stands for
# damaged_copy(good, tmp_path, how), and `%name` the path tmp_path/name, where tmp_path holds
# a file `a-file` and a folder `a-folder`. A new entry point joins by its name in ENTRY_POINTS
# and in the cases that apply to it (ALL: every demo that loads a checkpoint; BENCHES: every
# benchmark, which checks its model and its output before its first run).

ENTRY_POINTS = {
    "main": ["main.py", "--max-tokens", "2"],
    "batch-main": ["batch-main.py", "--num-prompts", "2", "--max-seq-len", "96", "--plain"],
    "serve": ["serve.py", "--port", "0", "--max-seq-len", "96"],
    "bench-chunked-prefill": ["benches.chunked_prefill"],
    "bench-flash-attention": ["benches.flash_attention", "--no-openblas"],
    "bench-model": ["benches.model", "--no-openblas"],
    "bench-prefix-cache": ["benches.prefix_cache"],
    "bench-quantization": ["benches.quantization"],
    "bench-serving-overhead": ["benches.serving_overhead"],
    "bench-token-delivery": ["benches.token_delivery"],
    "bench-shape-stable": ["benches.shape_stable"],
    "bench-speculative": ["benches.speculative"],
    "bench-tensor-parallel": ["benches.tensor_parallel"],
    "bench-long-context": ["benches.long_context", "--no-openblas"],
    "bench-moe": ["benches.moe", "--no-openblas"],
    "bench-serving": ["benches.serving", "--servers", "tiny-llm", "--no-openblas"],
    "bench-structured-output": ["benches.structured_output"],
    "bench-ragged-step": ["benches.ragged_step"],
    "bench-own-kernel": ["benches.own_kernel"],
    "bench-paged-decode": ["benches.paged_decode"],
    "bench-few-row": ["benches.few_row"],
}
ALL = ("main", "batch-main", "serve")
SERVERS = ("batch-main", "serve")  # the scheduler's flags
RANKS = ("main", "batch-main")  # --tp
BENCHES = tuple(name for name in ENTRY_POINTS if name.startswith("bench-"))
# the benchmarks that check a checkpoint's --model before their first run (the others have their
# own fixed shapes), and those of them that read its weights (bench-quantization takes only its
# shape, with random weights)
NO_CHECKPOINT = ("bench-moe", "bench-structured-output", "bench-ragged-step", "bench-own-kernel",
                 "bench-paged-decode", "bench-few-row")  # fmt: skip
BENCH_MODELS = tuple(b for b in BENCHES if b not in NO_CHECKPOINT)
BENCH_WEIGHTS = tuple(b for b in BENCH_MODELS if b != "bench-quantization")

SILENT_WRONG_ANSWERS = [
    (ALL, ["--model", "@nan-weight"], 1,
     ["model.safetensors: tensor model.layers.1.mlp.down_proj.weight", "NaN or infinite"]),
    (ALL, ["--model", "@inf-weight"], 1, ["tensor model.norm.weight", "NaN or infinite"]),
    (ALL, ["--model", "@big-tokenizer"], 1,
     ["tokenizer.json: the tokenizer has token ids up to 660", "vocab_size is 653"]),
    (ALL, ["--model", "@rope-nan"], 1, ["config.json: rope_theta", "positive finite", "nan"]),
    (["main"], ["--prompt", ""], 1, ["the prompt is empty or only whitespace"]),
    (["main"], ["--prompt", "   "], 1, ["the prompt is empty or only whitespace"]),
    (["main"], ["--prompt", "\n\t "], 1, ["the prompt is empty or only whitespace"]),
]  # fmt: skip

CHECKPOINT_CONTENTS = [
    (ALL, ["--model", "@index-up"], 1,
     ["model.safetensors.index.json: weight_map puts", "'../", "outside the checkpoint"]),
    (ALL, ["--model", "@index-absolute"], 1,
     ["model.safetensors.index.json: weight_map puts", "'/", "outside the checkpoint"]),
    (ALL, ["--model", "@template-syntax"], 1,
     ["tokenizer_config.json: the chat template failed", "line 1"]),
    (ALL, ["--model", "@template-sandbox"], 1,
     ["tokenizer_config.json: the chat template was refused by the sandbox", "unsafe"]),
    (ALL, ["--model", "@template-raises"], 1,
     ["tokenizer_config.json: the chat template failed: roles must alternate"]),
    (ALL, ["--model", "@template-type"], 1,
     ["tokenizer_config.json: the chat template failed", "list"]),
    (ALL, ["--model", "@template-loop"], 1,
     ["tokenizer_config.json: the chat template ran too long", "more than 5 s (a loop?)"]),
    (ALL, ["--model", "@template-repeat"], 1,
     ["tokenizer_config.json: the chat template was refused by the sandbox", "too much"]),
    (BENCH_MODELS, ["--model", "@config-json"], 1, ["config.json: not valid JSON"]),
    (BENCH_MODELS, ["--model", "@config-list"], 1, ["config.json: expected a JSON object"]),
    (BENCH_WEIGHTS, ["--model", "@half"], 1,
     ["model.safetensors: truncated or not a safetensors file"]),
    (BENCH_WEIGHTS, ["--model", "@five-bytes"], 1, ["model.safetensors: not a safetensors file"]),
]  # fmt: skip

NUMBERS_MLX_CANNOT_TAKE = [
    (["main"], ["--seed", "-1"], 2, ["--seed", "expected an integer >= 0, got -1"]),
    (["main"], ["--seed", str(2**70)], 2, ["--seed", f"<= {2**64 - 1}, got {2**70}"]),
    (SERVERS, ["--page-size", "1000000000"], 2, ["--page-size 1000000000", "--max-seq-len 96"]),
    (["serve"], ["--dense", "--batch-size", "1000000000"], 2,
     ["--batch-size 1000000000 rows of --max-seq-len 96 tokens need", "GiB of KV cache"]),
    (["serve"], ["--batch-size", "1000000000"], 2,
     ["--memory-fraction 0.5 of the", "too few for --batch-size 1000000000"]),
    (["serve"], ["--max-pages", "64", "--batch-size", "100"], 2,
     ["--batch-size 100 is more than --max-pages 64"]),
    (ALL, ["--model", "@layers-1e9"], 1,
     ["config.json: num_hidden_layers is 1000000000", "at most 1024 layers"]),
    (ALL, ["--model", "@positions-1e12"], 1,
     ["config.json: max_position_embeddings is 1000000000000", "at most 1048576 positions"]),
]  # fmt: skip

TOO_MANY_RANKS = max(2, os.cpu_count() or 1) + 1  # more than this machine runs without a hostfile

# refused before any rank starts (the status of a rank that fails: test_a_failed_rank_...)
WRONG_EXIT_STATUS = [
    (RANKS, ["--tp", "0"], 2, ["--tp", "expected an integer >= 1, got 0"]),
    (RANKS, ["--tp", "65"], 2, ["--tp", "expected an integer <= 64, got 65"]),
    (RANKS, ["--tp", str(TOO_MANY_RANKS)], 2, ["--tp", str(TOO_MANY_RANKS)]),
    (RANKS, ["--model", "@heads-5", "--tp", "2"], 2,
     ["--tp 2: the model's num_attention_heads (5) does not divide into 2 equal shares"]),
    (RANKS, ["--model", "@kv-heads-1", "--tp", "2"], 2, ["--tp 2", "num_key_value_heads (1)"]),
    (RANKS, ["--model", "@mlp-129", "--tp", "2"], 2, ["--tp 2", "intermediate_size (129)"]),
    (RANKS, ["--model", "@experts-3", "--tp", "2"], 2, ["--tp 2", "num_experts (3)"]),
    (RANKS, ["--model", "@config-json", "--tp", "2"], 1, ["config.json: not valid JSON"]),
]  # fmt: skip

# an output the benchmark could not write at the end, refused before its first run
OUTPUT_PATHS = [
    (BENCHES, ["--json-output", "%a-folder"], 2, ["a-folder is a directory"]),
    (BENCHES, ["--json-output", "%a-file/out.json"], 2,
     ["cannot write", "a-file/out.json", "a-file is not a folder"]),
    (BENCHES, ["--json-output", "/proc/out.json"], 2,
     ["cannot write /proc/out.json: no file can be made in /proc"]),
    (["bench-chunked-prefill", "bench-flash-attention", "bench-prefix-cache"],
     ["--plot-output", "%a-file/out.png"], 2, ["cannot write", "a-file is not a folder"]),
]  # fmt: skip


def test_every_benchmark_command_is_checked_here():
    """Each `pdm run bench-*` of pyproject.toml has its entry in ENTRY_POINTS, so that its bad
    output paths (and, taking a checkpoint, bad checkpoints) are refused before its first run."""
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is Python 3.11+
    commands = set(re.findall(r"^(bench-[a-z-]+) = ", pyproject, flags=re.MULTILINE))
    assert "bench-model" in commands
    missing = sorted(commands - set(BENCHES))
    assert not missing, f"add {missing} to ENTRY_POINTS (and NO_CHECKPOINT if it takes no --model)"


def each(table: list, kind: str) -> list:
    """(entry point, arguments, status, words) for every entry point a case names."""
    return [
        pytest.param(tool, args, status, words, id=f"{kind}{tool}-{'-'.join(args)[:40]}")
        for tools, args, status, words in table
        for tool in tools
    ]


@pytest.fixture(scope="module")
def entry_points() -> dict:
    """Each entry point's script loaded as a module (their names have dashes); a benchmark is
    the module benches.NAME."""
    sys.path.insert(0, str(ROOT))
    modules = {}
    for name, (script, *_) in ENTRY_POINTS.items():
        if script.startswith("benches."):
            modules[name] = importlib.import_module(script)
            continue
        spec = importlib.util.spec_from_file_location(
            name.replace("-", "_") + "_script", ROOT / script
        )
        modules[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = modules[name]  # dataclasses look their module up by name
        spec.loader.exec_module(modules[name])
    yield modules
    for module in modules.values():
        if not module.__name__.startswith("benches."):
            sys.modules.pop(module.__name__, None)
    sys.path.remove(str(ROOT))


def argument(text: str, good: Path, tmp_path: Path) -> str:
    """`@how`: a damaged copy of the checkpoint; `%name`: tmp_path/name; else the text."""
    if text.startswith("@"):
        return str(damaged_copy(good, tmp_path, text[1:]))
    return str(tmp_path / text[1:]) if text.startswith("%") else text


def refused(entry_points, capsys, good, tmp_path, tool, args, status, words) -> None:
    """Run the case; check the status and the one error line (after argparse's usage)."""
    _, *fixed = ENTRY_POINTS[tool]
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    args = [argument(a, good, tmp_path) for a in args]
    try:
        got = entry_points[tool].main([*fixed, *args])
    except SystemExit as e:  # argparse, or a message that Python prints with status 1
        got = e.code
        if isinstance(got, str):
            print(got, file=sys.stderr)
            got = 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert got == status, err[-3000:]
    assert lines and "error: " in lines[-1], err[-3000:]
    assert len(lines) == 1 or lines[0].startswith("usage: "), err[-3000:]
    for word in words:
        assert word in lines[-1], f"{word!r} not in {lines[-1]!r}"


BAD_INPUT = {
    "silent-wrong-answer": SILENT_WRONG_ANSWERS,
    "checkpoint-contents": CHECKPOINT_CONTENTS,
    "number-mlx-cannot-take": NUMBERS_MLX_CANNOT_TAKE,
    "wrong-exit-status": WRONG_EXIT_STATUS,
    "output-path": OUTPUT_PATHS,
}


@pytest.mark.parametrize(
    "tool, args, status, words",
    [case for kind, table in BAD_INPUT.items() for case in each(table, kind + ":")],
)
def test_bad_input_is_refused(entry_points, capsys, good, tmp_path, tool, args, status, words):
    refused(entry_points, capsys, good, tmp_path, tool, args, status, words)


def test_batch_main_has_no_more_slots_than_prompts(entry_points, capsys):
    """A batch size far past what memory holds is harmless: only two prompts run."""
    _, *fixed = ENTRY_POINTS["batch-main"]
    assert entry_points["batch-main"].main([*fixed, "--batch-size", "1000000000"]) == 0
    assert "batch size 2 " in capsys.readouterr().out


@pytest.mark.parametrize("tool", ["main", "batch-main"])
def test_a_closed_pipe_ends_quietly(tmp_path, tool):
    """`python main.py | head -1`, with the reader gone before the first line, so that the
    first write fails whatever the timing: no word on stderr, status 141 (128 + SIGPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, *TOOLS[tool]],
            cwd=ROOT, env=env_for(tmp_path), stdin=subprocess.DEVNULL, stdout=write_end,
            stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


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


# --- SIGTERM, and Ctrl-C elsewhere ------------------------------------------------------------
# (command, signal, when: once a process it started runs in $TMPDIR, or after so many seconds).
# Every one must end with the one word and the status of the signal, its temporary files and
# processes gone and no output written.

SIGNALS = [
    (["-m", "benches", "flash-attention", "--no-openblas", "--lengths", "256", "--contexts", "128",
      "--batches", "1", "--num-layers", "1", "--repeats", "1000", "--json-output", "%out.json"],
     signal.SIGTERM, 3),
    (["-m", "benches", "shape-stable", "--model", "tiny", "--json-output", "%out.json"],
     signal.SIGINT, "child"),
    (["-m", "benches", "quantization", "--model", "tiny", "--contexts", "256", "--parts", "agreement",
      "--agreement-tokens", "1000", "--json-output", "%out.json"], signal.SIGINT, 3),
    (["scripts/train-tiny.py", "--out", "%out"], signal.SIGTERM, 3),
    (["scripts/dev-tools.py", "check-course", "--week", "1", "--day", "1"],
     signal.SIGTERM, "child"),
]  # fmt: skip


@pytest.mark.parametrize(
    "command, sig, when",
    SIGNALS,
    ids=[f"{c[2] if c[0] == '-m' else c[0]}-{s.name}" for c, s, _ in SIGNALS],
)
def test_signals_end_every_command_quietly_and_clean(tmp_path, command, sig, when):
    tmp = str(tmp_path / "tmp")
    proc = start(tmp_path, *[argument(a, None, tmp_path) for a in command])
    deadline = time.monotonic() + (60 if when == "child" else when)
    while time.monotonic() < deadline and not (when == "child" and processes_mentioning(tmp)):
        assert proc.poll() is None, f"ended before the signal: {proc.stderr.read()[-3000:]}"
        time.sleep(0.1)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # as the terminal sends Ctrl-C
    else:
        proc.send_signal(sig)  # as `kill` does
    _, err = proc.communicate(timeout=60)
    word = "interrupted" if sig == signal.SIGINT else "terminated"
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.count(word) == 1 and err.rstrip().endswith(word), err[-3000:]
    time.sleep(0.5)
    assert not processes_mentioning(tmp), "a process it started was left"
    assert not list((tmp_path / "tmp").iterdir()), "a temporary file was left behind"
    assert not list(tmp_path.glob("out*")), "an output of the stopped run was written"


# --- a tensor-parallel rank that fails ----------------------------------------------------------

RANK_ENDS = [  # (what mlx.launch writes on its stderr, the line for the rank that failed)
    (["error: x/model.safetensors: truncated\n",
      "\x1b[33m[WARN] Node with rank 1 exited with code 1 \x1b[0m\n",
      "[WARN] Node with rank 0 exited with code -15\n"],
     "rank 1 of 2 failed: x/model.safetensors: truncated"),
    (["[WARN] Node with rank 0 exited with code 143\n", "error: ValueError: no (x.py:3, in f)\n",
      "[WARN] Node with rank 2 exited with code 1\n"],
     "rank 2 of 3 failed: ValueError: no (x.py:3, in f)"),
    (["[WARN] Node with rank 0 exited with code -15\n",
      "[WARN] Node with rank 1 exited with code -9\n"],
     "rank 1 of 2 failed: it was killed by SIGKILL"),
    (["[WARN] Node with rank 1 exited with code 3\n"],
     "rank 1 of 2 failed: it exited with status 3"),
    (["[WARN] Node with rank 0 was killed\n"], "rank 0 of 2 failed: mlx.launch killed it"),
    (["a warning of rank 0\n"], None),
]  # fmt: skip


@pytest.mark.parametrize("lines, failure", RANK_ENDS)
def test_the_rank_that_failed_is_named_with_its_reason(capsys, lines, failure):
    from tiny_llm_support.launch import RankEnds

    ranks = int(re.search(r"of (\d+)", failure)[1]) if failure else 2
    ends = RankEnds(ranks)
    ends.read(iter(lines))
    assert ends.failure() == failure
    passed = [line for line in lines if "Node with rank" not in line and "error: " not in line]
    assert capsys.readouterr().err == "".join(passed)  # the rest reaches stderr unchanged


def test_a_rank_reports_an_error_in_one_line_and_a_signal_not_at_all(monkeypatch, capsys):
    """In a process mlx.launch started: no traceback, and no word when it is stopped (the
    command that started the ranks speaks for them)."""
    from tiny_llm_support import startup

    def fails():
        raise IndexError("list index out of range")

    def stopped(error):
        def run():
            raise error

        return run

    monkeypatch.setenv(startup.RANK_ENV, "1")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert startup.run(fails) == 1
        line = capsys.readouterr().err
        assert line.startswith("error: IndexError: list index out of range (test_cli.py:")
        assert line.endswith(", in fails)\n")
        assert startup.run(stopped(KeyboardInterrupt())) == 130
        assert startup.run(stopped(startup.Terminated())) == 143
        assert capsys.readouterr().err == ""
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@needs_ring
def test_a_failed_rank_fails_the_command_naming_it(good, tmp_path):
    """The checkpoint reads as one until the ranks load its weights: every rank fails, and
    the command says which one first, and why, in one line (mlx.launch itself exits 0)."""
    path = damaged_copy(good, tmp_path, "half")
    result = run_tool(tmp_path, "main", "--model", str(path), "--tp", "2")
    assert result.returncode == 1
    line = the_error(result, "main")
    assert re.fullmatch(r"error: rank [01] of 2 failed: .*model\.safetensors: truncated.*", line)


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
