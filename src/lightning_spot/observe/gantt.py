"""Draw a pipeline trace (Chrome-trace events from :mod:`lightning_spot.runtime.clock`) as a Gantt chart:
one row per rank, one colour per action.

    png_bytes = render_gantt(trace, title="P2xD2, 8 micro-batches, 1F1B")

Needs matplotlib (``pip install "lightning-spot[viz]"``).
"""

from __future__ import annotations

import io
from typing import Any

from lightning_spot.layout import LayoutError, PipelineLayout

COLOURS = {
    "forward": "#4C8BF5",
    "backward": "#34A853",
    "weight": "#A142F4",
    "recv": "#D0D0D0",
    "send": "#EEEEEE",
    "allreduce": "#F29900",
    "optimizer": "#EA4335",
    "checkpoint": "#795548",
    "preemption": "#000000",
}
LABELS = {
    "forward": "forward",
    "backward": "backward",
    "weight": "weight gradient",
    "recv": "waiting to receive",
    "send": "waiting on a send",
    "allreduce": "gradient all-reduce",
    "optimizer": "optimizer step",
    "checkpoint": "checkpoint",
    "preemption": "preemption stop",
}


def import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "Drawing timelines needs matplotlib: pip install 'lightning-spot[viz]' (or pip install matplotlib)."
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig: Any, dpi: int) -> bytes:
    """A finished matplotlib figure as PNG bytes (laid out tightly), the figure closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=dpi)
    plt.close(fig)
    return out.getvalue()


def trace_title(metadata: dict[str, Any]) -> str:
    """The layout a trace was recorded on, as a chart title."""
    try:
        return PipelineLayout.from_dict(metadata.get("layout") or {}).describe()
    except LayoutError:
        return "pipeline timeline"


def render_gantt(trace: dict[str, Any], title: str = "", width: float = 14.0) -> bytes:
    """The trace as a PNG (bytes). Each rank's row shows its pipeline actions; all-reduce and
    checkpoint uploads, which overlap with them, run as thin bars along the bottom of the row.
    The title defaults to the layout in the trace's metadata."""
    plt = import_pyplot()
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in COLOURS]
    ranks = sorted({e["pid"] for e in events})
    if not events:
        raise ValueError("the trace holds no pipeline events to draw")
    t0 = min(e["ts"] for e in events)
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step" and e.get("ph") == "X"]
    fig, ax = plt.subplots(figsize=(width, max(2.6, 1.1 + 0.6 * len(ranks))))
    seen: set[str] = set()
    for e in events:
        row = ranks.index(e["pid"])
        side_lane = e.get("tid") not in ("pipeline", None)
        y, height = (row + 0.22, 0.16) if side_lane else (row - 0.4, 0.6)
        start, dur = (e["ts"] - t0) / 1000, e["dur"] / 1000
        cat = e["cat"]
        ax.broken_barh(
            [(start, dur)],
            (y, height),
            facecolors=COLOURS[cat],
            edgecolor="white",
            linewidth=0.3,
            label=None if cat in seen else LABELS[cat],
        )
        seen.add(cat)
        mb = e.get("args", {}).get("microbatch")
        if mb is not None and cat in ("forward", "backward", "weight"):
            ax.text(
                start + dur / 2,
                y + height / 2,
                str(mb),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
                clip_on=True,
            )
    for e in steps:  # step boundaries, from the rank that recorded them
        ax.axvline((e["ts"] - t0) / 1000, color="#888888", linewidth=0.6, linestyle=":")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.6)
    ax.set_xlabel("milliseconds")
    ax.set_title(title or trace_title(trace.get("metadata", {})), fontsize=10)
    order = [LABELS[c] for c in COLOURS if c in seen]
    handles, labels = ax.get_legend_handles_labels()
    pairs = sorted(zip(labels, handles), key=lambda lh: order.index(lh[0]))
    ax.legend(
        [h for _, h in pairs],
        [label for label, _ in pairs],
        loc="center left",
        bbox_to_anchor=(1.005, 0.5),
        fontsize=8,
        frameon=False,
    )
    return png_bytes(fig, 130)
