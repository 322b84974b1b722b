"""Tests for tiny_llm_support: checkpoints, tokenizer, model names, device and BLAS helpers."""

import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import tiny_llm_support as support
from tiny_llm_support import (
    OPENBLAS_HINT,
    SHORTCUTS,
    CheckpointError,
    ModelNotAvailableError,
    Qwen3Config,
    StreamingDetokenizer,
    blas_info,
    choose_device,
    load_checkpoint,
    load_tokenizer,
    make_tiny_checkpoint,
    make_tiny_moe_checkpoint,
    mlx_lm_qwen3,
    openblas_path,
    resolve_model,
)

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"

MIXED_TEXTS = [
    "Hello, world!",
    "emoji 😀🐱‍👤 and flags 🇫🇷",
    "中文字符和日本語のテキスト",
    "mixed: naïve café — 42 × 3 = 126 ✓ 😀中",
    "line one\nline two\n\n\ttabbed  spaces   ",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_checkpoint(tiny_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny.tokenizer


def rewrite_weights(path: Path, edit) -> None:
    weights = dict(mx.load(str(path / "model.safetensors")))
    edit(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# --- config ---------------------------------------------------------------------------------


def base_config(**changes) -> dict:
    d = {
        "model_type": "qwen3",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
    }
    d.update(changes)
    return d


def test_config_defaults():
    config = Qwen3Config.from_dict(base_config())
    assert config.head_dim == 8
    assert config.num_key_value_heads == 8
    assert config.tie_word_embeddings is False
    assert config.rope_theta == 1e6
    assert config.raw["vocab_size"] == 100


def test_config_rope_parameters_form():
    d = base_config()
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    assert Qwen3Config.from_dict(d).rope_theta == 5e5


def test_config_missing_key_names_key_and_file():
    d = base_config()
    del d["hidden_size"]
    with pytest.raises(ValueError, match=r"some/config\.json.*hidden_size"):
        Qwen3Config.from_dict(d, source="some/config.json")
    del d["rope_theta"]
    d["hidden_size"] = 64
    with pytest.raises(ValueError, match="rope_theta"):
        Qwen3Config.from_dict(d)


def test_config_wrong_model_type():
    with pytest.raises(ValueError, match="llama"):
        Qwen3Config.from_dict(base_config(model_type="llama"))


def test_config_heads_must_divide():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen3Config.from_dict(base_config(num_key_value_heads=3))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_config_written_by_transformers_5_reads_as_transformers_4s(tmp_path, model_type):
    """transformers 5 saves num_experts as num_local_experts, torch_dtype as dtype and
    rope_theta in rope_parameters: its config.json gives the fields transformers 4's does."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                 max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    if model_type == "qwen3":
        cls = transformers.Qwen3Config
        extra = dict(head_dim=16, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    else:
        cls = transformers.Qwen3MoeConfig
        extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=True)  # fmt: skip
    cls(**sizes, **extra, rope_theta=5e5, dtype="bfloat16").save_pretrained(tmp_path)
    v5 = Qwen3Config.from_file(tmp_path / "config.json")
    assert "dtype" in v5.raw and "rope_parameters" in v5.raw, "written in v5's spelling"
    v4 = dict(model_type=model_type, **sizes, **extra, rope_theta=5e5, rope_scaling=None,
              torch_dtype="bfloat16")  # fmt: skip
    assert v5 == Qwen3Config.from_dict(v4)
    assert (v5.num_experts, v5.torch_dtype) == (extra.get("num_experts", 0), "bfloat16")


@pytest.mark.parametrize(
    "v4, v5, same, words",
    [
        (dict(num_experts=8), dict(num_local_experts=4), dict(num_local_experts=8),
         r"num_local_experts \(4, .*\) and num_experts \(8, .*\) disagree"),
        (dict(torch_dtype="float16"), dict(dtype="bfloat16"), dict(dtype="float16"),
         r"dtype \('bfloat16', .*\) and torch_dtype \('float16', .*\) disagree"),
        (dict(rope_theta=1e6), dict(rope_parameters={"rope_theta": 5e5}),
         dict(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}),
         r"rope_theta \(1000000.0\) and rope_parameters.rope_theta \(500000.0\) disagree"),
    ],
    ids=["num_experts", "dtype", "rope_theta"],
)  # fmt: skip
def test_config_two_spellings_that_disagree_are_named(v4, v5, same, words):
    """A setting under both transformers 4's name and transformers 5's: an error naming both
    when they differ, the one setting when they agree."""
    moe = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2)
    d = base_config(**{**moe, **v4}, moe_intermediate_size=16)
    with pytest.raises(CheckpointError, match=words):
        Qwen3Config.from_dict({**d, **v5})
    assert Qwen3Config.from_dict({**d, **same}) == Qwen3Config.from_dict(d)


def test_config_rope_scaling_as_transformers_4_writes_it():
    """transformers 4 writes RoPE scaling in rope_scaling (v5 in rope_parameters): null or
    the default loads, any other type is refused there as in rope_parameters."""
    assert Qwen3Config.from_dict(base_config(rope_scaling={"type": "default"})).rope_theta == 1e6
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(CheckpointError, match=r"rope_type 'yarn' \(rope_scaling\) is not"):
        Qwen3Config.from_dict(base_config(rope_scaling=yarn))


# --- make_tiny_checkpoint / load_checkpoint -------------------------------------------------


def test_tiny_checkpoint_layout(tiny_dir, tiny):
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (tiny_dir / name).is_file()
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen3"
    assert raw["architectures"] == ["Qwen3ForCausalLM"]
    c = tiny.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 32)
    assert c.vocab_size == tiny.tokenizer.vocab_size
    assert 512 <= c.vocab_size <= 1024
    assert c.tie_word_embeddings and c.torch_dtype == "float32"
    assert tiny.weights[Q_PROJ].shape == (4 * 32, 64)
    assert tiny.weights["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    assert all(w.dtype == mx.float32 for w in tiny.weights.values())


def test_tied_lm_head_is_embedding(tiny_dir, tiny):
    assert LM_HEAD not in mx.load(str(tiny_dir / "model.safetensors"))
    assert tiny.weights[LM_HEAD] is tiny.weights[EMBED]


def test_untied_lm_head_is_distinct(tmp_path):
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path, tie_word_embeddings=False))
    assert ckpt.config.tie_word_embeddings is False
    head, embed = ckpt.weights[LM_HEAD], ckpt.weights[EMBED]
    assert head is not embed and head.shape == embed.shape
    assert not mx.array_equal(head, embed)


def test_rope_in_parameters(tmp_path):
    path = make_tiny_checkpoint(tmp_path, rope_in_parameters=True, rope_theta=5e5)
    raw = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in raw
    assert raw["rope_parameters"] == {"rope_theta": 5e5, "rope_type": "default"}
    assert load_checkpoint(path).config.rope_theta == 5e5


def test_overrides(tmp_path):
    ckpt = load_checkpoint(
        make_tiny_checkpoint(tmp_path, num_hidden_layers=3, num_key_value_heads=4)
    )
    assert ckpt.config.num_hidden_layers == 3
    assert ckpt.weights["model.layers.2.self_attn.k_proj.weight"].shape == (4 * 32, 64)


def test_vocab_size_override(tmp_path):
    base = load_checkpoint(make_tiny_checkpoint(tmp_path / "a")).config.vocab_size
    bigger = load_checkpoint(make_tiny_checkpoint(tmp_path / "b", vocab_size=base + 7))
    assert bigger.weights[EMBED].shape == (base + 7, 64)
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_checkpoint(tmp_path / "c", vocab_size=base - 1)


def test_sharded_equals_unsharded(tmp_path):
    single = load_checkpoint(make_tiny_checkpoint(tmp_path / "one", seed=3))
    sharded_dir = make_tiny_checkpoint(tmp_path / "three", seed=3, shards=3)
    shard_files = sorted(p.name for p in sharded_dir.glob("*.safetensors"))
    assert shard_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shard_files)
    sharded = load_checkpoint(sharded_dir)
    assert sharded.weights.keys() == single.weights.keys()
    for name, w in single.weights.items():
        assert mx.array_equal(w, sharded.weights[name]), name


def test_deterministic(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=0)
    b = make_tiny_checkpoint(tmp_path / "b", seed=0)
    c = make_tiny_checkpoint(tmp_path / "c", seed=1)
    for f in sorted(a.iterdir()):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    wa, wc = load_checkpoint(a).weights, load_checkpoint(c).weights
    assert not mx.array_equal(wa[EMBED], wc[EMBED])
    assert not mx.array_equal(wa[Q_PROJ], wc[Q_PROJ])


def test_weight_scales(tiny):
    w = {k: np.array(v) for k, v in tiny.weights.items()}
    assert 0.9 < w[EMBED].std() < 1.1
    assert abs(w["model.norm.weight"].mean() - 1) < 0.1
    assert np.abs(w["model.layers.0.input_layernorm.weight"] - 1).max() < 0.6
    assert 0.9 < w[Q_PROJ].std() * np.sqrt(64) < 1.1


def test_logits_far_from_uniform(tmp_path):
    """mlx-lm (a test oracle) loads the tiny checkpoint; greedy choices have clear margins."""
    from mlx_lm.utils import load_model

    for tie in (True, False):
        model, _ = load_model(make_tiny_checkpoint(tmp_path / str(tie), tie_word_embeddings=tie))
        tokens = mx.array(np.random.RandomState(0).randint(0, 600, (4, 16)))
        top2 = mx.sort(model(tokens), axis=-1)[..., -2:]
        gaps = np.array(top2[..., 1] - top2[..., 0])
        assert np.median(gaps) > 0.5, (tie, np.median(gaps))


def test_missing_tensor_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    rewrite_weights(path, lambda w: w.pop(Q_PROJ))
    with pytest.raises(ValueError, match=rf"{Q_PROJ} is missing"):
        load_checkpoint(path)


def test_missing_untied_lm_head(tmp_path):
    path = make_tiny_checkpoint(tmp_path, tie_word_embeddings=False)
    rewrite_weights(path, lambda w: w.pop(LM_HEAD))
    with pytest.raises(ValueError, match=r"lm_head\.weight.*tie_word_embeddings"):
        load_checkpoint(path)


def test_wrong_shape_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    rewrite_weights(path, lambda w: w.update({Q_PROJ: mx.zeros((64, 64))}))
    with pytest.raises(ValueError, match=rf"{Q_PROJ} has shape \[64, 64\], expected \[128, 64\]"):
        load_checkpoint(path)


def test_extra_tensors_ignored(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    rewrite_weights(path, lambda w: w.update({"model.rotary_emb.inv_freq": mx.ones((16,))}))
    assert load_checkpoint(path).config.num_hidden_layers == 2


def test_pickle_refused(tmp_path):
    make_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*only safetensors"):
        load_checkpoint(tmp_path)


def test_missing_weights_and_index_shards(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "a")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(path)
    sharded = make_tiny_checkpoint(tmp_path / "b", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_checkpoint(sharded)


def test_missing_config_and_dir(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt.config\.json"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")


def damage(path: Path, name: str, content: bytes | None = None, keep: int | None = None) -> Path:
    """Overwrite a checkpoint file with `content`, or cut it to its first `keep` bytes."""
    file = path / name
    data = file.read_bytes()
    file.write_bytes(content if content is not None else data[:keep])
    return file


@pytest.mark.parametrize(
    "how, words",
    [
        ("half", r"truncated or not a safetensors file \(header says \d+ bytes, file has \d+\)"),
        ("five-bytes", r"not a safetensors file \(5 bytes, too short\)"),
        ("random", "truncated or not a safetensors file"),
        ("bad-header", r"not a safetensors file \(its header is not valid\)"),
    ],
)
def test_damaged_safetensors_named(tmp_path, how, words):
    """Checked against the file's size before MLX reads it."""
    path = make_tiny_checkpoint(tmp_path)
    size = (path / "model.safetensors").stat().st_size
    content = {
        "half": None,
        "five-bytes": b"12345",
        "random": np.random.RandomState(0).bytes(4096),
        "bad-header": (10).to_bytes(8, "little") + b"not json!!" + b"\0" * 64,
    }[how]
    damage(path, "model.safetensors", content, keep=size // 2)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {words}"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("config.json", b"[1, 2]", r"config\.json: expected .* found a JSON list"),
        ("config.json", b'{"model_type": ', r"config\.json: not valid JSON"),
        ("config.json", b"\xff\xfe", r"config\.json: cannot read it"),
        ("tokenizer.json", b"{1: 2", r"tokenizer\.json: not a valid tokenizer file"),
        ("tokenizer_config.json", b"[]", r"tokenizer_config\.json: expected a JSON object"),
    ],
)
def test_unreadable_json_named(tmp_path, name, content, words):
    path = make_tiny_checkpoint(tmp_path)
    damage(path, name, content)
    with pytest.raises(CheckpointError, match=words):
        load_checkpoint(path)


@pytest.mark.parametrize("key, value", [("hidden_size", "wide"), ("rope_theta", [1])])
def test_config_value_of_the_wrong_kind_named(tmp_path, key, value):
    path = make_tiny_checkpoint(tmp_path)
    edit_config(path, **{key: value})
    with pytest.raises(CheckpointError, match=rf"config\.json: {key} must be a number"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", ["model.norm.weight", Q_PROJ])
def test_integer_weight_refused_by_name(tmp_path, name):
    path = make_tiny_checkpoint(tmp_path)
    rewrite_weights(path, lambda w: w.update({name: w[name].astype(mx.int32)}))
    with pytest.raises(CheckpointError, match=rf"{name} is int32, not a floating-point"):
        load_checkpoint(path)


def test_quantized_codes_are_not_refused_but_integer_scales_are(tmp_path):
    """uint32 codes belong to a quantized layer's packed layout; its scales must be float."""
    path = make_tiny_checkpoint(tmp_path, quantize=4)
    assert load_checkpoint(path).weights[Q_PROJ].dtype == mx.uint32
    scales = Q_PROJ.replace(".weight", ".scales")
    rewrite_weights(path, lambda w: w.update({scales: w[scales].astype(mx.int32)}))
    with pytest.raises(CheckpointError, match=rf"{scales} is int32"):
        load_checkpoint(path)


def test_unknown_model_type(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    edit_config(path, model_type="llama")
    with pytest.raises(ValueError, match="'llama'"):
        load_checkpoint(path)


# --- a mixture of experts (Week 4 Day 6) -----------------------------------------------------


def test_moe_config_fields_and_sparse_layers():
    moe = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2)
    c = Qwen3Config.from_dict(
        base_config(**moe, moe_intermediate_size=16, num_hidden_layers=6, decoder_sparse_step=2,
                    mlp_only_layers=[3], norm_topk_prob=True)
    )  # fmt: skip
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 16)
    assert c.norm_topk_prob and c.mlp_only_layers == (3,)
    assert [c.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not Qwen3Config.from_dict(base_config()).is_sparse(0), "a dense model has no experts"
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        Qwen3Config.from_dict(base_config(**moe))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3Config.from_dict(
            base_config(**{**moe, "num_experts_per_tok": 9}, moe_intermediate_size=4)
        )


def test_moe_layouts_load_the_same_stacked_experts(tmp_path):
    """One tensor per expert (Hugging Face) and the stacked layout (mlx-lm) load alike."""
    hf = load_checkpoint(make_tiny_moe_checkpoint(tmp_path / "hf", seed=1))
    stacked = load_checkpoint(
        make_tiny_moe_checkpoint(tmp_path / "st", seed=1, stacked_experts=True)
    )
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in hf.weights
    assert hf.weights.keys() == stacked.weights.keys()
    for name, w in hf.weights.items():
        assert mx.array_equal(w, stacked.weights[name]).item(), name
    assert hf.weights["model.layers.1.mlp.switch_mlp.down_proj.weight"].shape == (8, 64, 64)


def test_moe_checkpoint_resaved_by_transformers_5_loads_the_same(tmp_path):
    """The config.json of a Qwen3-MoE checkpoint rewritten by transformers 5 (num_local_experts,
    dtype, rope_parameters): the same config, weights and mlx-lm logits as before."""
    transformers = pytest.importorskip("transformers")
    v4 = load_checkpoint(make_tiny_moe_checkpoint(tmp_path / "v4", seed=1))
    path = make_tiny_moe_checkpoint(tmp_path / "v5", seed=1)
    transformers.Qwen3MoeConfig.from_pretrained(path).save_pretrained(path)
    v5 = load_checkpoint(path)
    assert "num_local_experts" in v5.config.raw and "num_experts" not in v5.config.raw
    assert v5.config == v4.config and v5.weights.keys() == v4.weights.keys()
    for name, w in v4.weights.items():
        assert mx.array_equal(w, v5.weights[name]).item(), name
    tokens = mx.array([[5, 17, 99, 3, 250, 41]])
    assert mx.array_equal(mlx_lm_qwen3(v5)(tokens), mlx_lm_qwen3(v4)(tokens)).item()


def test_a_missing_expert_is_named(tmp_path):
    path = make_tiny_moe_checkpoint(tmp_path)
    missing = "model.layers.1.mlp.experts.5.up_proj.weight"
    rewrite_weights(path, lambda w: w.pop(missing))
    with pytest.raises(CheckpointError, match=rf"{missing} is missing \(layer 1 has 8 experts"):
        load_checkpoint(path)


def test_quantized_experts_are_checked_stacked(tmp_path):
    path = make_tiny_moe_checkpoint(tmp_path, quantize=4)
    ckpt = load_checkpoint(path)
    codes = ckpt.weights["model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    assert codes.dtype == mx.uint32 and codes.shape == (8, 64, 8)
    scales = "model.layers.0.mlp.switch_mlp.gate_proj.scales"
    rewrite_weights(path, lambda w: w.update({scales: w[scales][:, :3]}))
    with pytest.raises(
        CheckpointError, match=rf"{scales} has shape \[8, 3, 1\], expected \[8, 64, 1\]"
    ):
        load_checkpoint(path)


def test_missing_config_key_names_file(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["intermediate_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*intermediate_size"):
        load_checkpoint(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", mx.bfloat16])
def test_dtype_conversion(tiny_dir, tiny, dtype):
    ckpt = load_checkpoint(tiny_dir, dtype=dtype)
    expected = mx.float16 if dtype == "float16" else mx.bfloat16
    assert all(w.dtype == expected for w in ckpt.weights.values())
    assert ckpt.weights[LM_HEAD] is ckpt.weights[EMBED]
    assert mx.allclose(ckpt.weights[Q_PROJ].astype(mx.float32), tiny.weights[Q_PROJ], atol=1e-2)
    with pytest.raises(ValueError, match="float8"):
        load_checkpoint(tiny_dir, dtype="float8")


def test_no_tokenizer_files(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    (path / "tokenizer.json").unlink()
    assert load_checkpoint(path).tokenizer is None


# --- quantized checkpoints (MLX's affine format) --------------------------------------------

DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q4"), quantize=4)


def test_quantized_tiny_checkpoint_is_what_mlx_lm_convert_writes(tmp_path, q4_dir):
    from mlx_lm import convert

    source = make_tiny_checkpoint(tmp_path / "float")
    convert(str(source), str(tmp_path / "converted"), quantize=True, q_bits=4, q_group_size=64)
    ours = mx.load(str(q4_dir / "model.safetensors"))
    theirs = {}
    for file in (tmp_path / "converted").glob("*.safetensors"):
        theirs.update(mx.load(str(file)))
    assert sorted(ours) == sorted(theirs)
    for name, w in theirs.items():
        assert ours[name].dtype == w.dtype and mx.array_equal(ours[name], w), name
    config = json.loads((q4_dir / "config.json").read_text())
    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        assert config[key] == converted[key] == {"group_size": 64, "bits": 4, "mode": "affine"}


def test_quantized_checkpoint_loads(q4_dir):
    ckpt = load_checkpoint(q4_dir)
    assert ckpt.config.quantization == support.Quantization(64, 4)
    w = ckpt.weights
    assert w[f"{DOWN}.weight"].dtype == mx.uint32 and w[f"{DOWN}.weight"].shape == (64, 16)
    assert w[f"{DOWN}.scales"].shape == w[f"{DOWN}.biases"].shape == (64, 2)
    for part in ("weight", "scales", "biases"):  # the tied head is the quantized embedding
        assert w[f"lm_head.{part}"] is w[f"model.embed_tokens.{part}"]
    cast = load_checkpoint(q4_dir, dtype="bfloat16").weights
    assert cast[f"{DOWN}.weight"].dtype == mx.uint32, "codes are never cast"
    assert cast[f"{DOWN}.scales"].dtype == mx.bfloat16
    assert cast["lm_head.scales"] is cast["model.embed_tokens.scales"]


def test_mlx_lm_oracle_holds_quantized_layers(q4_dir):
    from mlx_lm.utils import load_model

    ckpt = load_checkpoint(q4_dir)
    tokens = mx.array([[1, 2, 3, 400]])
    loaded, _ = load_model(q4_dir)
    assert mx.array_equal(support.mlx_lm_qwen3(ckpt)(tokens), loaded(tokens))


def test_quantization_config():
    config = Qwen3Config.from_dict(
        base_config(
            quantization={
                "group_size": 64,
                "bits": 4,
                DOWN: {"group_size": 32, "bits": 8},
                "lm_head": False,
            }
        )
    )
    q = config.quantization
    assert (q.of(DOWN), q.of("lm_head"), q.of("model.layers.1.mlp.up_proj")) == (
        (32, 8),
        None,
        (64, 4),
    )
    assert Qwen3Config.from_dict(base_config()).quantization is None


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, "mxfp4"),
        ({"quantization": {"group_size": 64, "bits": 3}}, "bits"),
        ({"quantization": {"group_size": 48, "bits": 4}}, "group_size"),
        ({"quantization": {"bits": 4}}, "group_size"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"),
    ],
)
def test_quantization_config_refused(entry, message):
    with pytest.raises(ValueError, match=rf"some/config\.json.*{message}"):
        Qwen3Config.from_dict(base_config(**entry), source="some/config.json")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda w: w.update({f"{DOWN}.scales": mx.zeros((64, 4))}),
            rf"model\.safetensors: tensor {DOWN}\.scales has shape \[64, 4\], expected \[64, 2\]",
        ),
        (
            lambda w: w.update({f"{DOWN}.weight": mx.zeros((64, 32), mx.uint32)}),
            rf"tensor {DOWN}\.weight has shape \[64, 32\], expected \[64, 16\] \(4-bit codes",
        ),
        (lambda w: w.pop(f"{DOWN}.biases"), rf"tensor {DOWN}\.biases is missing"),
        (
            lambda w: w.update({f"{DOWN}.weight": mx.zeros((64, 16))}),
            rf"{DOWN}\.weight is float32; .* uint32",
        ),
    ],
    ids=["scales-shape", "packed-shape", "no-biases", "float-codes"],
)
def test_quantized_tensor_errors_name_file_and_tensor(tmp_path, edit, message):
    path = make_tiny_checkpoint(tmp_path, quantize=4)
    rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_quantized_tensors_need_a_quantization_entry(tmp_path):
    path = make_tiny_checkpoint(tmp_path, quantize=8)
    config = json.loads((path / "config.json").read_text())
    del config["quantization"], config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"embed_tokens\.weight is quantized.*quantization"):
        load_checkpoint(path)


def test_quantized_group_size_leaves_layers_in_float(tmp_path):
    """With groups of 128, layers with 64 inputs stay float (as mlx-lm's convert leaves them)."""
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path, quantize=8, group_size=128))
    assert ckpt.weights["model.embed_tokens.weight"].dtype == mx.float32
    assert "model.embed_tokens.scales" not in ckpt.weights
    assert ckpt.weights[f"{DOWN}.weight"].dtype == mx.uint32  # 128 inputs: quantized


