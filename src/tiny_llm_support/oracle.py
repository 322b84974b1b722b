"""mlx-lm's Qwen3 holding a checkpoint's weights: the oracle of the tests and the baseline of
the benchmarks. mlx-lm is a development dependency, imported only when this is called."""

from __future__ import annotations

from .checkpoint import Checkpoint
from .checkpoint_checks import expected_shapes


def mlx_lm_qwen3(ckpt: Checkpoint):
    """`mlx_lm.models.qwen3.Model` sharing the checkpoint's weight arrays (no copy), or
    `qwen3_moe.Model` for a mixture of experts; a quantized checkpoint gives mlx-lm's quantized
    layers."""
    from mlx_lm.models import qwen3, qwen3_moe

    c = ckpt.config
    sparse = c.num_experts > 0
    experts = dict(
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        decoder_sparse_step=c.decoder_sparse_step,
        mlp_only_layers=list(c.mlp_only_layers),
        moe_intermediate_size=c.moe_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
    )
    module = qwen3_moe if sparse else qwen3
    args = module.ModelArgs(
        model_type="qwen3_moe" if sparse else "qwen3",
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        vocab_size=c.vocab_size,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta,
        head_dim=c.head_dim,
        tie_word_embeddings=c.tie_word_embeddings,
        **(experts if sparse else {}),
    )
    model = module.Model(args)
    names = list(expected_shapes(c))
    if c.quantization is not None:
        names += _quantize(model, ckpt)
    # only the tensors the config calls for (a checkpoint cut to fewer layers has spares);
    # with tied embeddings mlx-lm's model has no lm_head of its own
    tied = lambda name: c.tie_word_embeddings and name.startswith("lm_head.")
    weights = [(name, ckpt.weights[name]) for name in names if not tied(name)]
    model.load_weights(weights, strict=True)
    return model


def _quantize(model, ckpt: Checkpoint) -> list[str]:
    """Make the layers the checkpoint holds quantized into mlx-lm's quantized layers, as
    mlx-lm's loader does; returns the names of their scales and biases."""
    import mlx.nn as nn

    def predicate(path: str, module) -> bool | dict:
        if f"{path}.scales" not in ckpt.weights:
            return False
        group_size, bits = ckpt.config.quantization.of(path)
        return {"group_size": group_size, "bits": bits}

    nn.quantize(model, class_predicate=predicate)
    return [
        f"{name.removesuffix('.weight')}.{part}"
        for name in expected_shapes(ckpt.config)
        for part in ("scales", "biases")
        if f"{name.removesuffix('.weight')}.{part}" in ckpt.weights
    ]
