"""MLX's affine quantization format as tiny-llm reads it: the bit widths and group sizes it takes,
and a checkpoint's choice of them (Quantization: config.json's `quantization` entry, which
config.py parses).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# MLX's affine format as tiny-llm reads it: codes of these widths pack evenly into a uint32,
# and these are the group sizes mx.quantize accepts.
QUANT_BITS = (2, 4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
# How the model multiplies by a quantized weight (Week 4 Day 1; "own-kernel": Week 5 Day 1)
QUANTIZED_LINEAR_PATHS = ("dequantize-at-load", "kernel", "dequantize-per-call", "own-kernel")
# What multiplies the few-row passes of every linear layer (Week 5 Day 4; "auto": the course's
# few-row kernel on the CPU when it runs here, else MLX's matmul)
LINEAR_KERNELS = ("auto", "mlx", "few-row")


def check_quant_format(group_size: int, bits: int, source: str | Path) -> None:
    """A clear error for a group size or bit width outside MLX's affine format."""
    if group_size not in QUANT_GROUP_SIZES:
        raise ValueError(
            f"{source}: group_size must be one of {QUANT_GROUP_SIZES}, got {group_size}"
        )
    if bits not in QUANT_BITS:
        raise ValueError(f"{source}: bits must be one of {QUANT_BITS}, got {bits}")


@dataclass(frozen=True)
class Quantization:
    """config.json's `quantization` entry, as mlx-lm's convert writes it: one group size and
    bit width for the whole model, and optionally per layer ("model.layers.0.mlp.down_proj")
    its own, or False for a layer left in float. Which layers are quantized is decided by
    the tensors: a layer is quantized when the checkpoint has its `.scales`."""

    group_size: int
    bits: int
    layers: tuple[tuple[str, tuple[int, int] | None], ...] = ()

    def of(self, layer: str) -> tuple[int, int] | None:
        """(group_size, bits) of a layer, or None where the config leaves it in float."""
        return dict(self.layers).get(layer, (self.group_size, self.bits))
