"""Drawing primitives of the HTML page (escaping, byte labels, axis ticks,
copyable code blocks) and its charts: the timeline (inline SVG) and the
stacked category bars. They draw a view from `view.build_view`; every
snapshot string goes through `html.escape`, and the data the page's script
reads is JSON with nothing in it that could close its element."""

from __future__ import annotations

import html
import json
import math

from oomdoc.categories import TABLE
from oomdoc.sizes import format_bytes

DRAW_DOTS_UP_TO = 48  # phase-peak dots are drawn only up to this many points
DRAW_END_MARKERS_UP_TO = 24  # and end-of-step markers up to this many steps
PHASE_COLORS = {
    "setup": "#64748b",
    "forward": "#2563eb",
    "backward": "#7c3aed",
    "optimizer": "#d97706",
    "idle": "#0d9488",
    "evaluation": "#db2777",
    "communication": "#059669",
}
CATEGORY_COLORS = {category.name: category.color for category in TABLE}


esc = html.escape


def fmt(value) -> str:
    return format_bytes(value) if isinstance(value, int) else "?"


def axis_bytes(value: float) -> str:
    """Compact tick labels: `64 MiB`, `1.5 GiB`."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{text} {unit}" if unit != "bytes" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def nice_byte_step(maximum: float, ticks: int = 5) -> float:
    """A round tick spacing (1, 2, 4, 5, 8 x 2^10k, or decades of those) for
    an axis up to `maximum`."""
    raw = max(maximum, 1) / ticks
    unit = 1024 ** max(0, min(4, int(math.log(max(raw, 1), 1024))))
    for multiple in (
        1,
        2,
        4,
        5,
        8,
        10,
        16,
        20,
        25,
        32,
        40,
        50,
        64,
        100,
        128,
        200,
        256,
        500,
        512,
        1024,
    ):
        if unit * multiple >= raw:
            return float(unit * multiple)
    return float(unit * 1024)


def nice_int_step(span: float, ticks: int = 10) -> int:
    raw = max(span, 1) / ticks
    magnitude = 10 ** int(math.floor(math.log10(raw))) if raw >= 1 else 1
    for multiple in (1, 2, 5, 10):
        if magnitude * multiple >= raw:
            return max(1, int(magnitude * multiple))
    return max(1, int(magnitude * 10))


def percent(part, whole) -> str:
    if not isinstance(part, (int, float)) or not whole:
        return "-"
    return f"{100.0 * part / whole:.1f}%"


def json_for_script(data) -> str:
    """JSON that can sit inside <script type="application/json">: nothing in it
    can close the element or start markup."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def oom_moment(oom: dict) -> str:
    """`step 7 backward`: when a view's OOM happened, as far as known."""
    step = f"step {oom['step']}" if oom.get("step") is not None else ""
    return " ".join(part for part in (step, oom.get("phase") or "") if part)


def badge(text: str, kind: str) -> str:
    return f'<span class="badge badge-{esc(kind)}">{esc(text)}</span>'


def code_block(text: str, block_id: str) -> str:
    return (
        f'<div class="code"><button type="button" class="copy" data-copy="{esc(block_id)}" '
        f'title="Copy to the clipboard">Copy</button>'
        f'<pre id="{esc(block_id)}"><code>{esc(text)}</code></pre></div>'
    )


class Ids:
    """Unique element ids for copyable blocks."""

    def __init__(self):
        self.count = 0

    def next(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}-{self.count}"


# -- header and summary


