"""Week 4 Day 1: weights in MLX's affine group-wise format, and a linear layer that reads them.

Each row of a weight [O, I] is cut into groups of `group_size` values. A group keeps one float
scale and one float bias, and each of its values becomes an unsigned `bits`-bit code:

    w  ~  scale * q + bias,    q in 0 .. 2**bits - 1

32 // bits codes are packed into one uint32, the first code in the lowest bits. This is what
mx.quantize writes and what mlx-community checkpoints hold: codes [O, I * bits / 32] (uint32),
scales and biases [O, I / group_size].

How the model multiplies by a quantized weight is a choice made per backend, by measurement
(see the chapter): `quantized_linear` is one of QUANTIZED_LINEAR_PATHS. "own-kernel" (Week 5
Day 1) keeps the codes packed on the CPU and multiplies small passes with the course's own C++
kernel, kernels.quantized_matvec.
"""

import warnings

import mlx.core as mx

from tiny_llm_support import Checkpoint, check_quant_format
from tiny_llm_support.quant_format import QUANTIZED_LINEAR_PATHS

from .kernels import quantized_matvec

# Passes of up to this many rows go through the own kernel; larger ones dequantize the weight
# for the call. Measured (chapter 5.1): the kernel costs about 0.2 ms a row on a 3072 x 1024
# weight, dequantizing it 9 ms, so the two cross near 40 rows.
OWN_KERNEL_MAX_ROWS = 32


def quantize(
    w: mx.array, group_size: int = 64, bits: int = 4
) -> tuple[mx.array, mx.array, mx.array]:
    """w [..., N] -> codes [..., N * bits / 32] uint32, scales and biases [..., N / group_size]
    in w's dtype, the values mx.quantize gives."""
    raise NotImplementedError(
        "Week 4 Day 1, Task 1: quantize groups along the last axis and pack the codes"
    )


def dequantize(
    codes: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64, bits: int = 4
) -> mx.array:
    """codes [..., N * bits / 32] uint32, scales and biases [..., N / group_size] -> w [..., N]
    in the scales' dtype, the values mx.dequantize gives."""
    raise NotImplementedError(
        "Week 4 Day 1, Task 2: unpack the codes and apply each group's scale and bias"
    )


class QuantizedWeight:
    """A weight [O, I] kept in the affine format, standing in for the float array where the
    model uses one: `linear(x, w)` multiplies by it and `w[ids]` looks up rows (a quantized
    embedding). kernel=True multiplies with mx.quantized_matmul, MLX's fused kernel;
    kernel=False dequantizes the whole weight for every call and multiplies in float;
    own_kernel=True (Week 5 Day 1) uses the course's C++ kernel for small passes."""

    def __init__(
        self,
        codes: mx.array,
        scales: mx.array,
        biases: mx.array,
        group_size: int = 64,
        bits: int = 4,
        kernel: bool = True,
        own_kernel: bool = False,
    ):
        check_quant_format(group_size, bits, "QuantizedWeight")
        self.codes, self.scales, self.biases = codes, scales, biases
        self.group_size, self.bits, self.kernel = group_size, bits, kernel
        self.own_kernel = own_kernel

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float weight it stands for ([E, O, I] for stacked experts)."""
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 32 // self.bits)

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes

    def dequantize(self) -> mx.array:
        return dequantize(self.codes, self.scales, self.biases, self.group_size, self.bits)

    def linear(self, x: mx.array) -> mx.array:
        """x [..., I] -> x @ W.T [..., O]."""
        if self.own_kernel:
            return self.own_kernel_linear(x)
        raise NotImplementedError(
            "Week 4 Day 1, Task 3: multiply by a quantized weight, with or without the kernel"
        )

    def own_kernel_linear(self, x: mx.array) -> mx.array:
        """x [..., I] -> x @ W.T [..., O], the codes left packed: a pass of at most
        OWN_KERNEL_MAX_ROWS rows through quantized_matvec, a larger one in float."""
        raise NotImplementedError(
            "Week 5 Day 1, Task 4: send small passes to quantized_matvec, dequantize for large ones"
        )

    def __getitem__(self, rows: mx.array) -> mx.array:
        """Rows of the float weight (token ids [B, L] -> [B, L, I]), only those dequantized."""
        raise NotImplementedError("Week 4 Day 1, Task 4: look up rows of a quantized embedding")


def default_quantized_linear() -> str:
    """The faster path on the default device, as measured (chapter 4.1): on the CPU backend
    mx.quantized_matmul is slower than a float32 matmul (2.3x at 1 row, 67x at 128 rows), so
    the weights are dequantized once at load; on a GPU the kernel is the fast path."""
    return "kernel" if mx.default_device().type == mx.gpu else "dequantize-at-load"


def layer_weights(
    ckpt: Checkpoint, quantized_linear: str | None = None
) -> dict[str, mx.array | QuantizedWeight]:
    """The checkpoint's tensors, with each quantized layer's weight, scales and biases taken
    together under its `.weight` name: a QuantizedWeight, or its float array when the path is
    "dequantize-at-load". A tied head and its embedding stay one object."""
    path = quantized_linear or default_quantized_linear()
    if path not in QUANTIZED_LINEAR_PATHS:
        raise ValueError(f"unknown quantized_linear {path!r}: use one of {QUANTIZED_LINEAR_PATHS}")
    if path == "own-kernel" and mx.default_device().type != mx.cpu:
        warnings.warn(
            "quantized_linear='own-kernel' has a CPU kernel only (Week 5 Day 1): on this device "
            "the model uses MLX's quantized kernel ('kernel') instead",
            stacklevel=2,
        )
        path = "kernel"
    weights = dict(ckpt.weights)
    built = {}  # id of the codes array -> what was made of it
    for name in list(weights):
        layer = name.removesuffix(".weight")
        if not name.endswith(".weight") or f"{layer}.scales" not in weights:
            continue
        codes = weights[name]
        if id(codes) not in built:
            group_size, bits = ckpt.config.quantization.of(layer)
            scales, biases = weights[f"{layer}.scales"], weights[f"{layer}.biases"]
            own = path == "own-kernel" and codes.ndim == 2  # stacked experts keep MLX's kernel
            kernel = path == "kernel" or (path == "own-kernel" and not own)
            w = QuantizedWeight(codes, scales, biases, group_size, bits, kernel, own)
            built[id(codes)] = w.dequantize() if path == "dequantize-at-load" else w
        weights[name] = built[id(codes)]
    if path == "dequantize-at-load":
        mx.eval(*built.values())  # once, here: not on the first forward pass
    return weights
