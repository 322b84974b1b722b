"""Week 4 Day 1: quantization.

Task 1  quantize(w, group_size, bits): MLX's affine group-wise format, codes packed in uint32.
Task 2  dequantize(codes, scales, biases, group_size, bits).
Task 3  QuantizedWeight.linear: multiply by a quantized weight (MLX's kernel, or dequantize the
        weight for each call), which `linear(x, w)` hands a quantized weight to.
Task 4  QuantizedWeight[ids]: rows of a quantized embedding.
Task 5  TinyKvQuantizedCache.update_and_fetch: keys and values stored in 8 bits.
Task 6  TinyKvQuantizedPagedPool.write / gather: the same rows stored in pages.

Oracles: mx.quantize, mx.dequantize and mx.quantized_matmul; mlx-lm loading the same quantized
checkpoint (one make_tiny_checkpoint wrote, and ones mlx-lm's convert wrote), with mlx-lm's
QuantizedKVCache for the INT8 cache; exact equalities (chunked prefill == one-shot, paged ==
dense).
"""

import contextlib
import io
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_close, prompt_with_tokens, release_all
from mlx_lm.models.cache import QuantizedKVCache
from oracles import mlx_lm_greedy, mlx_lm_model

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

FORMATS = [(g, b) for b in (2, 4, 8) for g in (32, 64, 128)]  # (group_size, bits)
PATHS = ["dequantize-at-load", "kernel", "dequantize-per-call"]


def sample_weight(seed: int, rows: int = 128, cols: int = 128) -> mx.array:
    """Rows of the kinds a quantizer gets wrong: mixed signs, all positive, all negative, all
    zero, constant, exact zeros among other values, large values."""
    w = np.random.RandomState(seed).standard_normal((rows, cols)).astype(np.float32)
    w[1] = np.abs(w[1]) + 0.5  # the maximum is the edge of larger magnitude
    w[2] = -np.abs(w[2]) - 0.5
    w[3] = 0.0
    w[4] = 1.25
    w[5, ::7] = 0.0
    w[6] *= 100.0
    return mx.array(w)


def unpack(codes: mx.array, bits: int, reverse: bool = False) -> np.ndarray:
    """The codes of packed words (numpy), first code in the lowest bits unless `reverse`."""
    words = np.array(codes).astype(np.uint64)
    shifts = np.arange(0, 32, bits, dtype=np.uint64)
    if reverse:
        shifts = shifts[::-1]
    q = (words[..., None] >> shifts) & np.uint64((1 << bits) - 1)
    return q.reshape(*words.shape[:-1], -1)


def strided(w: mx.array, group_size: int) -> mx.array:
    """w [R, N] with its values reordered so that consecutive groups of group_size hold what
    groups of every (N / group_size)-th value would: value i of a row in group i % G."""
    rows, n = w.shape
    return w.reshape(rows, group_size, n // group_size).swapaxes(-1, -2).reshape(rows, n)


def close(a, b) -> bool:
    return a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6)