def timeline_html(view: dict) -> str:
    timeline = view["timeline"]
    capacity = timeline.get("capacity_bytes") or 0
    allocated = timeline["allocated"]
    reserved = timeline["reserved"]
    ends = timeline["end"]
    oom = timeline.get("oom")
    peak = timeline.get("peak")
    if not allocated and not oom:
        return (
            '<section class="card" id="timeline"><h2>Memory over the run</h2>'
            '<p class="empty">No steps were recorded.</p></section>'
        )
    width, height = 1000, 360
    left, right, top, bottom = 78, 24, 40, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [point[1] for series in (allocated, reserved, ends) for point in series]
    if oom:
        values.append(oom["need_bytes"])
    y_max = max([capacity, *values, 1]) * 1.08
    x_min, x_max = timeline["x_min"], timeline["x_max"]
    if x_max <= x_min:
        x_max = x_min + 1

    def sx(x):
        return left + (x - x_min) / (x_max - x_min) * plot_w

    def sy(y):
        return top + plot_h - (y / y_max) * plot_h

    parts = [
        f'<svg class="chart" id="timeline-svg" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="Memory timeline" preserveAspectRatio="xMidYMid meet">'
    ]
    # Alternate steps shaded, when few enough to tell apart.
    step_span = x_max - x_min
    if step_span <= 80:
        for step in range(int(x_min), math.ceil(x_max)):
            if step % 2 == 0:
                parts.append(
                    f'<rect class="stepband" x="{sx(step):.1f}" y="{top}" '
                    f'width="{sx(min(step + 1, x_max)) - sx(step):.1f}" height="{plot_h}"/>'
                )
    # Grid and y axis.
    y_step = nice_byte_step(y_max)
    tick = 0.0
    while tick <= y_max:
        y = sy(tick)
        parts.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
        )
        parts.append(
            f'<text class="tick" x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{esc(axis_bytes(tick))}</text>'
        )
        tick += y_step
    # x axis: step numbers.
    x_step = nice_int_step(step_span)
    first_tick = int(math.ceil(x_min / x_step) * x_step)
    few_steps = step_span <= 4
    for step in range(first_tick, math.ceil(x_max) + 1, x_step):
        if step_span <= 80:  # the label in the middle of the step's band
            if step >= x_max:
                continue
            x = sx((step + min(step + 1, x_max)) / 2)
        elif step > x_max:
            continue
        else:
            x = sx(step)
        label = f"step {step}" if few_steps else str(step)
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{height - bottom + (30 if few_steps else 18)}" '
            f'text-anchor="middle">{label}</text>'
        )
    if few_steps:  # name each phase under its point
        for x, _value, _step, phase in allocated:
            parts.append(
                f'<text class="phase-tick" x="{sx(x):.1f}" y="{height - bottom + 14}" '
                f'text-anchor="middle">{esc(phase)}</text>'
            )
    if not few_steps:
        parts.append(
            f'<text class="axis-label" x="{left + plot_w / 2:.1f}" y="{height - 6}" '
            'text-anchor="middle">step (each step: forward, backward, optimizer)</text>'
        )
    parts.append(
        f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}"/>'
    )
    parts.append(
        f'<clipPath id="plot-clip"><rect x="{left}" y="0" width="{plot_w}" height="{top + plot_h}"/>'
        '</clipPath><g clip-path="url(#plot-clip)">'
    )
    # Reserved: a light area under each step's peak reserved.
    if reserved and not timeline["reserved_is_allocated"]:
        path = [f"M{sx(reserved[0][0] - 0.5):.1f},{sy(0):.1f}"]
        for x, value, _step in reserved:
            path.append(f"L{sx(x - 0.5):.1f},{sy(value):.1f}L{sx(x + 0.5):.1f},{sy(value):.1f}")
        path.append(f"L{sx(reserved[-1][0] + 0.5):.1f},{sy(0):.1f}Z")
        parts.append(f'<path class="reserved" d="{"".join(path)}"/>')
    # Allocated phase peaks.
    if allocated:
        line = " ".join(f"{sx(point[0]):.1f},{sy(point[1]):.1f}" for point in allocated)
        area = (
            f"M{sx(allocated[0][0]):.1f},{sy(0):.1f} L"
            + " L".join(f"{sx(point[0]):.1f},{sy(point[1]):.1f}" for point in allocated)
            + f" L{sx(allocated[-1][0]):.1f},{sy(0):.1f}Z"
        )
        parts.append(f'<path class="allocated-area" d="{area}"/>')
        parts.append(f'<polyline class="allocated" points="{line}"/>')
    if ends:
        line = " ".join(f"{sx(x):.1f},{sy(value):.1f}" for x, value, _ in ends)
        parts.append(f'<polyline class="end" points="{line}"/>')
    if len(allocated) <= DRAW_DOTS_UP_TO:
        for x, value, step, phase in allocated:
            color = PHASE_COLORS.get(phase, "#334155")
            parts.append(
                f'<circle class="dot" cx="{sx(x):.1f}" cy="{sy(value):.1f}" r="3.6" fill="{color}">'
                f"<title>step {step} {esc(phase)}: {esc(fmt(value))}</title></circle>"
            )
    if ends and len(ends) <= DRAW_END_MARKERS_UP_TO:
        for x, value, step in ends:
            parts.append(
                f'<rect class="enddot" x="{sx(x) - 3:.1f}" y="{sy(value) - 3:.1f}" width="6" height="6">'
                f"<title>end of step {step}: {esc(fmt(value))} allocated</title></rect>"
            )
    parts.append("</g>")
    # Capacity: labelled at the end away from the OOM marker.
    if capacity:
        y = sy(capacity)
        parts.append(
            f'<line class="capacity" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
        )
        oom_on_left = oom is not None and sx(oom["x"]) < left + plot_w * 0.4
        label_x, anchor = (width - right - 4, "end") if oom_on_left else (left + 6, "start")
        parts.append(
            f'<text class="capacity-label" x="{label_x}" y="{y - 6:.1f}" text-anchor="{anchor}">'
            f"capacity {esc(fmt(capacity))}</text>"
        )
    # Peak (when the run did not run out of memory) and the OOM.
    if peak and not oom:
        x, y = sx(peak["x"]), sy(peak["bytes"])
        anchor = "start" if x < left + 90 else ("end" if x > width - right - 90 else "middle")
        parts.append(
            f'<g id="peak-marker" class="peak-marker"><circle cx="{x:.1f}" cy="{y:.1f}" r="6"/>'
            f'<text x="{x:.1f}" y="{y - 11:.1f}" text-anchor="{anchor}">peak {esc(fmt(peak["bytes"]))}</text></g>'
        )
    if oom:
        x = sx(oom["x"])
        y_alloc, y_need = sy(oom["allocated_bytes"]), sy(oom["need_bytes"])
        anchor = "end" if x > left + plot_w * 0.6 else "start"
        dx = -12 if anchor == "end" else 12
        parts.append(
            f'<g id="oom-marker" class="oom-marker" data-step="{esc(str(oom["step"]))}" '
            f'data-phase="{esc(oom["phase"])}">'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 24}" y2="{top + plot_h}"/>'
            f'<line class="need" x1="{x:.1f}" x2="{x:.1f}" y1="{y_alloc:.1f}" y2="{y_need:.1f}"/>'
            f'<circle cx="{x:.1f}" cy="{y_need:.1f}" r="7"/>'
            f'<path d="M{x - 3.5:.1f},{y_need - 3.5:.1f}l7,7m0,-7l-7,7"/>'
            f'<text x="{x + dx:.1f}" y="{top - 14}" text-anchor="{anchor}">OOM in step {esc(str(oom["step"]))} '
            f"{esc(oom['phase'])}: needed {esc(fmt(oom['need_bytes']))}</text>"
            f"<title>OOM: {esc(fmt(oom['allocated_bytes']))} allocated + "
            f"{esc(fmt(oom['need_bytes'] - oom['allocated_bytes']))} requested</title></g>"
        )
    parts.append(
        f'<line id="hover-line" class="hover-line" x1="0" x2="0" y1="{top}" y2="{top + plot_h}" visibility="hidden"/>'
    )
    parts.append("</svg>")
    legend = [
        '<span class="lg"><i class="sw sw-line" style="background:#2563eb"></i>allocated, peak of each phase</span>'
    ]
    if ends:
        legend.append(
            '<span class="lg"><i class="sw sw-dash" style="border-color:#0f172a"></i>allocated at the end of each step</span>'
        )
    if reserved and not timeline["reserved_is_allocated"]:
        legend.append(
            '<span class="lg"><i class="sw" style="background:#bfdbfe"></i>reserved, peak of each step</span>'
        )
    legend.append(
        '<span class="lg"><i class="sw sw-dash" style="border-color:#dc2626"></i>capacity</span>'
    )
    if len(allocated) <= DRAW_DOTS_UP_TO:
        used = []
        for point in allocated:
            if point[3] not in used:
                used.append(point[3])
        for phase in used:
            legend.append(
                f'<span class="lg"><i class="sw sw-dot" style="background:{PHASE_COLORS.get(phase, "#334155")}"></i>{esc(phase)}</span>'
            )
    notes = []
    growth = timeline.get("growth_per_step_bytes")
    if growth and ends and capacity and growth * timeline["step_count"] >= 0.01 * capacity:
        growth_note = (
            f'<p class="growth" id="growth">Allocated memory at the end of each step grows by '
            f"{esc(fmt(growth))} per step: memory kept from step to step (a leak?).</p>"
        )
    else:
        growth_note = ""
    if timeline["reserved_is_allocated"] and reserved:
        notes.append(
            "Reserved equals allocated here (no caching allocator), so only allocated is drawn."
        )
    if timeline["downsampled"]:
        shown = sum(len(timeline[key]) for key in ("allocated", "reserved", "end"))
        notes.append(
            f"{timeline['step_count']} steps: {shown} of {timeline['points_total']} points drawn "
            "(the lowest and highest of each stretch, the peak and the OOM always)."
        )
    data = {
        "left": left,
        "plotW": plot_w,
        "width": width,
        "xMin": x_min,
        "xMax": x_max,
        "allocated": allocated,
        "end": ends,
        "reserved": [] if timeline["reserved_is_allocated"] else reserved,
    }
    return (
        '<section class="card" id="timeline"><h2>Memory over the run</h2>'
        '<p class="sub">Allocated memory at the peak of each phase, step by step, against the capacity.</p>'
        f'<div class="chart-wrap">{"".join(parts)}<div id="tooltip" class="tooltip" hidden></div></div>'
        f'<div class="legend">{"".join(legend)}</div>{growth_note}'
        + "".join(f'<p class="hint">{esc(note)}</p>' for note in notes)
        + f'<script type="application/json" id="timeline-data">{json_for_script(data)}</script>'
        "</section>"
    )


# -- breakdown


def stacked_bar(
    categories: list, scale: int, capacity, requested: int = 0, bar_id: str = ""
) -> str:
    segments = []
    for item in categories:
        if item["bytes"] <= 0 or scale <= 0:
            continue
        share = 100.0 * item["bytes"] / scale
        segments.append(
            f'<div class="seg" data-category="{esc(item["name"])}" '
            f'style="width:{share:.3f}%;background:{CATEGORY_COLORS.get(item["name"], "#64748b")}" '
            f'title="{esc(item["name"])}: {esc(fmt(item["bytes"]))}"></div>'
        )
    if requested > 0 and scale > 0:
        segments.append(
            f'<div class="seg seg-requested" style="width:{100.0 * requested / scale:.3f}%" '
            f'title="requested at the OOM: {esc(fmt(requested))}"></div>'
        )
    marker = ""
    if capacity and scale:
        marker = f'<div class="cap-marker" style="left:{min(100.0, 100.0 * capacity / scale):.3f}%"></div>'
    id_attr = f' id="{esc(bar_id)}"' if bar_id else ""
    return f'<div class="stack"{id_attr}>{"".join(segments)}{marker}</div>'
