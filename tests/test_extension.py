"""Week 5's C++ extension as built and called (the reference's): a missing tool is one line that
names it, a bad call is refused before MLX's graph gets a node, an unchanged extension is not
built again and a changed one is, a compile error shows the compiler's message."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import tiny_llm_ref
from tiny_llm_support import extension

REFERENCE = Path(tiny_llm_ref.__file__).parent


def test_no_compiler_is_one_line_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no c++, g++ or clang++
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(extension.ExtensionBuildError) as caught:
        extension._check_compiler()
    message = str(caught.value)
    assert "no C++ compiler found" in message and "\n" not in message, message


def test_no_cmake_is_one_line_naming_it():
    with pytest.raises(extension.ExtensionBuildError) as caught:
        extension._tool("cmake-that-is-not-installed")
    message = str(caught.value)
    assert "cmake-that-is-not-installed not found" in message and "\n" not in message, message


def parts(rows=8, cols=64, group_size=64, bits=4):
    w = mx.random.normal((rows, cols), key=mx.random.key(0))
    return mx.quantize(w, group_size=group_size, bits=bits)


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda q, s, b: (mx.ones((1, 32)), q, s, b, 64, 4), "must end in K = 64"),
        (lambda q, s, b: (mx.ones((1, 64)), q, s[:, :0], b, 64, 4), "scales [8, 0]"),
        (lambda q, s, b: (mx.ones((1, 64)), q, s, b, 64, 3), "bits must be 2, 4 or 8"),
        (lambda q, s, b: (mx.ones((1, 64)), q, s, b, 16, 4), "group_size must be 32, 64 or 128"),
        (lambda q, s, b: (mx.ones((1, 64)), q.astype(mx.float32), s, b, 64, 4), "uint32"),
        (lambda q, s, b: (mx.ones((1, 64), mx.float16), q, s, b, 64, 4), "x's dtype"),
        (lambda q, s, b: (mx.ones((1, 64), mx.int32), q, s, b, 64, 4), "x must be float32"),
    ],
)
def test_bad_calls_are_refused_when_the_op_is_made(call, says):
    with pytest.raises(ValueError, match="quantized_matvec: ") as caught:
        tiny_llm_ref.quantized_matvec(*call(*parts()))
    assert says in str(caught.value), str(caught.value)


def test_the_gradient_is_refused_with_the_primitives_name():
    q, s, b = parts()
    with pytest.raises(ValueError, match="vjp.*QuantizedMatvec"):
        mx.eval(
            mx.grad(lambda x: tiny_llm_ref.quantized_matvec(x, q, s, b).sum())(mx.ones((1, 64)))
        )


def build_in_fresh_process(package: Path) -> subprocess.CompletedProcess:
    code = f"from pathlib import Path; from tiny_llm_support import extension; extension.load(Path({str(package)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_a_module_of_another_name_is_one_error_not_a_rebuild_loop(tmp_path):
    """CMakeLists.txt makes tiny_llm_ref_ext; a package folder named otherwise expects its own
    name's module: the build ends with an error saying so (not a build started again)."""
    package = tmp_path / "tiny_llm_other"
    shutil.copytree(REFERENCE / "csrc", package / "csrc")
    done = build_in_fresh_process(package)
    assert done.returncode != 0 and done.stderr.count("building the C++ extension") == 1, (
        done.stderr
    )
    assert "no module tiny_llm_other_ext came out of it" in done.stderr, done.stderr


def test_built_once_again_when_a_source_changes_and_compile_errors_shown(tmp_path):
    package = tmp_path / "tiny_llm_ref"  # a copy: its own build folder, beside it
    shutil.copytree(REFERENCE / "csrc", package / "csrc")
    first = build_in_fresh_process(package)
    assert first.returncode == 0 and "building the C++ extension" in first.stderr, first.stderr
    assert (tmp_path / "build" / "ext" / "tiny_llm_ref_ext" / "stamp").exists()
    again = build_in_fresh_process(package)
    assert again.returncode == 0 and "building" not in again.stderr, "unchanged, built again"
    source = package / "csrc" / "quantized_matvec.cpp"
    source.write_text(source.read_text() + "\nthis is not C++;\n")
    broken = build_in_fresh_process(package)
    assert broken.returncode != 0 and "building" in broken.stderr, "a changed source not rebuilt"
    assert "failed to compile" in broken.stderr and "error" in broken.stderr, broken.stderr


# --- Week 5 Day 2: paged decode attention ---------------------------------------------------------


def decode_inputs(b=2, h_q=4, h_kv=2, d=16, pages=6, page=4):
    """q [B, H_q, D], pools [pages, H_kv, P, D], tables [B, 2], lengths [B]: a valid call."""
    pool = mx.zeros((pages, h_kv, page, d))
    table = mx.array([[0, 1], [2, 3]][:b], dtype=mx.int32)
    return mx.zeros((b, h_q, d)), pool, pool, table, mx.array([5, 8][:b], dtype=mx.int32), 0.25


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda a: (a[0][:, :3], *a[1:]), "H_q a multiple of H_kv"),
        (lambda a: (a[0][..., :8], *a[1:]), "must be [B, H_q, 16]"),
        (lambda a: (a[0][..., :12], a[1][..., :12], a[2][..., :12], *a[3:]), "multiple of 8"),
        (lambda a: (a[0], a[1], a[2][:3], *a[3:]), "must both be [num_pages, H_kv, P, D]"),
        (lambda a: (a[0].astype(mx.float16), *a[1:]), "q's dtype"),
        (lambda a: (*a[:3], a[3].astype(mx.int64), *a[4:]), "page_table must be int32"),
        (lambda a: (*a[:3], a[3][:1], *a[4:]), "page_table must be int32 [2, W >= 1]"),
        (lambda a: (*a[:4], a[4].astype(mx.uint32), a[5]), "lengths must be int32 [2]"),
        (lambda a: (*a[:4], mx.array([5, 9], dtype=mx.int32), a[5]), "1 .. W * P = 8"),
        (lambda a: (*a[:4], mx.array([0, 8], dtype=mx.int32), a[5]), "has length 0"),
        (lambda a: (*a[:3], mx.array([[0, 1], [2, 6]], dtype=mx.int32), *a[4:]), "page 6"),
        (lambda a: (*a[:5], float("nan")), "scale must be finite"),
    ],
)
def test_bad_decode_calls_are_refused_when_the_op_is_made(change, says):
    with pytest.raises(ValueError, match="paged_decode_attention: ") as caught:
        tiny_llm_ref.paged_decode_attention(*change(decode_inputs()))
    assert says in str(caught.value), str(caught.value)


