"""The HTML page's sections below the summary: breakdown, ranks, diagnoses,
modules, allocation sites, fixes, notes, and the navigation to them."""

from __future__ import annotations

from oomdoc.categories import shown
from oomdoc.reporters.html.drawing import (
    CATEGORY_COLORS,
    Ids,
    badge,
    code_block,
    esc,
    fmt,
    oom_moment,
    percent,
    stacked_bar,
)


def breakdown_html(view: dict) -> str:
    breakdown = view["breakdown"]
    capacity = breakdown["capacity_bytes"]
    total = breakdown["total_bytes"]
    requested = breakdown["requested_bytes"]
    scale = max(capacity or 0, total + requested, 1)
    names = shown({item["name"]: item["bytes"] for item in breakdown["categories"]})
    rows = []
    for item in breakdown["categories"]:
        if item["name"] not in names:
            continue
        color = CATEGORY_COLORS.get(item["name"], "#64748b")
        share_of_total = 100.0 * item["bytes"] / total if total else 0.0
        rows.append(
            f'<tr data-category="{esc(item["name"])}"><td><i class="sw" style="background:{color}"></i>'
            f'{esc(item["name"])}</td><td class="num">{esc(fmt(item["bytes"]))}</td>'
            f'<td class="num">{esc(percent(item["bytes"], capacity))}</td>'
            f'<td class="barcell"><div class="minibar"><div style="width:{share_of_total:.2f}%;background:{color}"></div></div></td></tr>'
        )
    rows.append(
        f'<tr class="total"><td>total</td><td class="num">{esc(fmt(total))}</td>'
        f'<td class="num">{esc(percent(total, capacity))}</td><td></td></tr>'
    )
    if requested:
        rows.append(
            f'<tr class="requested"><td><i class="sw sw-requested"></i>requested at the OOM</td>'
            f'<td class="num">{esc(fmt(requested))}</td><td class="num">{esc(percent(requested, capacity))}</td><td></td></tr>'
        )
    where = view["device"].get("name") or "the device"
    if view["device"].get("kind") == "simulated":
        where = "the simulated device"
    return (
        f'<section class="card" id="breakdown"><h2>What filled {esc(where)} ({esc(breakdown["label"])})</h2>'
        + stacked_bar(breakdown["categories"], scale, capacity, requested, "breakdown-bar")
        + f'<div class="stack-scale"><span>0</span><span>capacity {esc(fmt(capacity))}</span></div>'
        + '<table class="tbl breakdown-table"><thead><tr><th>category</th><th class="num">bytes</th>'
        '<th class="num">% of capacity</th><th>share of what was in use</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></section>"
    )


# -- modules and sites


def modules_html(view: dict) -> str:
    modules = view.get("modules")
    if not modules or not modules["items"]:
        return ""
    items = modules["items"]
    scale = max((item["total_bytes"] for item in items), default=1) or 1
    names = shown(*(item["bytes"] for item in items))
    rows = []
    for item in items:
        blocks = f"{item['blocks']} blocks" if item["blocks"] and item["blocks"] > 1 else ""
        segments = "".join(
            f'<div class="seg" style="width:{100.0 * value / scale:.3f}%;background:{CATEGORY_COLORS[name]}" '
            f'title="{esc(name)}: {esc(fmt(value))}"></div>'
            for name, value in item["bytes"].items()
            if value > 0
        )
        cells = "".join(
            f'<td class="num">{esc(fmt(item["bytes"][name])) if item["bytes"][name] else "-"}</td>'
            for name in names
        )
        blocks_badge = " " + badge(blocks, "neutral") if blocks else ""
        rows.append(
            f'<tr><td class="modname"><code>{esc(item["path"])}</code> <span class="muted">{esc(item["class"])}</span>'
            f"{blocks_badge}</td>"
            f'<td class="num strong">{esc(fmt(item["total_bytes"]))}</td>{cells}'
            f'<td class="barcell"><div class="stack small">{segments}</div></td></tr>'
        )
    headers = "".join(f'<th class="num">{esc(name)}</th>' for name in names)
    more = (
        f'<p class="hint">The {len(items)} largest of {modules["total"]} modules.</p>'
        if modules["total"] > len(items)
        else ""
    )
    return (
        '<section class="card" id="modules"><h2>Top modules</h2>'
        '<p class="sub">Bytes allocated in each module\'s forward and backward; repeated blocks folded.</p>'
        '<div class="scroll"><table class="tbl modules-table"><thead><tr><th>module</th><th class="num">total</th>'
        f"{headers}<th></th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>{more}</section>"
    )