# --- tokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_merges_common_words(tokenizer):
    text = "the language model reads the tokens"
    assert len(tokenizer.encode(text)) < len(text.encode()) / 2


def test_special_tokens_are_single_ids(tokenizer):
    for token in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]:
        ids = tokenizer.encode(token)
        assert ids == [tokenizer.token_to_id(token)], token
    assert tokenizer.encode("hi") == tokenizer.encode("hi")  # no BOS/EOS added
    assert tokenizer.token_to_id("<|endoftext|>") not in tokenizer.encode("hello")
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert ids[-1] == tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.eos_token_ids == {
        tokenizer.eos_token_id,
        tokenizer.token_to_id("<|endoftext|>"),
    }


def test_generation_config_eos(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    tok = load_tokenizer(path)
    assert {7, 9, tok.eos_token_id} <= tok.eos_token_ids


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
    ]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == body
    assert tokenizer.apply_chat_template(messages, enable_thinking=True) == (
        body + "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages) == (
        body + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen_style_template_features(tokenizer):
    template = (
        "{%- set ns = namespace(last_user=-1) %}"
        "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
        "{%- endif %}{%- endfor %}"
        "{%- if messages[0].role == 'tool' %}{{- raise_exception('tool first') }}{%- endif %}"
        "{{- 'last user at ' ~ ns.last_user }}"
        "{%- if tools %}{{- tools | tojson }}{%- endif %}"
    )
    tok = support.Tokenizer(tokenizer.hf_tokenizer, tokenizer.config, chat_template=template)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert tok.apply_chat_template(msgs * 2) == "last user at 2"
    assert tok.apply_chat_template(msgs, tools=[{"name": "é"}]) == 'last user at 0[{"name": "é"}]'
    with pytest.raises(Exception, match="tool first"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed(tokenizer):
    from jinja2.exceptions import SecurityError

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = support.Tokenizer(tokenizer.hf_tokenizer, tokenizer.config, chat_template=evil)
    with pytest.raises(SecurityError):
        tok.apply_chat_template([])


@pytest.mark.parametrize(
    "source, words",
    [
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
         "ran too long"),
        ("{% set r = range(99999) %}{% for i in r %}{% for j in r %}{{ '' }}{% endfor %}"
         "{% endfor %}", "ran too long"),
        ("{{ 'ab' * 10**9 }}", "repeating a sequence 1000000000 times is too much"),
        ("{{ [0] * 10**8 }}", "too much"),
        ("{{ 2 ** 1000000 }}", "an exponent of 1000000 is too large"),
    ],
)  # fmt: skip
def test_template_cannot_run_forever(tokenizer, monkeypatch, source, words):
    """A template is a program from the checkpoint: a loop of loops stops at the time limit,
    an expression that would build gigabytes is refused, and the trace hook is put back."""
    from tiny_llm_support import tokenizer as module

    monkeypatch.setattr(module, "TEMPLATE_SECONDS", 0.2)
    tok = support.Tokenizer(tokenizer.hf_tokenizer, tokenizer.config, chat_template=source)
    before = sys.gettrace()
    with pytest.raises(module.ChatTemplateError, match=re.escape(words)):
        tok.apply_chat_template([])
    assert sys.gettrace() is before, "rendering must put back the trace function it found"
    small = "{{ 'ab' * 3 }}{{ 2 ** 8 }}"  # what stays allowed
    fine = support.Tokenizer(tokenizer.hf_tokenizer, tokenizer.config, chat_template=small)
    assert fine.apply_chat_template([]) == "ababab256"


# --- streaming detokenizer ------------------------------------------------------------------


def stream(tokenizer, ids) -> tuple[StreamingDetokenizer, list[str]]:
    detok = tokenizer.detokenizer()
    full = tokenizer.decode(ids).rstrip("\ufffd")  # finalize drops an incomplete last character
    segments = []
    for token_id in ids:
        segment = detok.add_token(token_id)
        segments.append(segment)
        assert "\ufffd" not in segment
        assert full.startswith(detok.text)
        assert detok.text == "".join(segments)
    segments.append(detok.finalize())
    assert "\ufffd" not in segments[-1]
    assert detok.text == full == "".join(segments)
    assert detok.tokens == list(ids)
    return detok, segments


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_streaming_detokenizer(tokenizer, text):
    stream(tokenizer, tokenizer.encode(text))


def test_streaming_holds_back_split_characters(tokenizer):
    ids = tokenizer.encode("cat 😀 and 中 <|im_end|>")
    # the emoji is made of several byte tokens, each of which alone decodes to U+FFFD
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    _, segments = stream(tokenizer, ids)
    assert "" in segments[:-1]  # something was held back
    assert any("😀" in s for s in segments)


def test_streaming_finalize_drops_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # drop the last byte of the emoji
    assert tokenizer.decode(ids).endswith("\ufffd")
    detok, segments = stream(tokenizer, ids)
    assert segments[-1] == "" and detok.text == "ok "  # the unfinished emoji's bytes are dropped
    detok, segments = stream(tokenizer, tokenizer.encode("ok 😀 and 中")[:-1])
    assert segments[-1] == "" and detok.text == "ok 😀 and "


# --- model names ----------------------------------------------------------------------------


def test_shortcuts():
    assert SHORTCUTS["qwen3-0.6b"] == "Qwen/Qwen3-0.6B"
    assert SHORTCUTS["qwen3-0.6b-4bit"] == "mlx-community/Qwen3-0.6B-4bit"
    assert SHORTCUTS["qwen3-0.6b-8bit"] == "mlx-community/Qwen3-0.6B-8bit"
    assert set(SHORTCUTS) >= {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"}


def test_resolve_unknown_name():
    with pytest.raises(ValueError, match=r"qwen3-0\.6b.*qwen3-8b"):
        resolve_model("no-such-model")


def test_resolve_tiny_random(tmp_path, monkeypatch):
    path = resolve_model("tiny-random", cache_dir=tmp_path)
    assert path == tmp_path / "tiny-seed0" and (path / "config.json").is_file()
    assert load_checkpoint(path).tokenizer is not None

    def fail(*args, **kwargs):
        raise AssertionError("should reuse the existing checkpoint")

    monkeypatch.setattr("tiny_llm_support.models.make_tiny_checkpoint", fail)
    assert resolve_model("tiny-random", cache_dir=tmp_path) == path


def test_resolve_local_dir(tiny_dir):
    assert resolve_model(str(tiny_dir)) == tiny_dir
    assert resolve_model(tiny_dir) == tiny_dir


@pytest.mark.parametrize(
    "error", [OSError("Network is unreachable"), RuntimeError("hub exploded"), ConnectionError()]
)
def test_resolve_hub_failure(monkeypatch, error):
    import huggingface_hub

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ModelNotAvailableError, match="--model tiny") as info:
        resolve_model("qwen3-0.6b")
    message = str(info.value)
    assert "Qwen/Qwen3-0.6B" in message and "download" in message
    assert isinstance(info.value, RuntimeError)


def test_resolve_hub_arguments(monkeypatch, tiny_dir):
    import huggingface_hub

    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tiny_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model("Qwen3-1.7B", offline=True) == tiny_dir
    assert resolve_model("someone/some-model") == tiny_dir
    (repo, kwargs), (repo2, kwargs2) = calls
    assert (repo, repo2) == ("Qwen/Qwen3-1.7B", "someone/some-model")
    assert kwargs["local_files_only"] is True and "local_files_only" not in kwargs2
    assert "*.safetensors" in kwargs["allow_patterns"]
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in kwargs["allow_patterns"])


