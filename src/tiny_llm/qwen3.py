"""Week 2 Day 1: the Qwen3 model with a KV cache and a position offset.

Week 3 uses the same model: offsets may be one int per row (continuous batching), a prompt
may arrive in chunks (chunked prefill), so a call with L > 1 may find tokens cached, and the
blocks' token-parallel halves may run compiled (shape-stable prefill). Week 4 Day 2 shards it
over the ranks of a group: TensorParallelAttention and shard_blocks cut its blocks with the
parallel layers of tensor_parallel.py, which know nothing of this model.
"""

import mlx.core as mx

from tiny_llm_support import Checkpoint, Qwen3Config, check_quant_format

from .attention import causal_mask, scaled_dot_product_attention_grouped
from .basics import linear
from .few_row import choose_linear_kernel, use_few_row_kernel
from .kv_cache import TinyKvCache, TinyKvFullCache
from .mlp import Qwen3MLP
from .moe import ExpertParallelMoE, Qwen3SparseMoE
from .paged_kv_cache import TinyKvPagedCache, TinyKvPagedPool
from .prefix_cache import TinyKvSharedPool, TinyKvSharedQuantizedPool
from .quantize import QuantizedWeight
from .quantized_kv_cache import TinyKvQuantizedCache, TinyKvQuantizedPagedPool
from .qwen3_week1 import Qwen3ModelWeek1, Qwen3MultiHeadAttention, Qwen3TransformerBlock
from .shape_stable import CompiledBlock
from .sliding_window import TinyKvWindowedCache, TinyKvWindowedPagedCache
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP, rank_slice


def attention_mask(L: int, S: int, dtype: mx.Dtype) -> mx.array | str | None:
    """The mask for L new queries over S cached keys (the new ones included)."""
    if L == 1:
        return None  # one new token may see everything in the cache
    if L == S:
        return "causal"  # a whole prompt on an empty cache: the square mask of Week 1 Day 3
    return causal_mask(L, S, dtype)  # a chunk after earlier tokens: Week 3 Day 2


class Qwen3AttentionWithCache(Qwen3MultiHeadAttention):
    """Qwen3 attention that appends its keys/values to a cache and attends over all of it."""

    def __call__(
        self,
        x: mx.array,
        offset: int | list[int],
        cache: TinyKvCache,
        mask: mx.array | str | None = None,
    ) -> mx.array:
        """x [B, L, E] at positions offset.. -> [B, L, E]. mask: the model's mask for L new
        queries over the cache, built once per forward pass; None builds it here, and a cache
        that returns its own mask overrides both."""
        raise NotImplementedError("Week 2 Day 1, Task 2: attention with a KV cache and an offset")

    def project(self, out: mx.array) -> mx.array:
        """The heads' outputs [B, H, L, D] side by side, through o_proj -> [B, L, E]."""
        b, _, l, _ = out.shape
        return linear(out.swapaxes(1, 2).reshape(b, l, -1), self.wo)

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, cache: TinyKvCache, mask: mx.array | str | None
    ) -> mx.array:
        """Append k/v [B, H_kv, L, D] to the cache and attend q [B, H, L, D] over all of it."""
        if cache.reads_in_place:  # Week 3 Day 5: pages read where they lie, no dense copy
            return cache.attend(q, k, v)  # [B, H, L, D]
        raise NotImplementedError(
            "Week 2 Day 1, Task 2: append to the cache, then attend over everything in it"
        )


