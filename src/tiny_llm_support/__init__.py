"""What the course does not ask students to write: loading checkpoints and tokenizers,
synthetic tiny checkpoints, model names, and device / BLAS set-up. Beside them, for the demo
and the benchmarks: `cli` (shared command-line pieces), `startup` (Ctrl-C and a broken MLX at
an entry point), `batch_recorder` (measurements from batch_generate's on_step events),
`batch_views` and `demo_prompts` (the batch-main demo).

`from tiny_llm_support import load_checkpoint` works as usual, but the module that defines a
name is imported only when the name is first used: importing the package alone loads no MLX,
so that an entry point can set up Ctrl-C handling first (startup.py).
"""

from importlib import import_module
from typing import Any

_MODULE_OF = {
    "checkpoint": ["Checkpoint", "load_checkpoint", "quantize_checkpoint", "quantize_weights"],
    "checkpoint_checks": ["expected_shapes"],
    "checkpoint_files": ["CheckpointError"],
    "config": ["Qwen3Config"],
    "device": [
        "OPENBLAS_HINT",
        "blas_info",
        "choose_device",
        "gpu_available",
        "openblas_path",
        "openblas_preload_env",
        "reexec_with_openblas",
    ],
    "models": ["SHORTCUTS", "ModelNotAvailableError", "resolve_model"],
    "oracle": ["mlx_lm_qwen3"],
    "quant_format": ["QUANT_BITS", "QUANT_GROUP_SIZES", "Quantization", "check_quant_format"],
    "tiny": ["make_tiny_checkpoint", "make_tiny_moe_checkpoint", "random_weights"],
    "tokenizer": ["StreamingDetokenizer", "Tokenizer", "load_tokenizer"],
}
_WHERE = {name: module for module, names in _MODULE_OF.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """The first use of an exported name imports the module that defines it."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