# --- device and BLAS ------------------------------------------------------------------------


@pytest.fixture
def restore_device():
    device = mx.default_device()
    yield
    mx.set_default_device(device)


def test_choose_device(restore_device):
    assert choose_device("cpu") == "cpu"
    assert mx.default_device() == mx.cpu
    expected = "gpu" if support.gpu_available() else "cpu"
    assert choose_device(None) == expected
    assert choose_device("auto") == expected
    with pytest.raises(ValueError, match="tpu"):
        choose_device("tpu")
    if not support.gpu_available():
        with pytest.raises(ValueError, match="gpu"):
            choose_device("gpu")


def test_blas_info():
    info = blas_info()
    assert info["platform"]
    assert info["blas"] in {"openblas (LD_PRELOAD)", "accelerate", "reference (bundled netlib)"}
    path = openblas_path()
    assert path is None or (Path(path).exists() and "openblas" in path)
    assert "load it by themselves" in OPENBLAS_HINT and "float32" in OPENBLAS_HINT
    assert "libopenblas0-pthread" in OPENBLAS_HINT


# --- contents that would load and compute garbage (issue 33) --------------------------------


def rewrite(path: Path, name: str, change) -> None:
    """Tensor `name` of model.safetensors replaced by change(tensor)."""
    file = path / "model.safetensors"
    tensors = dict(mx.load(str(file)))
    tensors[name] = change(tensors[name])
    mx.save_safetensors(str(file), tensors)


