"""The tiny chat model shipped in the package, the default of `--model tiny`.

Not a day file: it checks the trained checkpoint and its training script with the reference
solution; the student package is not involved. No training of the shipped model happens here:
the training test runs a few steps of a much smaller model on a slice of the corpus, in tmp_path.
"""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from oracles import mlx_lm_logits

import tiny_llm_ref as ref
from tiny_llm_support import load_checkpoint, resolve_model
from tiny_llm_support.models import TINY_CHAT_DIR, TINY_RANDOM
from tiny_llm_support.tiny_corpus import CORPUS_FILE, file_sha256, read_corpus
from tiny_llm_support.train_tiny import LOG_FILE, RESULTS_DIR, SUMMARY_FILE, TrainSettings, train

ROOT = Path(__file__).resolve().parent.parent
MAX_SEQ_LEN = 512  # the demo's default
# Three of batch-main's built-in prompts and what their answers must say.
EXPECTED = {
    "Who built the bridge in Harrowfield, and when?": ["Odile Brask", "1742"],
    "What do most people in Harrowfield do for work?": ["paper mill", "orchards"],
    "What is 17 times 23? Show the steps.": ["391"],
}


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(resolve_model("tiny"), dtype="float32")


@pytest.fixture(scope="module")
def demo_prompts():
    """batch-main.py's built-in prompts, by question."""
    spec = importlib.util.spec_from_file_location("batch_main", ROOT / "batch-main.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["batch_main"] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        return {p.question: p.content() for p in module.DEMO_PROMPTS}
    finally:
        sys.modules.pop("batch_main", None)


def test_tiny_names_the_shipped_checkpoint(tmp_path):
    assert resolve_model("tiny") == TINY_CHAT_DIR
    random_dir = resolve_model(TINY_RANDOM, cache_dir=tmp_path)
    assert random_dir == tmp_path / "tiny-seed0"
    assert random_dir != TINY_CHAT_DIR


def test_shipped_checkpoint_is_what_train_tiny_wrote(ckpt):
    weights = TINY_CHAT_DIR / "model.safetensors"
    assert weights.stat().st_size <= 10 * 2**20
    stored = mx.load(str(weights))
    assert all(w.dtype == mx.float16 for w in stored.values()), "stored in 16 bits"
    assert all(w.dtype == mx.float32 for w in ckpt.weights.values()), "loaded as float32"
    assert ckpt.config.vocab_size == ckpt.tokenizer.vocab_size
    assert ckpt.tokenizer.chat_template
    summary = json.loads((RESULTS_DIR / SUMMARY_FILE).read_text())
    assert summary["weights_sha256"] == file_sha256(weights)
    assert summary["corpus"]["sha256"] == file_sha256(CORPUS_FILE), (
        "data/tiny-chat/corpus.jsonl changed since the shipped checkpoint was trained: "
        "run `pdm run train-tiny` and commit the new checkpoint"
    )
    with open(RESULTS_DIR / LOG_FILE) as f:
        assert sum(1 for _ in csv.DictReader(f)) == summary["steps"]


def test_reference_logits_match_mlx_lm(ckpt, demo_prompts):
    tok = ckpt.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": next(iter(demo_prompts.values()))}])
    tokens = mx.array([tok.encode(text)], dtype=mx.int32)
    model = ref.Qwen3Model(ckpt)
    logits = model(tokens, 0, model.create_kv_cache())
    np.testing.assert_allclose(
        np.array(logits), np.array(mlx_lm_logits(ckpt, tokens)), rtol=1e-4, atol=1e-4
    )


def test_greedy_answers_to_built_in_prompts(ckpt, demo_prompts):
    tok = ckpt.tokenizer
    questions = list(EXPECTED)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": demo_prompts[q]}]) for q in questions
    ]
    stops = {}

    def on_step(step):
        if step.kind == "finish":
            stops[step.request.prompt_idx] = step.request.generated[-1]

    model = ref.Qwen3Model(ckpt, max_seq_len=MAX_SEQ_LEN)
    results = dict(ref.batch_generate(model, tok, texts, MAX_SEQ_LEN, on_step=on_step))
    for idx, question in enumerate(questions):
        answer = results[idx]
        assert stops[idx] in tok.eos_token_ids, f"{question!r} ran to the length limit: {answer!r}"
        assert "\ufffd" not in answer
        for fact in EXPECTED[question]:
            assert fact in answer, f"{question!r}: {fact!r} missing from {answer!r}"


# --- the training script ----------------------------------------------------------------------


def small_corpus(path: Path) -> Path:
    """Two short book excerpts and eight Q&A pairs of the committed corpus."""
    docs = read_corpus(CORPUS_FILE)
    book = [{**d, "text": d["text"][:1500]} for d in docs if d["kind"] == "book"][:2]
    chat = [d for d in docs if d["kind"] == "chat"][-8:]
    path.write_text("".join(json.dumps(d) + "\n" for d in book + chat), encoding="utf-8")
    return path


SMALL = TrainSettings(
    num_merges=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    book_window=64,
    chat_repeats=1,
    epochs=8,
    batch_tokens=1024,
    learning_rate=1e-2,
    warmup_steps=0,
    eval_pairs=2,
)


def losses_by_epoch(path: Path) -> list[float]:
    with open(path / LOG_FILE) as f:
        rows = list(csv.DictReader(f))
    epochs: dict[int, list[float]] = {}
    for row in rows:
        epochs.setdefault(int(row["epoch"]), []).append(float(row["loss"]))
    return [float(np.mean(v)) for _, v in sorted(epochs.items())]


def shipped_files() -> dict[str, str]:
    files = [*TINY_CHAT_DIR.iterdir(), RESULTS_DIR / SUMMARY_FILE, RESULTS_DIR / LOG_FILE]
    return {str(p): file_sha256(p) for p in files if p.is_file()}


def test_training_runs_and_is_deterministic(tmp_path):
    shipped = shipped_files()
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    first = train(SMALL, tmp_path / "a", corpus, log=lambda line: None)
    second = train(SMALL, tmp_path / "b", corpus, log=lambda line: None)

    losses = losses_by_epoch(tmp_path / "a")
    assert len(losses) == SMALL.epochs
    assert losses[-1] < 0.8 * losses[0], f"mean loss per epoch: {losses}"
    assert first["weights_sha256"] == second["weights_sha256"], "same seed, same weights"
    assert first["corpus"]["sha256"] == file_sha256(corpus)
    assert load_checkpoint(tmp_path / "a").config.hidden_size == SMALL.hidden_size
    assert shipped_files() == shipped, "the shipped checkpoint and its results are untouched"