def quantize_hint(w, got, group_size, bits) -> str:
    """The likely bug when impl.quantize differs from mx.quantize."""
    codes, scales, biases = (np.array(x) for x in got)
    want = [np.array(x) for x in mx.quantize(w, group_size=group_size, bits=bits)]
    top = (1 << bits) - 1
    groups = np.array(w).reshape(w.shape[0], -1, group_size)
    if scales.shape != want[1].shape or codes.shape != want[0].shape:
        return (
            f"shapes: codes {codes.shape} (want {want[0].shape}, {32 // bits} codes to a uint32), "
            f"scales {scales.shape} (want {want[1].shape}): groups run along the last axis"
        )
    if close(scales, want[2]) and close(biases, want[1]):
        return "scales and biases swapped: quantize returns (codes, scales, biases)"
    if np.allclose(scales, scales.flat[0]) and not np.allclose(want[1], want[1].flat[0]):
        return (
            "every group has the same scale: one scale and bias for the whole tensor. Each group "
            "of group_size consecutive values of a row gets its own, from its own min and max"
        )
    if np.allclose(scales, scales[..., :1]) and not np.allclose(want[1], want[1][..., :1]):
        return (
            "every group of a row has the same scale: one scale and bias per row. Each group of "
            "group_size consecutive values gets its own, from its own min and max"
        )
    across = [np.array(x) for x in mx.quantize(w.T, group_size=group_size, bits=bits)]
    if np.allclose(scales, across[1].reshape(scales.shape)) and not np.allclose(scales, want[1]):
        return "the groups run along the first axis: group the values of each row (last axis)"
    every_gth = np.array(mx.quantize(strided(w, group_size), group_size=group_size, bits=bits)[1])
    if close(scales, every_gth) and not close(scales, want[1]):
        return (
            "the groups run the wrong way within a row: a group is group_size consecutive "
            "values (w.reshape(..., N / group_size, group_size)), not every (N / group_size)-th "
            "value (w.reshape(..., group_size, N / group_size))"
        )
    if np.allclose(biases, np.round(biases)) and not np.allclose(biases, want[2]):
        return (
            "the biases look like integer zero points: MLX stores the float value of code 0 "
            "(w = scale * q + bias), not a zero point z with w = scale * (q - z)"
        )
    plain_scale = np.maximum((groups.max(-1) - groups.min(-1)) / top, 1e-7)
    if np.allclose(scales, plain_scale) and np.allclose(biases, groups.min(-1)):
        return (
            "scale = (max - min) / levels with bias = min is the plain affine rule; MLX gives "
            "code 0 to the edge of larger magnitude (a negative scale when that is the maximum) "
            "and stretches the step so that 0.0 is a whole number of steps away (the chapter)"
        )
    if codes.dtype == np.uint32 and np.array_equal(
        unpack(codes, bits, reverse=True), unpack(want[0], bits)
    ):
        return "nibble order: the first code of a word belongs in its lowest bits"
    return "compare your steps with the chapter's description of mx.quantize"


def dequantize_hint(got, codes, scales, biases, group_size, bits) -> str:
    """The likely bug when impl.dequantize differs from mx.dequantize: the values each classic
    mistake would give, compared with what it gave."""
    q = unpack(codes, bits).astype(np.float64)  # [..., N], unsigned codes
    s, b = np.array(scales, dtype=np.float64), np.array(biases, dtype=np.float64)
    per_value = lambda x: np.repeat(x, group_size, axis=-1)  # group i // group_size
    every_gth = lambda x: np.tile(x, group_size)  # group i % G
    signed = np.where(q >= 1 << (bits - 1), q - (1 << bits), q)
    mistakes = [
        (
            q * per_value(b) + per_value(s),
            "scale and bias swapped: w = scale * q + bias (each code times its group's scale, "
            "plus its group's bias)",
        ),
        (
            signed * per_value(s) + per_value(b),
            f"the codes were read back as signed integers: a {bits}-bit code is unsigned, "
            f"0 .. {(1 << bits) - 1}; mask it out of the uint32 and convert it to float with no "
            "signed type (int8) in between",
        ),
        (
            q * every_gth(s) + every_gth(b),
            "the groups run the wrong way within a row: value i belongs to group "
            "i // group_size (consecutive values), not to group i % (N / group_size)",
        ),
        (
            unpack(codes, bits, reverse=True) * per_value(s) + per_value(b),
            "nibble order: the first code of a word sits in its lowest bits",
        ),
    ]
    got = np.array(got, dtype=np.float64)
    for values, hint in mistakes:
        if close(got, values.reshape(got.shape) if values.size == got.size else values):
            return hint
    return "each value is scale * code + bias of its group, the codes unpacked lowest bits first"


# --- Task 1: quantize -------------------------------------------------------------------------