def test_nan_in_a_quantized_layer_is_found_in_its_scales(tmp_path):
    """The uint32 codes are left alone; the float scales are checked."""
    path = make_tiny_checkpoint(tmp_path, quantize=4)
    load_checkpoint(path)  # codes that happen to look like NaN in float32 are no NaN
    name = "model.layers.0.self_attn.o_proj.scales"
    rewrite(path, name, lambda t: mx.where(mx.arange(t.size).reshape(t.shape) == 5, mx.nan, t))
    with pytest.raises(CheckpointError, match=f"model.safetensors: tensor {name} holds NaN"):
        load_checkpoint(path)


def test_a_weight_past_float16_is_found_as_float16(tmp_path):
    """Finite in the file (float32), infinite once cast to the dtype asked for."""
    path = make_tiny_checkpoint(tmp_path)
    rewrite(path, "model.norm.weight", lambda t: t * 1e6)
    load_checkpoint(path, dtype="float32")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight .* \(read as float16\)"):
        load_checkpoint(path, dtype="float16")


def test_shards_linked_from_outside_load_as_in_the_hub_cache(tmp_path):
    """The Hugging Face cache keeps a snapshot's files in a blobs folder beside it and links
    them in: a link inside the directory is followed, a path that leaves it is not."""
    path = make_tiny_checkpoint(tmp_path / "snapshot", shards=2)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in path.glob("*.safetensors"):
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    assert len(load_checkpoint(path).weights) > 0
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = f"../blobs/{index['weight_map'][first]}"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"weight_map puts {first} in '../blobs/"):
        load_checkpoint(path)


