"""Week 4 Day 2: tensor parallelism.

Task 1  rank_slice, ColumnParallelLinear, RowParallelLinear: a rank's share of a weight, and
        all_sum after the row-parallel product.
Task 2  TensorParallelAttention: this rank's query and KV heads, o_proj row-parallel.
Task 3  TensorParallelMLP: gate/up column-parallel, down_proj row-parallel.
Task 4  shard_blocks, behind Qwen3Model.shard(group): check every split, shard every block.

Most checks need two processes. The module fixture starts two ranks once, with
`mlx.launch -n 2 --backend ring` on tests/tp_ranks.py; they run every check there and write
what they found to JSON files, and each test below reads one check from both ranks. The oracle
is the same package's unsharded model on the same weights, and mlx-lm's own shard(). A group
of one runs here, in this process.

The tests skip, saying why, only where the ring backend cannot start on this machine; with
TINY_LLM_REQUIRE_RANKS=1 (set by .ci/run) they fail instead.
"""

from pathlib import Path

import mlx.core as mx
import pytest
import tp_ranks
from helpers import prompt_with_tokens, ranks_cannot_start, run_ranks

from tiny_llm_support import make_tiny_checkpoint

RANKS = 2


@pytest.fixture(scope="module")
def two_ranks(impl, tmp_path_factory):
    """{rank: {"size": 2, "checks": {name: None or error text}}, "output": launch output}."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    ckpts = {
        "--ckpt": {"seed": 0},  # the tiny GQA model: 4 query heads, 2 KV heads
        "--ckpt-kv1": {"seed": 0, "num_key_value_heads": 1},
        "--ckpt-odd-mlp": {"seed": 0, "intermediate_size": 129},
    }
    args = ["--impl", impl.__name__, "--out", str(tmp)]
    for flag, overrides in ckpts.items():
        args += [flag, str(make_tiny_checkpoint(tmp / flag.strip("-"), **overrides))]
    try:
        found = run_ranks(Path(tp_ranks.__file__), args, tmp, RANKS)
    except FileNotFoundError as e:  # no mlx.launch
        ranks_cannot_start(str(e))
    errors = {found[r].get("init_error") for r in range(RANKS) if found[r] is not None}
    if None not in errors and errors:
        ranks_cannot_start(f"mx.distributed.init(backend='ring') failed: {errors.pop()}")
    return found


def passed(found: dict, check: str) -> None:
    for r in range(RANKS):
        checks = (found[r] or {}).get("checks", {})
        if check not in checks:
            pytest.fail(f"rank {r} did not finish {check}\n{found['output']}")
        assert found[r]["size"] == RANKS, f"rank {r} joined a group of {found[r]['size']}"
        if checks[check] is not None:
            pytest.fail(f"rank {r} of {RANKS}: {checks[check]}", pytrace=False)


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
