"""The chunked-prefill benchmark's report: a table of the per-budget medians, and a plot of
p95 decode gap against output throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import log, pyplot, save_figure


def summary_table(report: dict[str, Any]) -> str:
    lines = [  # the column heads, then a row each
        f"{'policy':>9} {'pool':>5} {'prefill':>7} {'runs':>4} {'tok/s':>8} {'req/s':>6} {'wall s':>7} "
        f"{'step p50':>9} {'gap p50':>9} {'gap p95':>9} {'gap max':>9} "
        f"{'ttft p50':>9} {'chunks':>6} {'refused':>7} {'preempt':>7}"
    ]
    for row in report["budgets"]:
        m = row["median"]
        pool = row.get("max_pages") or "-"
        lines.append(
            f"{row.get('policy', 'alternate'):>9} {pool:>5} "
            f"{row['prefill_step']:>7} {row['runs']:>4} {m['output_tokens_per_s']:>8.2f} "
            f"{m['requests_per_s']:>6.3f} {m['wall_s']:>7.2f} "
            f"{_num(m['decode_step_ms_median'])} {_num(m['decode_gap_ms_median'])} "
            f"{_num(m['decode_gap_ms_p95'])} {_num(m['decode_gap_ms_max'])} "
            f"{_num(m['ttft_ms_median'])} {m['prefill_chunks']:>6.0f} "
            f"{m.get('refused', 0):>7.0f} {m.get('preemptions', 0):>7.0f}"
        )
    return "\n".join(lines) + (
        "\n(times in ms, medians over runs; req/s counts served requests; refused: requests "
        "the page pool could never hold; preempt: requests sent back to the queue)"
    )


def _point_label(row: dict[str, Any]) -> str:
    """A point's budget, and its refused and preempted requests when there were any."""
    m = row["median"]
    extra = [f"{m[k]:.0f} {word}" for k, word in (("refused", "refused"),
             ("preemptions", "preempted")) if m.get(k)]  # fmt: skip
    return ", ".join([str(row["prefill_step"]), *extra])


def _num(value: float | None) -> str:
    return f"{'n/a':>9}" if value is None else f"{value:>9.1f}"


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """p95 decode gap against output throughput, one labeled point per budget (median over
    runs; the bars span the runs' min..max)."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in report["budgets"] if r["median"]["decode_gap_ms_p95"] is not None]
    unplotted = [  # a pool that refused every request has no point to draw: say so instead
        f"{r.get('policy', 'alternate')}, pool {r.get('max_pages')} pages, budget "
        f"{r['prefill_step']}: no decode ({r['median'].get('refused', 0):.0f} requests refused)"
        for r in report["budgets"]
        if r["median"]["decode_gap_ms_p95"] is None
    ]
    for line in unplotted:
        log(f"not plotted: {line}")
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    series: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:  # one line per scheduler (and pool size), one point per budget
        series.setdefault((r.get("policy", "alternate"), r.get("max_pages")), []).append(r)
    for (policy, pages), mine in series.items():
        xs = [r["median"]["output_tokens_per_s"] for r in mine]
        ys = [r["median"]["decode_gap_ms_p95"] for r in mine]
        xerr = [
            [x - r["min"]["output_tokens_per_s"] for x, r in zip(xs, mine)],
            [r["max"]["output_tokens_per_s"] - x for x, r in zip(xs, mine)],
        ]
        yerr = [
            [y - r["min"]["decode_gap_ms_p95"] for y, r in zip(ys, mine)],
            [r["max"]["decode_gap_ms_p95"] - y for y, r in zip(ys, mine)],
        ]
        label = policy + (f", pool {pages} pages" if pages else "")
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o-", capsize=3, label=label)
        for x, y, r in zip(xs, ys, mine):
            ax.annotate(
                _point_label(r),
                (x, y),
                textcoords="offset points",
                xytext=(6, 6),
                fontsize=8,
            )
    if len(series) > 1:
        ax.legend(fontsize=8)
    model = report["model"]
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("p95 decode gap (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{model['name']} ({model['num_layers']} layers, {report['dtype']}), "
        f"{report['trace']['num_requests']} requests, batch {report['arguments']['batch_size']}\n"
        f"{report['host']['machine']}, {report['host']['cpu_count']} CPUs, "
        f"{', '.join(report['blas']['runs'])}, MLX {report['mlx']['version']}",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    if unplotted:
        fig.text(0.01, 0.01, "not plotted: " + "; ".join(unplotted), fontsize=7, wrap=True)
    return save_figure(fig, path, rect=(0, 0.05 if unplotted else 0, 1, 1))