def test_chat_template_errors_name_the_file(tmp_path, tokenizer):
    from jinja2.exceptions import SecurityError

    from tiny_llm_support.tokenizer import ChatTemplateError, check_chat_template

    path = make_tiny_checkpoint(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    (path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    tok = load_tokenizer(path)
    with pytest.raises(SecurityError) as refused:
        check_chat_template(tok)
    error = refused.value
    assert isinstance(error, ChatTemplateError) and isinstance(error, CheckpointError)
    assert error.source == path / "chat_template.jinja"
    assert str(error) == f"{error.source}: the chat template was refused by the sandbox: " + (
        error.detail
    )
    assert str(path) not in error.detail and "unsafe" in error.detail
    check_chat_template(tokenizer)  # a template that renders: nothing to say


@pytest.mark.parametrize(
    "contents, blank",
    [
        ([""], True),
        ([" \n\t"], True),
        (["", "  "], True),
        (["Be brief.", ""], False),
        (["x"], False),
    ],
)
def test_a_conversation_without_text_is_refused(contents, blank):
    from tiny_llm_support.tokenizer import check_chat_text

    messages = [{"role": "user", "content": c} for c in contents]
    if blank:
        with pytest.raises(ValueError, match="the prompt is empty or only whitespace"):
            check_chat_text(messages)
    else:
        check_chat_text(messages)


# --- sliding windows (Week 4 Day 7) -----------------------------------------------------------


def test_sliding_window_layers_as_transformers_reads_them():
    four = dict(num_hidden_layers=4, sliding_window=16)
    on = lambda **kw: Qwen3Config.from_dict(
        base_config(**{**four, "use_sliding_window": True, **kw})
    )
    assert on(max_window_layers=2).layer_windows == (None, None, 16, 16)
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert on(layer_types=kinds).layer_windows == (16, None, 16, None), "layer_types wins"
    assert on(max_window_layers=4).layer_windows == (), "a window on no layer is none at all"
    off = Qwen3Config.from_dict(base_config(**four, use_sliding_window=False, max_window_layers=0))
    assert off.layer_windows == () and off.window(3) is None, "use_sliding_window false: none"
    with pytest.raises(CheckpointError, match="sliding_window must be a positive"):
        on(sliding_window=None)
    with pytest.raises(CheckpointError, match="layer_types must list"):
        on(layer_types=["sliding_attention"])


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(num_hidden_layers=1e400), "num_hidden_layers must be a number"),
        (dict(num_hidden_layers=2.7), "num_hidden_layers must be a whole number, got 2.7"),
        (
            dict(num_hidden_layers=10**9, use_sliding_window=True, sliding_window=4),
            "num_hidden_layers is 1000000000",
        ),
    ],
)
def test_layer_counts_that_are_not_whole_or_too_big(changes, words):
    with pytest.raises(CheckpointError, match=words):
        Qwen3Config.from_dict(base_config(**changes))