@pytest.mark.parametrize("group_size, bits", FORMATS)
def test_quantize_matches_mlx(impl, group_size, bits):
    w = sample_weight(0)
    got = impl.quantize(w, group_size, bits)
    codes, scales, biases = got
    want_codes, want_scales, want_biases = mx.quantize(w, group_size=group_size, bits=bits)
    same = (
        codes.dtype == mx.uint32
        and codes.shape == want_codes.shape
        and mx.array_equal(codes, want_codes).item()
        and scales.shape == want_scales.shape
        and np.allclose(np.array(scales), np.array(want_scales), rtol=1e-6, atol=0)
        and np.allclose(np.array(biases), np.array(want_biases), rtol=1e-6, atol=1e-7)
    )
    assert same, (
        f"group_size {group_size}, bits {bits}: differs from mx.quantize. Likely: "
        f"{quantize_hint(w, got, group_size, bits)}"
    )


@pytest.mark.parametrize("group_size, bits", FORMATS)
def test_quantize_round_trip_within_one_step(impl, group_size, bits):
    w = sample_weight(1)
    codes, scales, biases = impl.quantize(w, group_size, bits)
    back = np.array(mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits))
    err = np.abs(back - np.array(w)).reshape(w.shape[0], -1, group_size).max(-1)
    step = np.abs(np.array(scales))
    worst = (err - step).max()
    assert worst <= 1e-5 * np.abs(np.array(w)).max(), (
        f"a value came back {worst:.3g} further than one step (|scale|) of its group: "
        "the codes do not describe the values"
    )
    zeros = np.array(w) == 0
    step_of_each = np.repeat(step, group_size, axis=-1)
    assert np.all(np.abs(back[zeros]) <= 1e-4 * step_of_each[zeros]), (
        "0.0 must come back as 0.0 (up to float rounding), not up to half a step off: MLX "
        "stretches the step so that zero is a whole number of steps from the edge"
    )


def test_quantize_refuses_bad_input(impl):
    with pytest.raises(ValueError):
        impl.quantize(mx.zeros((4, 100)), 64, 4)  # 100 values do not make whole groups
    with pytest.raises(ValueError):
        impl.quantize(mx.zeros((4, 96)), 48, 4)  # a group size mx.quantize does not have
    with pytest.raises(ValueError):
        impl.quantize(mx.zeros((4, 128)), 64, 3)  # 3-bit codes do not pack into 32 bits


# --- Task 2: dequantize -----------------------------------------------------------------------


@pytest.mark.parametrize("group_size, bits", FORMATS)
@pytest.mark.parametrize("shape", [(128, 256), (2, 3, 5, 128)], ids=["2d", "4d"])
def test_dequantize_matches_mlx(impl, group_size, bits, shape):
    w = mx.random.normal(shape, key=mx.random.key(group_size + bits))
    codes, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    got = impl.dequantize(codes, scales, biases, group_size, bits)
    want = mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits)
    assert got.shape == want.shape, f"shape {got.shape}, want {want.shape}"
    assert got.dtype == scales.dtype, "the values come back in the scales' dtype"
    same = np.allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
    assert same, (
        f"dequantize, group_size {group_size}, bits {bits}: differs from mx.dequantize. Likely: "
        f"{dequantize_hint(got, codes, scales, biases, group_size, bits)}"
    )


def test_dequantize_refuses_mismatched_shapes(impl):
    codes, scales, biases = mx.quantize(mx.zeros((8, 128)), group_size=64, bits=4)
    with pytest.raises(ValueError):
        impl.dequantize(codes, scales[:, :1], biases[:, :1], 64, 4)
    with pytest.raises(ValueError):
        impl.dequantize(codes, scales, biases, 32, 4)  # 32-value groups need 4 scales a row
    for group_size, bits, groups in ((16, 4, 8), (32, 5, 3)):  # 16 x 8 and 32 x 3 values a row
        fitting = mx.zeros((8, groups))  # scales and biases of the shape that format would have
        with pytest.raises(ValueError):
            impl.dequantize(codes, fitting, fitting, group_size, bits)
            pytest.fail(
                f"dequantize(group_size={group_size}, bits={bits}) ran: a format MLX does not "
                "have must be refused first (the given check_quant_format), as in quantize"
            )


