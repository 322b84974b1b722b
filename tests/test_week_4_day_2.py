"""Week 4 Day 2: tensor parallelism.

Task 1  rank_slice, ColumnParallelLinear, RowParallelLinear (tensor_parallel.py): a rank's
        share of a weight, and all_sum after the row-parallel product.
Task 2  TensorParallelAttention (qwen3.py): this rank's query and KV heads, o_proj row-parallel.
Task 3  TensorParallelMLP (tensor_parallel.py): gate/up column-parallel, down_proj row-parallel.
Task 4  shard_blocks (qwen3.py), behind Qwen3Model.shard(group): check every split, shard every
        block.

Most checks need two processes. The module fixture starts two ranks once, with
`mlx.launch -n 2 --backend ring` on tests/tp_ranks.py; they run every check there and write
what they found to JSON files, and each test below reads one check from both ranks. The oracle
is the same package's unsharded model on the same weights, and mlx-lm's own shard(). A group
of one runs here, in this process.

The tests skip, saying why, only where the ring backend cannot start on this machine; with
TINY_LLM_REQUIRE_RANKS=1 (set by .ci/run) they fail instead.
"""

import re
from pathlib import Path

import mlx.core as mx
import pytest
import tp_ranks
from helpers import prompt_with_tokens, ranks_cannot_start, run_ranks

from tiny_llm_support import make_tiny_checkpoint

RANKS = 2
# Well inside pytest's limit of 300 s per test: a hang ends here, with a message saying where
# each rank was, and not in pytest-timeout's traceback of this process.
LAUNCH_TIMEOUT_S = 240


def launch_checks(impl, tmp: Path, *extra: str, timeout: float = LAUNCH_TIMEOUT_S) -> dict:
    """Run tests/tp_ranks.py on RANKS ranks: {rank: its JSON or None, "output": the launch's
    output}. Skips (fails under TINY_LLM_REQUIRE_RANKS=1) where two ranks cannot start."""
    ckpts = {
        "--ckpt": {"seed": 0},  # the tiny GQA model: 4 query heads, 2 KV heads
        "--ckpt-kv1": {"seed": 0, "num_key_value_heads": 1},
        "--ckpt-odd-mlp": {"seed": 0, "intermediate_size": 129},
    }
    args = ["--impl", impl.__name__, "--out", str(tmp), *extra]
    for flag, overrides in ckpts.items():
        args += [flag, str(make_tiny_checkpoint(tmp / flag.strip("-"), **overrides))]
    try:
        found = run_ranks(Path(tp_ranks.__file__), args, tmp, RANKS, timeout=timeout)
    except FileNotFoundError as e:  # no mlx.launch
        ranks_cannot_start(str(e))
    errors = {found[r].get("init_error") for r in range(RANKS) if found[r] is not None}
    if None not in errors and errors:
        ranks_cannot_start(f"mx.distributed.init(backend='ring') failed: {errors.pop()}")
    return found


@pytest.fixture(scope="module")
def two_ranks(impl, tmp_path_factory):
    """{rank: {"size": 2, "checks": {name: None or error text}, ...}, "output": launch output}."""
    return launch_checks(impl, tmp_path_factory.mktemp("two-ranks"))


def problem(found: dict, check: str) -> str | None:
    """Why `check` did not pass on every rank, or None. A rank that died comes first: the
    others' errors (a peer lost in the middle of an all_sum) follow from it."""
    reports = {r: found[r] or {} for r in range(RANKS)}
    for r, report in reports.items():
        if report.get("died"):
            return f"rank {r} of {RANKS} died in {report.get('running')}: {report['died']}"
    crashed = re.search(r"Node with rank (\d+) exited with code (-?\d+)", found["output"])
    if crashed:  # it could not even say why (a crash of the process itself)
        rank, code = crashed.groups()
        return f"rank {rank} of {RANKS} exited with status {code}\n{found['output']}"
    for r, report in reports.items():
        if check not in report.get("checks", {}):
            where = f"it was running {report['running']}" if report.get("running") else ""
            return f"rank {r} did not finish {check} ({where or 'no report'})\n{found['output']}"
        if report["size"] != RANKS:
            return f"rank {r} joined a group of {report['size']}"
        if report["checks"][check] is not None:
            return f"rank {r} of {RANKS}: {report['checks'][check]}"
    return None


def passed(found: dict, check: str) -> None:
    message = problem(found, check)
    if message is not None:
        pytest.fail(message, pytrace=False)


@pytest.mark.parametrize("check", [c.__name__ for c in tp_ranks.CHECKS])
def test_two_ranks(two_ranks, check):
    """One check of tests/tp_ranks.py (see its docstring there), on both ranks."""
    passed(two_ranks, check)


# --- a group of one, in this process ---------------------------------------------------------


def test_group_of_one_is_the_unsharded_model(impl, tiny_gqa_ckpt):
    """Sharding over a group of one keeps every weight and gives the very same numbers."""
    group = mx.distributed.init()  # not launched: a group of one
    assert group.size() == 1
    tokenizer = tiny_gqa_ckpt.tokenizer
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 9))
    full, sharded = impl.Qwen3Model(tiny_gqa_ckpt), impl.Qwen3Model(tiny_gqa_ckpt)
    sharded.shard(group)

    def run(model):
        cache = model.create_kv_cache()
        logits = [model(mx.array([ids[:5]]), 0, cache), model(mx.array([ids[5:]]), 5, cache)]
        return logits, impl.batch_generate(model, tokenizer, [ids, ids[:3]], 24, 2, 4)

    (got, got_text), (want, want_text) = run(sharded), run(full)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b).item(), "a group of one must change no number"
    assert got_text == want_text
    attn = sharded.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2), "a group of one keeps every head"
