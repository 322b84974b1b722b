"""What the course does not ask students to write: loading checkpoints and tokenizers,
synthetic tiny checkpoints, model names, and device / BLAS set-up. Beside them, for the demo
and the benchmarks: `cli` (shared command-line pieces), `batch_recorder` (measurements from
batch_generate's on_step events), `batch_views` and `demo_prompts` (the batch-main demo)."""

from .checkpoint import (
    Checkpoint,
    expected_shapes,
    load_checkpoint,
    quantize_checkpoint,
    quantize_weights,
)
from .config import QUANT_BITS, QUANT_GROUP_SIZES, Quantization, Qwen3Config, check_quant_format
from .device import (
    OPENBLAS_HINT,
    blas_info,
    choose_device,
    gpu_available,
    openblas_path,
    openblas_preload_env,
    reexec_with_openblas,
)
from .models import SHORTCUTS, ModelNotAvailableError, resolve_model
from .oracle import mlx_lm_qwen3
from .tiny import make_tiny_checkpoint, random_weights
from .tokenizer import StreamingDetokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Qwen3Config",
    "Quantization",
    "QUANT_BITS",
    "QUANT_GROUP_SIZES",
    "check_quant_format",
    "Checkpoint",
    "load_checkpoint",
    "expected_shapes",
    "quantize_checkpoint",
    "quantize_weights",
    "make_tiny_checkpoint",
    "random_weights",
    "Tokenizer",
    "load_tokenizer",
    "StreamingDetokenizer",
    "SHORTCUTS",
    "resolve_model",
    "ModelNotAvailableError",
    "choose_device",
    "gpu_available",
    "blas_info",
    "openblas_path",
    "OPENBLAS_HINT",
    "mlx_lm_qwen3",
    "openblas_preload_env",
    "reexec_with_openblas",
]
