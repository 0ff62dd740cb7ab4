"""The planner's output: a text table, JSON, and a stacked bar of where the time goes."""

from __future__ import annotations

from mpiring.tools.plan.search import Candidate

PARTS = ("compute", "elementwise", "tp_comm", "ep_comm", "pp_comm", "bubble", "dp_exposed")


def format_candidates(cands: list[Candidate], title: str = "") -> str:
    """One line per layout: memory, step time, TFLOP/s, MFU, GPU-hours, then the time split."""
    width = max([44] + [len(c.layout.describe()) for c in cands])  # the columns stay aligned
    head = (f"{'#':>2} {'layout':<{width}} {'mem GB':>7} {'step s':>8} {'TF/GPU':>7} {'MFU':>6} "
            f"{'GPU-h':>9}  where the time goes")
    out = [title] if title else []
    out.append(head)
    for i, c in enumerate(cands, 1):
        parts = c.breakdown.parts()
        split = " ".join(f"{k} {v / c.step_s * 100:.0f}%" for k, v in parts.items()
                         if v / c.step_s >= 0.005)
        hours = f"{c.gpu_hours / 1e6:.2f}M" if c.gpu_hours else "-"
        out.append(f"{i:>2} {c.layout.describe():<{width}} {c.memory_gb:>7.1f} {c.step_s:>8.3f} "
                   f"{c.tflops_per_gpu:>7.1f} {c.mfu * 100:>5.1f}% {hours:>9}  {split}")
    return "\n".join(out)


def format_residuals(rows: list[dict], label: str, published: str, predicted: str,
                     fmt: str = "{:.1f}") -> str:
    """Published beside predicted with the residual, one row each."""
    out = [f"{label:<28} {'published':>12} {'predicted':>12} {'residual':>9}"]
    for r in rows:
        out.append(f"{r['_label']:<28} {fmt.format(r[published]):>12} "
                   f"{fmt.format(r[predicted]):>12} {r['residual'] * 100:>+8.1f}%")
    return "\n".join(out)


def plot_candidates(cands: list[Candidate], path: str, title: str = "") -> None:
    """Stacked bars of step time by part, one bar per layout (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cands)), 4.5))
    bottoms = [0.0] * len(cands)
    for part in PARTS:
        vals = [c.breakdown.parts()[part] for c in cands]
        if not any(vals):
            continue
        ax.bar(range(len(cands)), vals, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xticks(range(len(cands)))
    ax.set_xticklabels([c.layout.describe().replace(" ", "\n", 3) for c in cands], fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(title or "predicted step time by part")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
