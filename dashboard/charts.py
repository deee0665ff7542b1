"""Charts drawn on the server as inline SVG: no JavaScript, nothing fetched.

Every string that ends up in the SVG goes through :func:`markupsafe.escape`;
the functions return :class:`markupsafe.Markup` for the templates. Colours
come from classes in ``static/style.css`` (state-verified, tier-archive…),
so the page's Content-Security-Policy can forbid inline styles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pandas as pd
from markupsafe import Markup, escape

from .format import human_bytes

#: Columns of marks per lane of the step chart at most: checkpoints sharing a column merge, so a job of
#: 5,000 (or 500,000) checkpoints draws a few hundred rects, not one per checkpoint.
MAX_MARK_COLUMNS = 300
#: Columns of a time chart's line at most: changes within one column merge (it keeps the value it
#: starts from, its lowest and highest, and the one it ends on), so a line has a few hundred vertices.
MAX_LINE_COLUMNS = 200
#: Neighbouring columns of one state drawn as one bar, at most: a long run still offers a link every few columns.
MAX_RUN_COLUMNS = 8
#: Which state wins a pixel shared by several checkpoints (first wins).
STATE_PRIORITY = ("corrupt", "degraded", "missing", "incomplete", "committed", "verified", "drilled", "present", "deleted")


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (1-2-5 steps)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _fmt_step(v: float) -> str:
    v = int(v)
    if v >= 1_000_000 and v % 1_000_000 == 0:
        return f"{v // 1_000_000}M"
    if v >= 1000 and v % 1000 == 0:
        return f"{v // 1000}k"
    return f"{v:,}"


@dataclass(frozen=True)
class Mark:
    """One checkpoint in one lane of the step chart."""

    step: int
    lane: str  # "hot" | "archive" | "deleted"
    cls: str  # CSS class suffix: a state or copy state
    title: str
    href: str


def step_chart(marks: Sequence[Mark], *, milestones: Sequence[int] = (), recovery_step: int | None = None,
               width: int = 1100, lane_height: int = 22) -> Markup:
    """Checkpoints along the step axis: a lane per tier (and one for tombstones),
    each tick coloured by state; milestones as triangles above the axis; the
    recovery point as a flag. Ticks sharing a pixel merge, the most severe
    state showing (:data:`STATE_PRIORITY`)."""
    lanes = [lane for lane in ("hot", "archive", "deleted") if any(m.lane == lane for m in marks)] or ["hot"]
    left, right, top = 70, 24, 26
    plot_w = width - left - right
    height = top + lane_height * len(lanes) + 40
    if not marks:
        return Markup(f'<svg class="chart" viewBox="0 0 {width} 60" role="img" aria-label="no checkpoints">'
                      f'<text x="{left}" y="34" class="muted">no checkpoints</text></svg>')
    steps = [m.step for m in marks]
    lo, hi = min(steps), max(steps)
    if lo <= hi * 0.25:  # a run seen from its start: the axis starts at step 0
        lo = min(lo, 0)
    span = max(hi - lo, 1)
    pad = 6.0  # pixels, so that the first and last ticks are whole

    def x(step: float) -> float:
        return left + pad + (step - lo) / span * (plot_w - 2 * pad)

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="checkpoints by step">']
    for i, lane in enumerate(lanes):
        y = top + i * lane_height
        out.append(f'<rect class="lane" x="{left}" y="{y + 2}" width="{plot_w}" height="{lane_height - 4}"/>')
        out.append(f'<text class="axis-label" x="{left - 8}" y="{y + lane_height / 2 + 4}" text-anchor="end">{lane}</text>')
    axis_y = top + lane_height * len(lanes) + 4
    out.append(f'<line class="axis" x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}"/>')
    for t in nice_ticks(lo, hi, 8):
        xt = x(t)
        out.append(f'<line class="tick" x1="{xt:.1f}" y1="{axis_y}" x2="{xt:.1f}" y2="{axis_y + 4}"/>')
        out.append(f'<text class="axis-label" x="{xt:.1f}" y="{axis_y + 16}" text-anchor="middle">{_fmt_step(t)}</text>')
    out.append(f'<text class="axis-label" x="{left + plot_w}" y="{axis_y + 30}" text-anchor="end">step</text>')

    # Milestones: a triangle above the lanes and a faint guide line through them.
    bottom = top + lane_height * len(lanes)
    for m in sorted(set(milestones)):
        xm = x(m)
        out.append(f'<line class="milestone-guide" x1="{xm:.1f}" y1="{top}" x2="{xm:.1f}" y2="{bottom}"/>')
        out.append(f'<path class="milestone" d="M{xm - 4:.1f},{top - 9} L{xm + 4:.1f},{top - 9} L{xm:.1f},{top - 2} Z">'
                   f'<title>milestone: step {m:,}</title></path>')

    # Ticks, merged per column (at most MAX_MARK_COLUMNS per lane), and neighbouring columns of one
    # state merged into one bar of up to MAX_RUN_COLUMNS columns (a lane of 5,000 tombstones is a few
    # dozen bars, not 300 ticks with a link and a title each).
    tick_w = max(1.5, min(8.0, plot_w / max(len(set(steps)), 1) * 0.7))
    column_w = max(tick_w, 1.0, plot_w / MAX_MARK_COLUMNS)
    buckets: dict[tuple[str, int], list[Mark]] = {}
    for mark in marks:
        buckets.setdefault((mark.lane, int(x(mark.step) // column_w)), []).append(mark)
    runs: list[tuple[str, list[int], list[list[Mark]]]] = []  # lane, its columns, each column's marks
    for (lane, px), group in sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[1][0].step)):
        group.sort(key=lambda m: (STATE_PRIORITY.index(m.cls) if m.cls in STATE_PRIORITY else 99, m.step))
        last = runs[-1] if runs else None
        if (last is not None and last[0] == lane and last[2][-1][0].cls == group[0].cls
                and px == last[1][-1] + 1 and len(last[1]) < MAX_RUN_COLUMNS):
            last[1].append(px)
            last[2].append(group)
        else:
            runs.append((lane, [px], [group]))
    for lane, _cols, groups in runs:
        y = top + lanes.index(lane) * lane_height
        shown = groups[0][0]
        every = [m for g in groups for m in g]
        xs = x(shown.step) - tick_w / 2
        w = x(max(m.step for m in groups[-1])) + tick_w / 2 - xs if len(groups) > 1 else tick_w
        title = shown.title if len(every) == 1 else f"{len(every)} checkpoints, steps {min(g.step for g in every):,}–" \
                                                    f"{max(g.step for g in every):,}; worst: {shown.title}"
        out.append(f'<a href="{escape(shown.href)}"><rect class="mark st-{escape(shown.cls)}" x="{xs:.1f}" y="{y + 4}" '
                   f'width="{w:.1f}" height="{lane_height - 8}"><title>{escape(title)}</title></rect></a>')

    if recovery_step is not None:
        xr = x(recovery_step)
        out.append(f'<line class="recovery" x1="{xr:.1f}" y1="{top - 14}" x2="{xr:.1f}" y2="{bottom}"/>')
        anchor = "end" if xr > left + plot_w * 0.8 else "start"
        dx = -4 if anchor == "end" else 4
        out.append(f'<text class="recovery-label" x="{xr + dx:.1f}" y="{top - 14}" text-anchor="{anchor}">'
                   f'recovery point {recovery_step:,}</text>')
    out.append("</svg>")
    return Markup("".join(out))


def step_points(points: Sequence[tuple[float, float]], column_w: float) -> list[tuple[float, float]]:
    """The vertices of a step line through ``points`` (x ascending: each value holds until the next x).

    Points whose x fall in the same ``column_w``-wide column merge: the line
    reaches the column at the value it held, spans the lowest and highest
    value inside it, and leaves at the last one, so that a line of any
    length has at most six vertices per column and every peak is still
    drawn.
    """
    out: list[tuple[float, float]] = []
    i, n = 0, len(points)
    width = max(column_w, 1e-9)
    while i < n:
        col = int(points[i][0] // width)
        j = i
        while j + 1 < n and int(points[j + 1][0] // width) == col:
            j += 1
        x0 = points[i][0]
        if out:
            out.append((x0, out[-1][1]))  # the held value, carried to this column
        if j == i:
            out.append(points[i])
        else:
            ys = [p[1] for p in points[i:j + 1]]
            first, last = ys[0], ys[-1]
            out.append((x0, first))
            for v in (min(ys), max(ys)):
                if v not in (first, last):
                    out.append((x0, v))
            out.append((x0, last))
            if points[j][0] != x0:
                out.append((points[j][0], last))
        i = j + 1
    return out


def _time_label(t: datetime, span_s: float) -> str:
    if span_s <= 10:
        return t.strftime("%H:%M:%S.%f")[:-4]
    if span_s <= 120:
        return t.strftime("%H:%M:%S")
    if span_s <= 2 * 86400:
        return t.strftime("%H:%M")
    return t.strftime("%Y-%m-%d")


@dataclass(frozen=True)
class Series:
    """A step line of the time chart: a CSS class, a label and values per time."""

    cls: str
    label: str
    values: Sequence[float]
    fill: bool = False


def time_chart(times: Sequence[datetime] | pd.DatetimeIndex, series: Sequence[Series], *, width: int = 1100, height: int = 200,
               fmt: Callable[[float], str] = human_bytes, label: str = "storage over time") -> Markup:
    """Step lines over time (a value holds until the next point), y from 0.

    When the last point only carries the values forward to now and that
    flat tail is longer than all the changes before it, the axis ends
    shortly after the last change and a note says the values held since
    (so a burst of activity is not squeezed into the left edge). ``label``
    names the chart (its ``aria-label``). Each line has at most a few
    hundred vertices (:func:`step_points`), however many points it has.
    ``times`` may be a :class:`pandas.DatetimeIndex` (a table's column, read
    without a Timestamp per point).
    """
    if len(times) == 0:
        return Markup(f'<svg class="chart" viewBox="0 0 {width} 60" role="img" aria-label="no history">'
                      f'<text x="70" y="34" class="muted">no history yet</text></svg>')
    left, right, top, bottom = 70, 16, 24, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    stamps = pd.DatetimeIndex(times)
    if stamps.tz is None:
        stamps = stamps.tz_localize("UTC")
    epoch = np.asarray((stamps - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1), dtype=np.float64)
    ts = epoch.tolist()
    tz = pd.Timestamp(times[0]).tz
    t0, t_end = ts[0], ts[-1]
    held_since: float | None = None
    if len(ts) >= 3 and all(s.values[-1] == s.values[-2] for s in series if len(s.values) >= 2):
        busy, tail = ts[-2] - ts[0], ts[-1] - ts[-2]
        if tail > busy:
            held_since = ts[-2]
            t_end = ts[-2] + max(busy * 0.12, 1.0)
    span = max(t_end - t0, 1e-3)
    vmax = float(max([max(s.values) for s in series if len(s.values)] + [1]))
    yticks = nice_ticks(0, vmax * 1.05, 4)
    ymax = max(yticks[-1], vmax)

    def x(t: float) -> float:
        return left + (min(t, t_end) - t0) / span * plot_w

    def y(v: float) -> float:
        return top + plot_h - v / ymax * plot_h

    xs = (left + (np.minimum(epoch, t_end) - t0) / span * plot_w).tolist()
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}">']
    for v in yticks:
        out.append(f'<line class="grid" x1="{left}" y1="{y(v):.1f}" x2="{left + plot_w}" y2="{y(v):.1f}"/>')
        out.append(f'<text class="axis-label" x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{escape(fmt(v))}</text>')
    out.append(f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}"/>')
    n_labels = 6
    for i in range(n_labels + 1):
        tt = t0 + span * i / n_labels
        label = _time_label(datetime.fromtimestamp(tt, tz=tz), span)
        anchor = "start" if i == 0 else "end" if i == n_labels else "middle"
        out.append(f'<text class="axis-label" x="{x(tt):.1f}" y="{top + plot_h + 16}" text-anchor="{anchor}">'
                   f'{escape(label)}</text>')
    for s in series:
        if not len(s.values):
            continue
        ys = (top + plot_h - np.asarray(s.values, dtype=np.float64) / ymax * plot_h).tolist()
        pts = step_points(list(zip(xs, ys, strict=True)), plot_w / MAX_LINE_COLUMNS)
        if held_since is not None:
            pts.append((left + plot_w, pts[-1][1]))
        path = " ".join(f"{'M' if i == 0 else 'L'}{px:.1f},{py:.1f}" for i, (px, py) in enumerate(pts))
        if s.fill:
            out.append(f'<path class="area {escape(s.cls)}" d="{path} L{pts[-1][0]:.1f},{y(0):.1f} '
                       f'L{pts[0][0]:.1f},{y(0):.1f} Z"/>')
        out.append(f'<path class="line {escape(s.cls)}" d="{path}"><title>{escape(s.label)}: now '
                   f'{escape(fmt(s.values[-1]))}, peak {escape(fmt(max(s.values)))}</title></path>')
    if held_since is not None:
        since = datetime.fromtimestamp(held_since, tz=tz).strftime("%Y-%m-%d %H:%M:%S")
        until = datetime.fromtimestamp(ts[-1], tz=tz).strftime("%Y-%m-%d %H:%M:%S")
        out.append(f'<text class="axis-label note" x="{left + plot_w}" y="{top - 10}" text-anchor="end">'
                   f'unchanged since {escape(since)} until now ({escape(until)})</text>')
    out.append("</svg>")
    return Markup("".join(out))