# --- Tasks 3 and 4: a quantized weight ----------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "dequantize-per-call"])
def test_quantized_linear_matches_kernel_and_float(impl, bits, kernel):
    w = mx.random.normal((96, 128), key=mx.random.key(1)) / 8
    codes, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    weight = impl.QuantizedWeight(codes, scales, biases, 64, bits, kernel=kernel)
    assert weight.shape == (96, 128), "shape: the float weight's [O, I]"
    x = mx.random.normal((2, 3, 128), key=mx.random.key(2))
    got = impl.linear(x, weight)
    kernel_out = mx.quantized_matmul(x, codes, scales, biases, True, group_size=64, bits=bits)
    float_out = x @ mx.dequantize(codes, scales, biases, group_size=64, bits=bits).T
    assert_close(got, kernel_out, "linear(x, quantized) against mx.quantized_matmul")
    assert_close(got, float_out, "linear(x, quantized) against the dequantized float layer")


def test_quantized_embedding_rows(impl):
    table = mx.random.normal((50, 128), key=mx.random.key(3))
    codes, scales, biases = mx.quantize(table, group_size=32, bits=4)
    weight = impl.QuantizedWeight(codes, scales, biases, 32, 4)
    ids = mx.array([[3, 7, 7], [0, 49, 12]])
    want = mx.dequantize(codes, scales, biases, group_size=32, bits=4)[ids]
    assert_close(weight[ids], want, "rows of a quantized embedding", 1e-6, 1e-6)


# --- the model on quantized checkpoints ---------------------------------------------------------


@pytest.fixture(scope="module", params=[4, 8], ids=["4bit", "8bit"])
def quantized_ckpt(request, tmp_path_factory):
    """The tiny checkpoint of seed 0 (tiny_gqa_ckpt's weights) in MLX's affine format."""
    path = tmp_path_factory.mktemp(f"tiny-q{request.param}")
    return load_checkpoint(make_tiny_checkpoint(path, seed=0, quantize=request.param))