def sites_html(view: dict) -> str:
    sites = view["sites"]
    if not sites["items"]:
        return ""
    scale = max((item["bytes"] for item in sites["items"]), default=1) or 1
    rows = []
    for item in sites["items"]:
        color = CATEGORY_COLORS.get(item["category"], "#64748b")
        stack = (
            "<ol class='stack-frames'>"
            + "".join(f"<li><code>{esc(frame)}</code></li>" for frame in item["stack"])
            + "</ol>"
            if item["stack"]
            else "<p class='muted'>No stack recorded for this site.</p>"
        )
        rows.append(
            '<details class="site"><summary>'
            f'<span class="site-bytes">{esc(fmt(item["bytes"]))}</span>'
            f'<span class="site-bar"><i style="width:{100.0 * item["bytes"] / scale:.2f}%;background:{color}"></i></span>'
            f'<span class="site-cat"><i class="sw" style="background:{color}"></i>{esc(item["category"])}</span>'
            f'<span class="site-loc"><code>{esc(item["location"] or "(no Python location)")}</code>'
            + (
                f' <span class="site-module">in <code>{esc(item["module"])}</code></span>'
                if item["module"]
                else ""
            )
            + "</span>"
            f'<span class="site-tensors">{esc(item["tensors"])}</span>'
            f"</summary>{stack}</details>"
        )
    more = (
        f'<p class="hint">The {len(sites["items"])} largest of {sites["total"]} sites.</p>'
        if sites["total"] > len(sites["items"])
        else ""
    )
    return (
        '<section class="card" id="sites"><h2>Allocation sites</h2>'
        '<p class="sub">Live memory by the line of your code and the module that allocated it; open a row for its stack.</p>'
        '<div class="site-head"><span>bytes</span><span></span><span>category</span><span>location</span><span>tensors</span></div>'
        f"{''.join(rows)}{more}</section>"
    )


# -- fixes, diagnoses, ranks, notes


def fixes_html(view: dict, ids: Ids) -> str:
    fixes = view["fixes"]
    if not fixes["items"] and not fixes["skipped"]:
        return ""
    capacity = fixes.get("capacity_bytes") or view["device"].get("capacity_bytes") or 0
    need = fixes.get("need_bytes")
    peaks = [fix["peak_allocated_bytes"] or 0 for fix in fixes["items"]]
    scale = max([capacity, need or 0, *peaks, 1]) * 1.05
    cap_left = 100.0 * capacity / scale if capacity else None
    cap_marker = f'<div class="cap-marker" style="left:{cap_left:.3f}%"></div>' if cap_left else ""
    rows = []
    if need:
        label = "failing run needs" + (" (estimate)" if fixes["need_estimated"] else "")
        rows.append(
            '<div class="fixrow baseline"><div class="fixname">as it is</div>'
            f'<div class="track"><div class="bar bar-need" style="width:{100.0 * need / scale:.3f}%"></div>{cap_marker}</div>'
            f'<div class="fixnums"><strong>{esc(fmt(need))}</strong> <span class="muted">{esc(label)}</span></div></div>'
        )
    for fix in fixes["items"]:
        peak = fix["peak_allocated_bytes"]
        fits = fix["fits"] is True
        width = 100.0 * (peak or 0) / scale
        lower_bound = not fits and fix["measured"] and peak is not None
        bar_class = "bar-fits" if fits else ("bar-lower" if lower_bound else "bar-no")
        if not fix["measured"]:
            bar_class += " bar-estimated"
        peak_text = ("> " if lower_bound else "") + fmt(peak) if peak is not None else "?"
        nums = [f"<strong>{esc(peak_text)}</strong>"]
        if fix["saved_bytes"] is not None:
            nums.append(f'<span class="muted">saves {esc(fmt(fix["saved_bytes"]))}</span>')
        if fix["step_time_ratio"] is not None:
            noise = f" +-{fix['step_time_noise']:.0%}" if fix.get("step_time_noise") else ""
            nums.append(
                f'<span class="muted">step time {fix["step_time_ratio"]:.2f}x{esc(noise)}</span>'
            )
        details = ""
        if fix["detail"] or fix["snippet"]:
            body = f"<p>{esc(fix['detail'])}</p>" if fix["detail"] else ""
            if fix["snippet"]:
                body += code_block(fix["snippet"], ids.next("fix"))
            details = f'<details class="fixdetail"{" open" if fits and fix is _first_fitting(fixes) else ""}><summary>how, and what was found</summary>{body}</details>'
        rows.append(
            f'<div class="fixrow{" fits" if fits else ""}" data-fix="{esc(fix["name"])}" data-fits="{"yes" if fits else "no"}">'
            f'<div class="fixname"><span class="rank">{esc(str(fix["rank"]))}</span>{esc(fix["name"])}'
            f"<br>{badge(fix['status'], 'good' if fits else 'bad')} "
            f"{badge('measured' if fix['measured'] else 'estimated', 'neutral')}</div>"
            f'<div class="track"><div class="bar {bar_class}" style="width:{width:.3f}%"></div>{cap_marker}</div>'
            f'<div class="fixnums">{" ".join(nums)}</div>{details}</div>'
        )
    facts = []
    if capacity:
        facts.append(f"capacity {fmt(capacity)} (red line)")
    if fixes.get("max_batch_size"):
        facts.append(
            f"largest batch that fits: {fixes['max_batch_size']} "
            f"({fixes['max_batch_size'] + 1} ran out of memory)"
        )
    skipped = "".join(
        f"<li><strong>{esc(item['name'])}</strong>: {esc(item['reason'] or '')}</li>"
        for item in fixes["skipped"]
    )
    title = (
        "Fixes, measured by replaying the failing step"
        if fixes["measured"]
        else "Fixes, estimated from the breakdown (not measured: oomdoc run replays measure them)"
    )
    return (
        f'<section class="card" id="fixes"><h2>{esc(title)}</h2>'
        f'<p class="sub">Peak memory of each fix against the capacity; green ones fit. {esc("; ".join(facts))}</p>'
        f'<div class="fixes">{"".join(rows)}</div>'
        + (f'<h3>Not tried</h3><ul class="skipped">{skipped}</ul>' if skipped else "")
        + "</section>"
    )