class Qwen3BlockWithCache(Qwen3TransformerBlock):
    """A transformer block split where attention reads the cache.

    before_attention and after_attention touch each token row on its own (norms, projections,
    RoPE, the MLP), so they can run over any rows at once and be compiled per input shape
    (Week 3 Day 3); the attention between them reads each request's own cache.
    """

    def before_attention(
        self, x: mx.array, offset: int | list[int] | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.qkv(self.input_layernorm(x), offset)  # q, k, v [B, H(_kv), L, D]

    def after_attention(self, x: mx.array, attention: mx.array) -> mx.array:
        h = x + self.self_attn.project(attention)  # attention [B, H, L, D] -> [B, L, E]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, L, E]


class TensorParallelAttention(Qwen3AttentionWithCache):
    """This rank's heads of one attention layer (Week 4 Day 2, tensor parallelism).

    The query heads and the KV heads they read are split in rank order (H / N query heads and
    H_kv / N KV heads each, so every query head finds its KV head on the same rank), which
    makes q/k/v column-parallel on head boundaries and o_proj row-parallel. __call__, qkv and
    attend are the base class's, run over fewer heads (the cache only ever sees this rank's KV
    heads); only project changes, to the row-parallel o_proj and its all_sum.
    """

    def __init__(self, attn: Qwen3AttentionWithCache, group: mx.distributed.Group):
        self.q_norm, self.k_norm, self.rope = attn.q_norm, attn.k_norm, attn.rope
        self.head_dim = attn.head_dim
        raise NotImplementedError("Week 4 Day 2, Task 2: keep this rank's query and KV heads")

    def project(self, out: mx.array) -> mx.array:
        """This rank's heads' outputs [B, H / N, L, D] -> [B, L, E], the row-parallel o_proj."""
        raise NotImplementedError("Week 4 Day 2, Task 2: the row-parallel output projection")


def shard_blocks(
    config: Qwen3Config, blocks: list[Qwen3BlockWithCache], group: mx.distributed.Group
) -> list[Qwen3BlockWithCache]:
    """This rank's share of every block: the same block class around a tensor-parallel
    attention and MLP (norms replicated). Every size the group splits is checked first, so a
    group that does not fit changes nothing."""
    raise NotImplementedError("Week 4 Day 2, Task 4: check every split, then shard every block")


def shard_mlp(
    mlp: Qwen3MLP | Qwen3SparseMoE, group: mx.distributed.Group
) -> TensorParallelMLP | ExpertParallelMoE:
    """This rank's share of a feed-forward block: a slice of every intermediate feature of a
    dense MLP (Week 4 Day 2), or whole experts of a mixture of experts (Week 4 Day 6)."""
    if isinstance(mlp, Qwen3SparseMoE):
        return ExpertParallelMoE(mlp, group)
    return TensorParallelMLP(mlp, group)


class Qwen3Model(Qwen3ModelWeek1):
    """tokens [B, L] at position offset -> logits [B, L or logits_to_keep, vocab].

    compiled=True (Week 3 Day 3) runs every block's token-parallel halves through a
    CompileCache of compile_capacity variants per half. quantized_linear (Week 4 Day 1) as for
    Qwen3ModelWeek1; kv_bits=8 makes create_kv_cache hand out quantized caches (INT8, groups
    of kv_group_size along the head dimension). expert_matmul (Week 5 Day 3): how the sparse
    layers multiply their grouped pairs, one of EXPERT_MATMULS ("own-kernel": the course's kernel).
    linear_kernel (Week 5 Day 4): "few-row" sends the passes of at most FEW_ROW_MAX_ROWS rows
    of every linear layer through the course's few-row kernel, "auto" does when it runs here.
    """

    attention_cls = Qwen3AttentionWithCache
    block_cls = Qwen3BlockWithCache
    honors_windows = True  # its caches read each layer's sliding window (Week 4 Day 7)

    def __init__(
        self,
        ckpt: Checkpoint,
        max_seq_len: int | None = None,
        compiled: bool = False,
        compile_capacity: int = 4,
        quantized_linear: str | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        expert_matmul: str = "gather-mm",
        linear_kernel: str = "mlx",
    ):
        if kv_bits is not None:
            check_quant_format(kv_group_size, kv_bits, "Qwen3Model kv cache")
            if ckpt.config.head_dim % kv_group_size != 0:
                raise ValueError(
                    f"head_dim {ckpt.config.head_dim} is not a multiple of kv_group_size "
                    f"{kv_group_size}"
                )
        if kv_bits is not None and ckpt.config.layer_windows:
            raise ValueError(
                "a quantized KV cache (kv_bits) does not support sliding-window layers yet: "
                "build the model with kv_bits=None"
            )
        super().__init__(ckpt, max_seq_len, quantized_linear)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.compiled, self.compile_capacity = compiled, compile_capacity
        self.group: mx.distributed.Group | None = None  # set by shard()
        for layer in self.layers:
            if isinstance(layer.mlp, Qwen3SparseMoE):
                layer.mlp.set_expert_matmul(expert_matmul)  # Week 5 Day 3
        self.linear_kernel = choose_linear_kernel(linear_kernel)  # Week 5 Day 4
        if self.linear_kernel == "few-row":
            use_few_row_kernel(self)
        if compiled:
            for layer in self.layers:
                if isinstance(layer.mlp, Qwen3SparseMoE):
                    layer.mlp.grouped = True  # the loop picks tokens on the host: not traceable
            self.layers = [CompiledBlock(layer, compile_capacity) for layer in self.layers]

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallelism (Week 4 Day 2): keep only this rank's share of every block.

        Every rank of `group` calls this on the same model and then runs the same inputs;
        the embeddings, the norms and the output head stay whole on every rank.
        """
        if self.group is not None:
            raise ValueError(f"the model is already sharded over {self.group.size()} ranks")
        if self.linear_kernel == "few-row":  # the shards are new arrays: MLX's matmul
            use_few_row_kernel(self, on=False)
            self.linear_kernel = "mlx"
        blocks = [getattr(layer, "block", layer) for layer in self.layers]  # unwrap compiled
        held = [(b.self_attn.wq, b.self_attn.wk, b.self_attn.wv, b.self_attn.wo) for b in blocks]
        held += [(b.mlp.w_gate, b.mlp.w_up, b.mlp.w_down) for b in blocks]
        if any(isinstance(w, QuantizedWeight) for ws in held for w in ws):
            raise ValueError(
                "tensor parallelism splits float weights: to shard a quantized checkpoint, "
                "build the model with quantized_linear='dequantize-at-load'"
            )
        if self.compiled and any(isinstance(b.mlp, Qwen3SparseMoE) for b in blocks):
            raise ValueError(
                "expert parallelism picks each rank's (token, expert) pairs on the host, which "
                "a compiled block cannot do: build the model with compiled=False to shard a "
                "mixture of experts"
            )
        blocks = shard_blocks(self.config, blocks, group)
        if self.compiled:
            blocks = [CompiledBlock(block, self.compile_capacity) for block in blocks]
        self.layers, self.group = blocks, group

    def compile_stats(self) -> dict[str, int]:
        """compiles, hits, evictions and traces summed over every compiled half of every block."""
        caches = [c for layer in self.layers for c in getattr(layer, "compile_caches", [])]
        names = ("compiles", "hits", "evictions", "traces")
        return {name: sum(getattr(c, name) for c in caches) for name in names}

    def create_kv_cache(self) -> list[TinyKvCache]:
        if self.kv_bits is not None:
            return [
                TinyKvQuantizedCache(self.kv_group_size, self.kv_bits)
                for _ in range(self.num_hidden_layers)
            ]
        windows = [self.config.window(i) for i in range(self.num_hidden_layers)]
        return [TinyKvFullCache() if w is None else TinyKvWindowedCache(w) for w in windows]

    def create_kv_pools(
        self,
        page_size: int = 16,
        max_pages: int | None = None,
        read_in_place: bool = False,
        prefix_cache: bool = False,
    ) -> list[TinyKvPagedPool]:
        """One pool per layer, for this rank's KV heads once sharded (Week 4 Day 2);
        read_in_place: attention reads the pages where they lie (Week 3 Day 5) instead of
        gathering them; prefix_cache: full pages are shared by content (Week 4 Day 4)."""
        h_kv = self.layers[0].self_attn.num_kv_heads
        if prefix_cache and self.config.layer_windows:
            raise ValueError(
                "prefix caching shares full pages, which a sliding-window layer gives back: "
                "it is not supported for a model with windowed layers"
            )
        if self.kv_bits is not None:
            if read_in_place:
                raise ValueError(
                    "quantized pages are read through gather: read_in_place needs float pages "
                    "(kv_bits=None)"
                )
            quantized = TinyKvSharedQuantizedPool if prefix_cache else TinyKvQuantizedPagedPool
            return [
                quantized(
                    h_kv,
                    self.config.head_dim,
                    page_size,
                    max_pages,
                    self.dtype,
                    group_size=self.kv_group_size,
                    bits=self.kv_bits,
                )
                for _ in range(self.num_hidden_layers)
            ]
        pool = TinyKvSharedPool if prefix_cache else TinyKvPagedPool
        return [
            pool(h_kv, self.config.head_dim, page_size, max_pages, self.dtype, read_in_place)
            for _ in range(self.num_hidden_layers)
        ]

    def create_paged_kv_cache(self, pools: list[TinyKvPagedPool]) -> list[TinyKvPagedCache]:
        if len(pools) != self.num_hidden_layers:
            raise ValueError(f"{len(pools)} pools for {self.num_hidden_layers} layers")
        windows = [self.config.window(i) for i in range(self.num_hidden_layers)]
        return [
            TinyKvPagedCache(pool) if w is None else TinyKvWindowedPagedCache(pool, w)
            for pool, w in zip(pools, windows)
        ]

    def __call__(
        self,
        tokens: mx.array,
        offset: int | list[int],
        cache: list[TinyKvCache],
        logits_to_keep: int | None = None,
    ) -> mx.array:
        raise NotImplementedError("Week 2 Day 1, Task 3: the model forward pass with a cache")