def test_the_decode_kernel_is_refused_for_pools_that_gather():
    """use_own_decode_kernel (given code) needs pools read in place."""
    pool = tiny_llm_ref.TinyKvPagedPool(2, 16, page_size=4)
    with pytest.raises(ValueError, match="read_in_place=True"):
        tiny_llm_ref.use_own_decode_kernel([pool])
    assert pool.decode_kernel is None


# --- Week 5 Day 3: grouped_matmul's checks (given code: they pass on the skeleton too) ----------


def grouped_inputs(m=5, e=3, n=4, k=8):
    return [mx.ones((m, k)), mx.ones((e, n, k)), mx.zeros((m,), dtype=mx.int32)]


def grouped_with(i, value):
    def change(inputs):
        inputs[i] = value
        return inputs

    return change


@pytest.mark.parametrize(
    "change,says",
    [
        (grouped_with(0, mx.ones((5, 1, 8))), "x must be a matrix [M, K], got [5, 1, 8]"),
        (grouped_with(0, mx.ones((5, 8), dtype=mx.int32)), "x must be float32"),
        (grouped_with(1, mx.ones((3, 4, 9))), "w must be the experts' weights [E, N, K]"),
        (grouped_with(1, mx.ones((4, 8))), "w must be the experts' weights [E, N, K]"),
        (grouped_with(1, mx.ones((3, 4, 8), dtype=mx.float16)), "w must have x's dtype"),
        (grouped_with(2, mx.zeros((4,), dtype=mx.int32)), "experts must be int32 [M]"),
    ],
)
def test_bad_grouped_calls_are_refused_when_the_op_is_made(change, says):
    with pytest.raises(ValueError, match="grouped_matmul: ") as caught:
        tiny_llm_ref.grouped_matmul(*change(grouped_inputs()))
    assert says in str(caught.value), str(caught.value)


# --- Week 5 Day 4: the few-row matmul ------------------------------------------------------------


def test_without_a_compiler_the_model_falls_back_to_mlx_in_one_line(tmp_path):
    """A copy of the reference (its own build folder, nothing built) on a PATH with no compiler:
    linear_kernel="auto" notes why in one line and uses MLX's matmul; "few-row" is an error."""
    shutil.copytree(
        REFERENCE, tmp_path / "tiny_llm_ref", ignore=shutil.ignore_patterns("__pycache__")
    )
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import tiny_llm_ref as ref\n"
        "from tiny_llm_support import load_checkpoint, make_tiny_checkpoint\n"
        f"ckpt = load_checkpoint(make_tiny_checkpoint({str(tmp_path / 'ckpt')!r}))\n"
        "assert ref.__file__.startswith(sys.path[0]), ref.__file__\n"
        "print('auto ->', ref.Qwen3Model(ckpt, linear_kernel='auto').linear_kernel)\n"
        "try:\n    ref.Qwen3Model(ckpt, linear_kernel='few-row')\n"
        "except RuntimeError as e:\n    print('few-row ->', e)\n"
    )
    env = {**os.environ, "PATH": str(tmp_path / "no-tools")}
    env.pop("CXX", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "auto -> mlx" in done.stdout, done.stdout
    notes = [line for line in done.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "no C++ compiler found" in notes[0], done.stderr
    assert "few-row -> linear_kernel='few-row' cannot run" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "x_shape,w_shape,w_dtype,says",
    [
        ((2, 64), (8, 32), mx.float32, "must end in w's K"),
        ((2, 64), (8, 64), mx.float16, "of x's dtype"),
        ((2, 64), (2, 8, 64), mx.float32, r"a matrix \[N, K\]"),
    ],
)
def test_bad_few_row_inputs_are_refused_when_the_op_is_made(x_shape, w_shape, w_dtype, says):
    with pytest.raises(ValueError, match=says):
        tiny_llm_ref.few_row_matmul(mx.zeros(x_shape), mx.zeros(w_shape, dtype=w_dtype))


def test_bad_packed_few_row_calls_are_refused_when_the_op_is_made():
    codes, scales, biases = parts(8, 64, 64, 4)
    with pytest.raises(ValueError, match="few_row_quantized_matmul: x .* must end in K = 64"):
        tiny_llm_ref.few_row_quantized_matmul(mx.zeros((2, 32)), codes, scales, biases, 64, 4)
    with pytest.raises(ValueError, match="few_row_matmul: x must be float32"):
        tiny_llm_ref.few_row_matmul(mx.zeros((2, 8), dtype=mx.int32), mx.zeros((4, 8)))