def _first_fitting(fixes: dict):
    return next((fix for fix in fixes["items"] if fix["fits"] is True), None)


def diagnoses_html(view: dict, ids: Ids) -> str:
    diagnoses = view["diagnoses"]
    if not diagnoses:
        return ""
    cards = []
    for number, item in enumerate(diagnoses, start=1):
        kind = item["kind"]
        evidence = "".join(f"<li>{esc(line)}</li>" for line in item["evidence"])
        remedy = code_block(item["remedy"], ids.next("remedy")) if item["remedy"] else ""
        fixes = (
            f'<p class="muted">fixes: {esc(", ".join(item["fixes"]))}</p>'
            if item["fixes"] and not item["remedy"]
            else ""
        )
        bug = kind in ("leak", "grad_in_eval")
        held = f' <span class="muted">{esc(fmt(item["bytes"]))}</span>' if item["bytes"] else ""
        evidence_list = f"<ul>{evidence}</ul>" if evidence else ""
        cards.append(
            f'<div class="diag{" bug" if bug else ""}" data-kind="{esc(kind)}">'
            f'<div class="diag-head"><span class="num-circle">{number}</span>{badge(kind, "bad" if bug else "neutral")}'
            f"{held}</div>"
            f'<p class="diag-summary">{esc(item["summary"])}</p>'
            f"{evidence_list}{remedy}{fixes}</div>"
        )
    return (
        '<section class="card" id="diagnoses"><h2>Diagnosis, most important first</h2>'
        f"{''.join(cards)}</section>"
    )


def _rank_oom_text(oom: dict) -> str:
    where = oom_moment(oom)
    asked = f"asked {fmt(oom['requested_bytes'])}" if oom.get("requested_bytes") else ""
    return ", ".join(part for part in (where, asked) if part) or "out of memory"