def convert(tmp_path_factory, name: str, bits: int, group_size: int, **overrides):
    """A float tiny checkpoint quantized by mlx-lm's convert (offline, quietly)."""
    from mlx_lm import convert as mlx_lm_convert

    root = tmp_path_factory.mktemp(name)
    source = make_tiny_checkpoint(root / "float", **overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm_convert(
            str(source), str(root / "q"), quantize=True, q_bits=bits, q_group_size=group_size
        )
    return root / "q"


@pytest.fixture(scope="module", params=["8bit-g32-untied", "4bit-g128-mixed"])
def converted_dir(request, tmp_path_factory):
    """mlx-lm's convert output: 8-bit groups of 32 with an untied head; 4-bit groups of 128,
    which leaves every layer with 64 inputs in float (mlx-lm skips what does not divide)."""
    if request.param == "8bit-g32-untied":
        return convert(tmp_path_factory, request.param, 8, 32, seed=1, tie_word_embeddings=False)
    return convert(tmp_path_factory, request.param, 4, 128, seed=0)


def mlx_lm_logits(path: Path, tokens: mx.array) -> mx.array:
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    return model(tokens)


def check_path(impl, model, quantized_linear):
    """The layers hold what the chosen path says: float arrays dequantized at load, or
    quantized weights multiplying with or without the kernel."""
    weight = model.layers[0].mlp.w_down
    # the tests run on the CPU backend, where the measured fast path is a float32 matmul
    path = quantized_linear or "dequantize-at-load"
    if path == "dequantize-at-load":
        assert isinstance(weight, mx.array), f"{path}: the layers hold float arrays"
    else:
        assert isinstance(weight, impl.QuantizedWeight), f"{path}: the layers hold the codes"
        assert weight.kernel == (path == "kernel"), f"{path}: kernel={weight.kernel}"


@pytest.mark.parametrize("quantized_linear", [None, *PATHS])
def test_quantized_checkpoint_matches_mlx_lm(impl, quantized_ckpt, quantized_linear):
    """mlx-lm loads the checkpoint make_tiny_checkpoint wrote; our logits equal its logits."""
    model = impl.Qwen3Model(quantized_ckpt, quantized_linear=quantized_linear)
    check_path(impl, model, quantized_linear)
    tokens = mx.array([[5, 17, 300, 42, 9, 100, 7, 8, 640, 2]])
    want = mlx_lm_logits(quantized_ckpt.path, tokens)
    cache = model.create_kv_cache()
    got = model(tokens, 0, cache)
    assert_close(got, want, f"logits, {quantized_linear or 'default'} path")
    step = model(mx.array([[11]]), tokens.shape[1], cache)
    want_step = mlx_lm_logits(quantized_ckpt.path, mx.concatenate([tokens, mx.array([[11]])], 1))
    assert_close(step[:, -1], want_step[:, -1], "a decode step after the prompt")
    release_all(cache)
    if quantized_linear in ("kernel", "dequantize-per-call"):  # packed weights do not shard
        with pytest.raises(ValueError, match="dequantize-at-load"):
            model.shard(mx.distributed.init())


@pytest.mark.parametrize("quantized_linear", ["kernel", "dequantize-at-load"])
def test_quantized_greedy_tokens_equal_mlx_lm(impl, quantized_ckpt, quantized_linear):
    model = impl.Qwen3Model(quantized_ckpt, quantized_linear=quantized_linear)
    tokenizer = quantized_ckpt.tokenizer
    prompt = tokenizer.encode(prompt_with_tokens(tokenizer, 9))
    got = list(impl.simple_generate_with_kv_cache(model, prompt, 24))
    assert got == mlx_lm_greedy(quantized_ckpt, prompt, 24)


@pytest.mark.parametrize("quantized_linear", PATHS)
def test_checkpoint_converted_by_mlx_lm(impl, converted_dir, quantized_linear):
    """We load what mlx-lm's convert writes, mixed float and quantized layers included."""
    ckpt = load_checkpoint(converted_dir)
    model = impl.Qwen3Model(ckpt, quantized_linear=quantized_linear)
    tokens = mx.array([[1, 2, 3, 200, 400, 600, 9]])
    want = mlx_lm_logits(converted_dir, tokens)
    assert_close(model(tokens, 0, model.create_kv_cache()), want, f"logits, {quantized_linear}")


# --- Task 5: the INT8 KV cache ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hd128_ckpt(tmp_path_factory):
    """Float weights with Qwen3's head_dim of 128 (two 64-value groups per key row)."""
    return load_checkpoint(
        make_tiny_checkpoint(tmp_path_factory.mktemp("hd128"), seed=2, head_dim=128)
    )


@pytest.fixture(scope="module")
def int8_model(impl, hd128_ckpt):
    return impl.Qwen3Model(hd128_ckpt, kv_bits=8)


def test_int8_cache_matches_mlx_lm_quantized_cache(impl, int8_model, hd128_ckpt):
    oracle = mlx_lm_model(hd128_ckpt)
    theirs = [QuantizedKVCache(group_size=64, bits=8) for _ in oracle.layers]
    ours = int8_model.create_kv_cache()
    tokens = mx.array([[5, 17, 300, 42, 9, 100, 7, 8, 640]])
    offset = 0
    for step in range(8):
        got = int8_model(tokens, offset, ours)
        want = oracle(tokens, cache=theirs)
        assert_close(got, want, f"INT8 cache, step {step}: against mlx-lm's QuantizedKVCache")
        offset += tokens.shape[1]
        tokens = mx.argmax(got[:, -1:], axis=-1)
    release_all(ours)


def test_int8_cache_returns_every_row_dequantized(impl):
    """Two chunks through the cache: it returns every row so far, the new ones included, each
    row quantized on its own (mx.quantize's groups of 64 along head_dim) and dequantized."""
    cache = impl.TinyKvQuantizedCache(64, 8)
    k, v = random_rows((1, 2, 5, 128), 6), random_rows((1, 2, 5, 128), 7)
    cache.update_and_fetch(k[:, :, :3], v[:, :, :3])
    keys, values, _ = cache.update_and_fetch(k[:, :, 3:], v[:, :, 3:])
    for got, rows, name in ((keys, k, "keys"), (values, v, "values")):
        parts = mx.quantize(rows, group_size=64, bits=8)
        want = np.array(mx.dequantize(*parts, group_size=64, bits=8))
        assert got.shape == want.shape, (
            f"{name}: shape {got.shape}, want {want.shape}: every row cached so far, the new "
            "ones included"
        )
        unquantized = close(np.array(got), np.array(rows))
        assert not unquantized, (
            f"the {name} came back unquantized: store them quantized and return what the "
            "stored codes, scales and biases dequantize to"
        )
        same = close(np.array(got), want)
        assert same, (
            f"{name}: not mx.dequantize(mx.quantize(rows)). Likely: "
            f"{dequantize_hint(got, *parts, 64, 8)}"
        )
    release_all([cache])


# One-shot and chunked prefill store the same codes: each key row is quantized on its own, so a
# chunk boundary changes nothing stored, and the comparison needs only the float caches' 1e-4.
@pytest.mark.parametrize("chunk", [1, 5, 8])
def test_int8_chunked_prefill_equals_one_shot(int8_model, hd128_ckpt, chunk):
    tokenizer = hd128_ckpt.tokenizer
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 23))
    one_shot_cache = int8_model.create_kv_cache()
    expected = int8_model(mx.array([ids]), 0, one_shot_cache)[:, -1]
    cache = int8_model.create_kv_cache()
    for start in range(0, len(ids), chunk):
        got = int8_model(mx.array([ids[start : start + chunk]]), start, cache)[:, -1]
        for layer_cache in cache:
            layer_cache.materialize()
    assert_close(
        got,
        expected,
        f"chunks of {chunk} against one shot. The chunking must not change what a token "
        "stores: each key and value row is quantized on its own, in groups along head_dim (a "
        "scale over the whole tensor, or the whole chunk, depends on the other tokens). And the "
        "new tokens' keys are attended dequantized too: return every position dequantized, the "
        "new ones included",
    )
    token = mx.array([[7]])
    assert_close(
        int8_model(token, len(ids), cache), int8_model(token, len(ids), one_shot_cache), "decode"
    )
    release_all(cache)
    release_all(one_shot_cache)


