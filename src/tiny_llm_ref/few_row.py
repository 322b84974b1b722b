"""Week 5 Day 4: every linear layer of a decode step through the course's few-row kernel.

A decode step multiplies a few rows (one per request) by every weight of the model, so its time
is how long the weights take to stream from memory. MLX's matmul, made for large products,
streams them at a fraction of what the machine can (chapter 5.4); few_row_matmul
(csrc/few_row_matmul.cpp) reads each weight once for all the rows of the pass.

Qwen3Model(linear_kernel="few-row") wraps the weight of each linear layer of its blocks and its
head in a FewRowWeight: a pass of at most FEW_ROW_MAX_ROWS rows goes through the kernel, a larger
one (a prompt) through MLX's matmul as before. "auto" picks the kernel on the CPU when it works,
and says in one line why not when it does not.
"""

import functools
import sys
import warnings

import mlx.core as mx

from tiny_llm_support.extension import ExtensionBuildError
from tiny_llm_support.quant_format import LINEAR_KERNELS

from .basics import linear
from .kernels import StandInWeight, few_row_matmul, few_row_quantized_matmul
from .mlp import Qwen3MLP
from .quantize import QuantizedWeight

# Passes of up to this many rows go through the kernel: a decode step of up to 16 requests,
# a speculative check of a few guesses. A prompt's pass is a large product: MLX's matmul.
FEW_ROW_MAX_ROWS = 16


class FewRowWeight(StandInWeight):
    """A linear layer's weight [O, I] (float, or a QuantizedWeight), standing in for it where the
    model uses one: `linear(x, w)` multiplies through the kernel when the pass is small, and
    `w[ids]` looks up rows (a tied embedding), as the weight itself would."""

    def linear(self, x: mx.array) -> mx.array:
        """x [..., I] -> x @ W.T [..., O]."""
        # BEGIN TASK Week 5 Day 4, Task 4: small passes through the few-row kernel, large ones as before
        rows = x.size // x.shape[-1]
        w = self.weight
        if rows > FEW_ROW_MAX_ROWS:
            return linear(x, w)  # MLX's matmul, or the quantized weight's own path
        if isinstance(w, QuantizedWeight):
            return few_row_quantized_matmul(x, w.codes, w.scales, w.biases, w.group_size, w.bits)
        return few_row_matmul(x, w)
        # END TASK


def use_few_row_kernel(model, on: bool = True) -> None:
    """Wrap the weight of every linear layer of model's blocks and its head in a FewRowWeight
    (on=False: unwrap them). The experts of a sparse layer keep their own matmul (Day 3)."""

    def change(w):
        w = w.weight if isinstance(w, FewRowWeight) else w
        return FewRowWeight(w) if on else w

    for layer in model.layers:
        block = getattr(layer, "block", layer)  # a compiled block wraps the block
        a = block.self_attn
        a.wq, a.wk, a.wv, a.wo = (change(w) for w in (a.wq, a.wk, a.wv, a.wo))
        if isinstance(block.mlp, Qwen3MLP):
            m = block.mlp
            m.w_gate, m.w_up, m.w_down = (change(w) for w in (m.w_gate, m.w_up, m.w_down))
    model.lm_head = change(model.lm_head)


@functools.cache
def few_row_problem() -> str | None:
    """Why the kernel cannot run here (the extension does not build, a task is not written
    yet), in one line; None when it runs."""
    try:
        mx.eval(FewRowWeight(mx.ones((2, 8))).linear(mx.ones((1, 8))))
    except (ExtensionBuildError, NotImplementedError, RuntimeError, ImportError) as e:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"
    return None


def choose_linear_kernel(requested: str) -> str:
    """What to use, "mlx" or "few-row", for a requested LINEAR_KERNELS entry. "auto": the kernel
    on the CPU when it runs (else a one-line note on stderr and MLX's matmul); on a GPU, MLX's."""
    if requested not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear_kernel {requested!r}: use one of {LINEAR_KERNELS}")
    if requested == "mlx":
        return "mlx"
    if mx.default_device().type != mx.cpu:
        if requested == "few-row":
            warnings.warn(
                "linear_kernel='few-row' has a CPU kernel only (Week 5 Day 4): on this device "
                "the model uses MLX's matmul",
                stacklevel=3,
            )
        return "mlx"
    problem = few_row_problem()
    if problem is None:
        return "few-row"
    if requested == "few-row":
        raise RuntimeError(f"linear_kernel='few-row' cannot run: {problem}")
    print(f"note: the few-row kernel is off ({problem}); linear layers use MLX's matmul",
          file=sys.stderr)  # fmt: skip
    return "mlx"