def ranks_html(view: dict) -> str:
    ranks = view.get("ranks")
    if not ranks or not ranks["items"]:
        return ""
    items = ranks["items"]
    first = ranks.get("first_failing_rank")
    scale = max(
        [item["total_bytes"] for item in items]
        + [item["device"]["capacity_bytes"] or 0 for item in items]
        + [1]
    )
    header = []
    for item in items:
        label = f"rank {item['rank']}" if item["rank"] is not None else "rank ?"
        where = " · ".join(
            part
            for part in (
                item["host"] or "",
                f"local {item['local_rank']}" if item["local_rank"] is not None else "",
            )
            if part
        )
        first_badge = (
            badge("first to fail", "bad") if first is not None and item["rank"] == first else ""
        )
        header.append(
            f'<th class="rankcol{" first" if first is not None and item["rank"] == first else ""}" '
            f'data-rank="{esc(str(item["rank"]))}">{esc(label)}<div class="muted small">{esc(where)}</div>{first_badge}</th>'
        )

    def row(label: str, cells: list) -> str:
        return f"<tr><th>{esc(label)}</th>{''.join(f'<td>{cell}</td>' for cell in cells)}</tr>"

    outcome_cells = [
        badge(
            item["outcome"],
            "bad"
            if item["outcome"] in ("oom", "error")
            else "good"
            if item["outcome"] == "ok"
            else "neutral",
        )
        for item in items
    ]
    oom_cells = [
        esc(_rank_oom_text(item["oom"])) if item["oom"] else '<span class="muted">-</span>'
        for item in items
    ]
    bars = []
    chart_h = 120
    for item in items:
        capacity = item["device"]["capacity_bytes"]
        y = chart_h
        rects = []
        for category in item["breakdown"]:
            if category["bytes"] <= 0:
                continue
            h = chart_h * category["bytes"] / scale
            y -= h
            rects.append(
                f'<rect x="8" y="{y:.1f}" width="34" height="{h:.1f}" fill="{CATEGORY_COLORS[category["name"]]}">'
                f"<title>{esc(category['name'])}: {esc(fmt(category['bytes']))}</title></rect>"
            )
        if capacity:
            cy = chart_h - chart_h * capacity / scale
            rects.append(f'<line class="capline" x1="2" x2="48" y1="{cy:.1f}" y2="{cy:.1f}"/>')
        bars.append(
            f'<svg class="rankbar" viewBox="0 0 50 {chart_h}" width="50" height="{chart_h}">{"".join(rects)}</svg>'
        )
    sparks = []
    for item in items:
        points = item["steps"]
        if len(points) < 2:
            sparks.append('<span class="muted">-</span>')
            continue
        xs = [point[0] for point in points]
        top = max([point[1] for point in points] + [item["device"]["capacity_bytes"] or 0, 1])
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        line = " ".join(
            f"{2 + 116 * (x - x0) / (x1 - x0):.1f},{38 - 34 * value / top:.1f}"
            for x, value in points
        )
        sparks.append(
            f'<svg class="spark" viewBox="0 0 120 40" width="120" height="40"><polyline points="{line}"/></svg>'
        )
    rows = [
        row("outcome", outcome_cells),
        row("OOM", oom_cells),
        row("peak allocated", [esc(fmt(item["peak_allocated_bytes"])) for item in items]),
        row(
            "in use (breakdown)",
            [f"<strong>{esc(fmt(item['total_bytes']))}</strong>" for item in items],
        ),
    ]
    by_rank = [{c["name"]: c["bytes"] for c in item["breakdown"]} for item in items]
    for category in shown(*by_rank):
        rows.append(
            row(
                category,
                [esc(fmt(held.get(category, 0))) for held in by_rank],
            )
        )
    rows.append(row("breakdown", bars))
    rows.append(row("peak per step", sparks))
    facts = [f"world size {ranks['world_size']}"] if ranks.get("world_size") is not None else []
    if first is not None:
        facts.append(f"rank {first} ran out of memory first")
    return (
        '<section class="card" id="ranks"><h2>Ranks</h2>'
        f'<p class="sub">{esc("; ".join(facts))}</p>'
        '<div class="scroll"><table class="tbl ranks-table"><thead><tr><th></th>'
        f"{''.join(header)}</tr></thead><tbody>{''.join(rows)}</tbody></table></div></section>"
    )


def notes_html(view: dict) -> str:
    if not view["notes"]:
        return ""
    return (
        '<section class="card notes" id="notes"><h2>Notes</h2><ul>'
        + "".join(f"<li>{esc(note)}</li>" for note in view["notes"])
        + "</ul></section>"
    )


def nav_html(view: dict) -> str:
    links = [("timeline", "Timeline"), ("breakdown", "Breakdown")]
    if view.get("ranks") and view["ranks"]["items"]:
        links.append(("ranks", "Ranks"))
    if view["diagnoses"]:
        links.append(("diagnoses", "Diagnosis"))
    if view.get("modules") and view["modules"]["items"]:
        links.append(("modules", "Modules"))
    if view["sites"]["items"]:
        links.append(("sites", "Sites"))
    if view["fixes"]["items"] or view["fixes"]["skipped"]:
        links.append(("fixes", "Fixes"))
    return (
        '<nav class="nav">'
        + "".join(f'<a href="#{target}">{esc(label)}</a>' for target, label in links)
        + "</nav>"
    )