def test_int8_cache_stays_close_to_the_float_cache(impl, int8_model, hd128_ckpt):
    """Each stored value is within one step (1/255 of its group's range) of the float one; on
    the tiny model that keeps every logit within 5% of the logits' largest magnitude."""
    float_model = impl.Qwen3Model(hd128_ckpt)
    tokens = mx.array([[5, 17, 300, 42, 9, 100, 7, 8, 640, 33, 2, 1]])
    a = int8_model(tokens, 0, int8_model.create_kv_cache())
    b = float_model(tokens, 0, float_model.create_kv_cache())
    gap = mx.abs(a - b).max().item()
    assert 0 < gap <= 0.05 * mx.abs(b).max().item(), f"largest logit gap {gap:.4f}"


def random_rows(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def test_int8_memory_per_token(impl):
    """Qwen3-0.6B's layer shape (8 KV heads of 128): at most 30% of float32's bytes per token
    (a byte per value, plus two float32 numbers per group of 64: 28.1%)."""
    int8, dense = impl.TinyKvQuantizedCache(64, 8), impl.TinyKvFullCache()
    for seed, length in enumerate([300, 212]):  # 512 tokens: two whole blocks of 256
        k, v = random_rows((1, 8, length, 128), seed), random_rows((1, 8, length, 128), seed + 9)
        int8.update_and_fetch(k, v)
        dense.update_and_fetch(k, v)
    int8.materialize()
    float_bytes = dense.keys.nbytes + dense.values.nbytes
    ratio = int8.nbytes / float_bytes
    assert int8.offset == 512
    assert ratio <= 0.30, f"the INT8 cache holds {ratio:.1%} of float32's bytes"


def check_rewind_to_6(cache, fresh) -> None:
    """10 rows in `cache`, a rewind to 6 and 3 new rows: exactly what `fresh` returns after the
    first 6 rows and the same 3."""
    k, v = random_rows((1, 2, 10, 128), 0), random_rows((1, 2, 10, 128), 1)
    cache.update_and_fetch(k, v)
    cache.rewind(6)
    assert cache.offset == 6
    k2, v2 = random_rows((1, 2, 3, 128), 2), random_rows((1, 2, 3, 128), 3)
    keys, values, _ = cache.update_and_fetch(k2, v2)
    fresh.update_and_fetch(k[:, :, :6], v[:, :, :6])
    want_keys, want_values, _ = fresh.update_and_fetch(k2, v2)
    assert_close(keys, want_keys, "keys after a rewind to 6 and 3 new rows", 0, 0)
    assert_close(values, want_values, "values after the rewind", 0, 0)


def test_int8_cache_rewinds_and_releases(impl):
    cache = impl.TinyKvQuantizedCache(64, 8)
    check_rewind_to_6(cache, impl.TinyKvQuantizedCache(64, 8))
    with pytest.raises(ValueError):
        cache.rewind(10)
    cache.release()
    assert (cache.offset, cache.nbytes) == (0, 0), "release empties the cache"


def generate_alone(impl, model, tokenizer, prompt, n):
    """The text of n tokens generated alone, finalized as a request finalizes its text (an
    unfinished character at the end is dropped)."""
    detok = tokenizer.detokenizer()
    for token in impl.simple_generate_with_kv_cache(model, tokenizer.encode(prompt), n):
        detok.add_token(token)
    detok.finalize()
    return detok.text


@pytest.mark.parametrize(
    "policy, compiled, paged",
    [
        ("alternate", False, False),
        ("hybrid", False, False),
        ("alternate", True, False),
        ("alternate", False, True),
        ("hybrid", False, True),
    ],
)
def test_int8_cache_serves_batch_generate(impl, int8_model, hd128_ckpt, policy, compiled, paged):
    """Batched decode, chunked and padded prefill, ragged passes and compiled blocks all read
    the INT8 cache (dense, or pages) through update_and_fetch: the same text as each prompt
    alone."""
    tokenizer = hd128_ckpt.tokenizer
    model = impl.Qwen3Model(hd128_ckpt, kv_bits=8, compiled=compiled) if compiled else int8_model
    pools = model.create_kv_pools(page_size=4, max_pages=12) if paged else None
    prompts = [prompt_with_tokens(tokenizer, n) for n in (3, 11, 6)]
    got = impl.batch_generate(
        model,
        tokenizer,
        prompts,
        64,
        2,
        4,
        pools=pools,
        max_new_tokens=6,
        ignore_eos=True,
        policy=policy,
    )
    if paged:
        assert all(pool.num_in_use == 0 for pool in pools), "every page back after the batch"
    for idx, text in got:
        assert text == generate_alone(impl, int8_model, tokenizer, prompts[idx], 6), idx


def test_int8_cache_refuses_bad_input(impl, tiny_gqa_ckpt):
    cache = impl.TinyKvQuantizedCache(64, 8)
    k = random_rows((1, 2, 3, 32), 0)
    with pytest.raises(ValueError):
        cache.update_and_fetch(k, k)  # head_dim 32 does not make whole groups of 64
    with pytest.raises(ValueError):
        cache.update_and_fetch(random_rows((1, 2, 3, 64), 0), random_rows((1, 2, 4, 64), 0))
    assert cache.offset == 0, "nothing was stored"
    with pytest.raises(ValueError):
        impl.Qwen3Model(tiny_gqa_ckpt, kv_bits=8)  # its head_dim is 32
    with pytest.raises(ValueError):  # quantized pages are read through gather
        impl.Qwen3Model(tiny_gqa_ckpt, kv_bits=8, kv_group_size=32).create_kv_pools(
            read_in_place=True
        )
    with pytest.raises(ValueError):
        impl.TinyKvQuantizedPagedPool(2, 32, group_size=64)  # no whole group in a row


# --- Task 6: the INT8 paged pool ----------------------------------------------------------------


def int8_pool(impl, page_size=4, max_pages=None):
    return impl.TinyKvQuantizedPagedPool(2, 128, page_size, max_pages, group_size=64, bits=8)


def test_int8_pages_hold_mlx_codes(impl):
    """Rows written in chunks that straddle pages: the pool stores mx.quantize's codes, scales
    and biases slot by slot, and gives back mx.dequantize of them."""
    pool = int8_pool(impl)
    cache = impl.TinyKvPagedCache(pool)
    k, v = random_rows((1, 2, 10, 128), 4), random_rows((1, 2, 10, 128), 5)
    cache.update_and_fetch(k[:, :, :3], v[:, :, :3])
    keys, values, _ = cache.update_and_fetch(k[:, :, 3:], v[:, :, 3:])
    codes, scales, biases = mx.quantize(k[0], group_size=64, bits=8)  # [2, 10, *]
    for i, page in enumerate(cache.page_table):
        rows = slice(4 * i, min(4 * i + 4, 10))
        n = rows.stop - rows.start
        assert mx.array_equal(pool.key_pages[page, :, :n], codes[:, rows]), (
            f"page {page} (tokens {rows.start}..{rows.stop - 1}): its key codes are not "
            "mx.quantize's. write() must quantize each row and store the codes at the page's "
            "slots start .. start + n"
        )
        assert_close(pool.key_scales[page, :, :n], scales[:, rows], f"key scales, page {page}")
        assert_close(pool.key_biases[page, :, :n], biases[:, rows], f"key biases, page {page}")
    for got, rows, name in ((keys, k, "keys"), (values, v, "values")):
        want = mx.dequantize(*mx.quantize(rows, group_size=64, bits=8), group_size=64, bits=8)
        assert_close(
            got,
            want,
            f"{name} read back: gather() must return the pages' rows dequantized, in page-table "
            "order and cut to the cache's length",
            1e-6,
            1e-6,
        )


def test_int8_paged_cache_equals_dense(int8_model, hd128_ckpt):
    """Pages and one dense buffer hold the same codes: identical logits, prefill in chunks that
    straddle pages and then decode."""
    tokenizer = hd128_ckpt.tokenizer
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 19))
    pools = int8_model.create_kv_pools(page_size=4)
    paged, dense = int8_model.create_paged_kv_cache(pools), int8_model.create_kv_cache()
    for start in range(0, len(ids), 6):
        chunk = mx.array([ids[start : start + 6]])
        got = int8_model(chunk, start, paged)
        want = int8_model(chunk, start, dense)
        assert_close(got, want, f"prefill chunk at {start}: paged INT8 against dense INT8")
        for layer_cache in paged:
            layer_cache.materialize()
    token = mx.array([[7]])
    for step in range(3):
        at = len(ids) + step
        assert_close(
            int8_model(token, at, paged), int8_model(token, at, dense), f"decode step {step}"
        )
    release_all(paged)
    assert all(pool.num_in_use == 0 for pool in pools), "release returns every page"


def test_int8_pool_memory_per_token(impl):
    """The same 30% bound as the dense cache, on Qwen3-0.6B's layer shape, counted as the bytes
    the pool's arrays hold."""
    int8 = impl.TinyKvQuantizedPagedPool(8, 128, 16, group_size=64, bits=8)
    dense = impl.TinyKvPagedPool(8, 128, 16)
    k, v = random_rows((1, 8, 512, 128), 0), random_rows((1, 8, 512, 128), 1)
    for pool in (int8, dense):
        cache = impl.TinyKvPagedCache(pool)
        cache.append(k, v)
        cache.materialize()
    assert int8.capacity == dense.capacity == 32
    ratio = int8.nbytes / dense.nbytes
    assert ratio <= 0.30, f"the INT8 pool holds {ratio:.1%} of float32's bytes"


def test_int8_paged_cache_rewinds(impl):
    pool = int8_pool(impl)
    cache, fresh = impl.TinyKvPagedCache(pool), impl.TinyKvPagedCache(pool)
    check_rewind_to_6(cache, fresh)
    assert len(cache.page_table) == 3, "6 tokens and 3 more fill 3 pages of 4"
    cache.release()
    fresh.release()
    assert pool.num_in_use == 0, "release returns every page"
