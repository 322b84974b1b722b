"""The tiny-llm engine, a Qwen3 inference engine on MLX.

The student package is generated from the reference solution by `pdm run make-skeleton`: there,
each exercise raises NotImplementedError naming its day and task until it is written."""

from .attention import (
    SimpleMultiHeadAttention,
    causal_mask,
    scaled_dot_product_attention_grouped,
    scaled_dot_product_attention_simple,
)
from .basics import linear, silu, softmax
from .batch import batch_generate
from .batching_kv_cache import BatchingKvCache
from .engine import MAX_CHOICES, Engine, RequestOutput, RequestRefused, stop_cut
from .few_row import (
    FEW_ROW_MAX_ROWS,
    LINEAR_KERNELS,
    FewRowWeight,
    choose_linear_kernel,
    few_row_problem,
    use_few_row_kernel,
)
from .flash_attention import (
    block_partial,
    flash_attention,
    merge_partials,
    paged_attention,
)
from .fork import can_fork, fork_prefix
from .generate import simple_generate, simple_generate_with_kv_cache
from .kernels import (
    few_row_matmul,
    few_row_quantized_matmul,
    grouped_matmul,
    paged_decode_attention,
    quantized_matvec,
)
from .kv_cache import TinyKvCache, TinyKvFullCache
from .layer_norm import RMSNorm
from .logprobs import TokenLogprob, prompt_logprobs, record_logprobs, token_logprobs
from .mlp import Qwen3MLP
from .moe import (
    EXPERT_MATMULS,
    ExpertParallelMoE,
    OwnKernelExperts,
    Qwen3SparseMoE,
    experts_grouped,
    experts_loop,
    route,
    run_pairs,
)
from .paged_decode import own_decode_attention, use_own_decode_kernel
from .paged_kv_cache import PagePoolExhausted, TinyKvPagedCache, TinyKvPagedPool
from .positional_encoding import RoPE
from .prefix_cache import (
    CachedPage,
    TinyKvSharedPool,
    TinyKvSharedQuantizedPool,
    cached_prefix,
    page_key,
    register_full_pages,
    reuse_prefix,
    tokens_to_admit,
)
from .quantize import (
    OWN_KERNEL_MAX_ROWS,
    QUANTIZED_LINEAR_PATHS,
    QuantizedWeight,
    default_quantized_linear,
    dequantize,
    quantize,
)
from .quantized_kv_cache import TinyKvQuantizedCache, TinyKvQuantizedPagedPool
from .qwen3 import (
    Qwen3AttentionWithCache,
    Qwen3BlockWithCache,
    Qwen3Model,
    TensorParallelAttention,
    attention_mask,
    shard_blocks,
)
from .qwen3_week1 import (
    Qwen3ModelWeek1,
    Qwen3MultiHeadAttention,
    Qwen3TransformerBlock,
    take_weight,
)
from .request import Request
from .ring_attention import (
    RingKvCache,
    merge_ranks,
    ring_generate,
    ring_prefill,
    ring_prefill_attention,
    split_sequence,
)
from .sampler import SamplingParams, keep_top_p, make_sampler, pick_tokens, sample_rows
from .scheduler import BatchStep, Scheduler, decode_step
from .shape_stable import CompileCache, CompiledBlock, prefill_query_width
from .sliding_window import (
    TinyKvWindowedCache,
    TinyKvWindowedPagedCache,
    window_mask,
    windowed_attention,
)
from .speculative import (
    DraftModel,
    PromptLookup,
    accept_greedy,
    accept_sampled,
    lookup,
    sampling_probs,
    speculative_step,
)
from .stall_free import Segment, forward_ragged, hybrid_step
from .structured_output import Grammar, GrammarError, constrain, mask_rows
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP, rank_slice

__all__ = [
    "RingKvCache",
    "TinyKvWindowedCache",
    "TinyKvWindowedPagedCache",
    "merge_ranks",
    "ring_generate",
    "ring_prefill",
    "ring_prefill_attention",
    "split_sequence",
    "window_mask",
    "windowed_attention",
    "EXPERT_MATMULS",
    "FEW_ROW_MAX_ROWS",
    "LINEAR_KERNELS",
    "FewRowWeight",
    "choose_linear_kernel",
    "few_row_problem",
    "use_few_row_kernel",
    "few_row_matmul",
    "few_row_quantized_matmul",
    "ExpertParallelMoE",
    "OwnKernelExperts",
    "Qwen3SparseMoE",
    "experts_grouped",
    "experts_loop",
    "route",
    "run_pairs",
    "DraftModel",
    "PromptLookup",
    "accept_greedy",
    "accept_sampled",
    "lookup",
    "sampling_probs",
    "speculative_step",
    "CachedPage",
    "TinyKvSharedPool",
    "TinyKvSharedQuantizedPool",
    "cached_prefix",
    "page_key",
    "register_full_pages",
    "reuse_prefix",
    "tokens_to_admit",
    "sample_rows",
    "pick_tokens",
    "stop_cut",
    "SamplingParams",
    "RequestRefused",
    "RequestOutput",
    "Engine",
    "OWN_KERNEL_MAX_ROWS",
    "QUANTIZED_LINEAR_PATHS",
    "BatchStep",
    "BatchingKvCache",
    "ColumnParallelLinear",
    "CompileCache",
    "CompiledBlock",
    "PagePoolExhausted",
    "QuantizedWeight",
    "Qwen3AttentionWithCache",
    "Qwen3BlockWithCache",
    "Qwen3MLP",
    "Qwen3Model",
    "Qwen3ModelWeek1",
    "Qwen3MultiHeadAttention",
    "Qwen3TransformerBlock",
    "RMSNorm",
    "Request",
    "RoPE",
    "RowParallelLinear",
    "Scheduler",
    "Segment",
    "SimpleMultiHeadAttention",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "TinyKvCache",
    "TinyKvFullCache",
    "TinyKvPagedCache",
    "TinyKvPagedPool",
    "TinyKvQuantizedCache",
    "TinyKvQuantizedPagedPool",
    "attention_mask",
    "batch_generate",
    "block_partial",
    "causal_mask",
    "decode_step",
    "default_quantized_linear",
    "dequantize",
    "flash_attention",
    "forward_ragged",
    "grouped_matmul",
    "hybrid_step",
    "keep_top_p",
    "linear",
    "make_sampler",
    "merge_partials",
    "own_decode_attention",
    "paged_attention",
    "paged_decode_attention",
    "prefill_query_width",
    "quantize",
    "quantized_matvec",
    "rank_slice",
    "scaled_dot_product_attention_grouped",
    "scaled_dot_product_attention_simple",
    "shard_blocks",
    "silu",
    "simple_generate",
    "simple_generate_with_kv_cache",
    "softmax",
    "take_weight",
    "use_own_decode_kernel",
    "TokenLogprob",
    "prompt_logprobs",
    "record_logprobs",
    "token_logprobs",
    "Grammar",
    "GrammarError",
    "constrain",
    "mask_rows",
    "can_fork",
    "fork_prefix",
    "MAX_CHOICES",
]
