"""mlx-lm's Qwen3 holding a checkpoint's weights: the oracle of the tests and the baseline of
the benchmarks. mlx-lm is a development dependency, imported only when this is called."""

from __future__ import annotations

from .checkpoint import Checkpoint, expected_shapes


def mlx_lm_qwen3(ckpt: Checkpoint):
    """`mlx_lm.models.qwen3.Model` sharing the checkpoint's weight arrays (no copy)."""
    from mlx_lm.models import qwen3

    c = ckpt.config
    args = qwen3.ModelArgs(
        model_type="qwen3",
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
    )
    model = qwen3.Model(args)
    # only the tensors the config calls for (a checkpoint cut to fewer layers has spares);
    # sanitize drops lm_head.weight when the embeddings are tied
    weights = model.sanitize({name: ckpt.weights[name] for name in expected_shapes(c)})
    model.load_weights(list(weights.items()), strict=True)
    return model
