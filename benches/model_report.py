"""bench-model's report: the Markdown tables printed at the end of a run (the JSON holds more)."""

from __future__ import annotations

from typing import Any

from model_impls import MLX_LM


def _spread(stats: dict[str, Any], digits: int = 1) -> str:
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


def markdown_table(report: dict[str, Any]) -> str:
    ref = report["solution_label"]
    lines = [
        f"| Measurement | {ref} | mlx-lm | {ref} / mlx-lm | {ref}, share of ceiling "
        f"| mlx-lm, share of ceiling |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["prefill"] + report["decode"]:
        a, b = row["impls"][ref], row["impls"][MLX_LM]
        if row["kind"] == "prefill":
            what, metric, share = (
                f"prefill {row['prompt_len']} tokens (tokens/s)",
                "tokens_per_s",
                "fraction_of_matmul_ceiling",
            )
        else:
            what, metric, share = (
                f"decode context {row['context']}, batch {row['batch']} (ms/step)",
                "ms_per_step",
                "fraction_of_bandwidth_ceiling",
            )
        lines.append(
            f"| {what} | {_spread(a[metric])} | {_spread(b[metric])} "
            f"| {row['ratio_over_mlx_lm'][ref]:.2f} | {100 * a[share]:.0f}% "
            f"| {100 * b[share]:.0f}% |"
        )
    c, m, s = report["ceilings"], report["model"], report["settings"]
    lines += [
        "",
        f"Ceilings, same run: matmul {c['matmul_size']}x{c['matmul_size']} fp32 "
        f"{c['matmul_float32_gflops']['max']:.1f} GFLOP/s, bf16 "
        f"{c['matmul_bfloat16_gflops']['max']:.1f} GFLOP/s; copy {c['copy_gbs']['max']:.1f} "
        f"GB/s, gemv {c['gemv_gbs']['max']:.1f} GB/s (bandwidth ceiling "
        f"{c['bandwidth_ceiling_gbs']:.1f} GB/s). Model {m['name']}, {m['num_layers']} layers, "
        f"{m['parameters'] / 1e6:.1f}M parameters{', random weights' if m['random_weights'] else ''}"
        f", {report['dtype']} on {report['device']}; BLAS {report['blas']['blas']}; MLX "
        f"{report['mlx']['version']}, mlx-lm {report['mlx_lm_version']}; "
        f"{report['host']['cpu_count']} CPUs ({report['host']['machine']}); {ref} decode cache "
        f"at batch > 1: {s['batch_cache']}. Median (min-max) of {s['repeats']} repeats "
        f"({s['long_repeats']} for prompts of {s['long_from']}+ tokens); decode: "
        f"{s['decode_steps']} timed steps per repeat. Total runtime "
        f"{report['runtime_s'] / 60:.1f} min.",
    ]
    ab = report.get("ablation")
    if ab:
        lines += [
            "",
            "| Operation | regime | course ms | mx.fast / mlx-lm ms | est. ms per token |",
            "|---|---|---:|---:|---:|",
        ]
        for a in ab["ops"]:
            lines.append(
                f"| {a['op']} | {a['regime']} | {a['plain_ms']:.3f} | "
                f"{a['fast_ms']:.3f} | {a['est_ms_saved_per_token']:+.2f} |"
            )
        pre, dec = ab["models"]["prefill"][0], ab["models"]["decode"][0]
        lines += [
            "",
            f"| Model | prefill {pre['prompt_len']} (tokens/s) | decode context "
            f"{dec['context']}, batch {dec['batch']} (ms/step) | vs mlx-lm "
            f"(prefill / decode) |",
            "|---|---:|---:|---:|",
        ]
        for name in dec["impls"]:
            rp, rd = pre["ratio_over_mlx_lm"].get(name), dec["ratio_over_mlx_lm"].get(name)
            lines.append(
                f"| {name} | {_spread(pre['impls'][name]['tokens_per_s'])} "
                f"| {_spread(dec['impls'][name]['ms_per_step'])} "
                f"| {f'{rp:.2f} / {rd:.2f}' if rp else '-'} |"
            )
    return "\n".join(lines)
