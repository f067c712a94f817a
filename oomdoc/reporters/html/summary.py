"""The top of the HTML page: the header (headline, command, device, the OOM's
place), the summary cards and the prescription."""

from __future__ import annotations

from oomdoc.reporters.html.drawing import Ids, badge, code_block, esc, fmt, oom_moment, percent


def _outcome_badge(outcome: str) -> str:
    return {
        "oom": badge("out of memory", "bad"),
        "ok": badge("fit", "good"),
        "error": badge("failed", "bad"),
        "interrupted": badge("interrupted", "warn"),
    }.get(outcome, badge(outcome or "unknown", "neutral"))


def _stat(label: str, value: str, sub: str = "", kind: str = "") -> str:
    return (
        f'<div class="stat {esc(kind)}"><div class="stat-label">{esc(label)}</div>'
        f'<div class="stat-value">{esc(value)}</div>'
        f'<div class="stat-sub">{esc(sub)}</div></div>'
    )


def header_html(view: dict) -> str:
    device = view["device"]
    meta = []
    if view.get("command"):
        meta.append(
            f'<div><span class="k">command</span> <code>{esc(view["command"])}</code></div>'
        )
    device_text = f"{device.get('name') or 'device'}"
    if device.get("kind") and device["kind"] not in device_text:
        device_text += f" ({device['kind']})"
    meta.append(
        f'<div><span class="k">device</span> {esc(device_text)}, capacity '
        f"{esc(fmt(device.get('capacity_bytes')))}</div>"
    )
    versions = ", ".join(
        part
        for part in (
            f"torch {view['torch_version']}" if view.get("torch_version") else "",
            f"oomdoc {view['oomdoc_version']}" if view.get("oomdoc_version") else "",
        )
        if part
    )
    when = " · ".join(part for part in (view.get("created_at") or "", versions) if part)
    if when:
        meta.append(f'<div><span class="k">recorded</span> {esc(when)}</div>')
    oom = view.get("oom")
    callout = ""
    if oom:
        where = (
            f"<div class='oom-where'>at <code>{esc(oom['location'])}</code></div>"
            if oom.get("location")
            else ""
        )
        message = (
            f"<details class='oom-message'><summary>PyTorch's message</summary>"
            f"<pre>{esc(oom['message'])}</pre></details>"
            if oom.get("message")
            else ""
        )
        callout = f'<div class="callout bad">{where}{message}</div>'
    return (
        '<header class="top">'
        '<div class="brand">oomdoc <span>memory report</span></div>'
        f'<h1 id="headline">{_outcome_badge(view["outcome"])} {esc(view["headline"])}</h1>'
        f'<div class="meta">{"".join(meta)}</div>{callout}</header>'
    )


def stats_html(view: dict) -> str:
    device = view["device"]
    capacity = device.get("capacity_bytes")
    cards = []
    oom = view.get("oom")
    peak = view.get("peak") or {}
    if oom:
        cards.append(
            _stat(
                "needed at the OOM",
                fmt(oom.get("need_bytes")),
                f"{percent(oom.get('need_bytes'), capacity)} of capacity",
                "bad",
            )
        )
        where = oom_moment(oom)
        cards.append(
            _stat("ran out in", where or "?", f"asked for {fmt(oom.get('requested_bytes'))}")
        )
    elif peak:
        cards.append(
            _stat(
                "peak allocated",
                fmt(peak.get("allocated_bytes")),
                f"{percent(peak.get('allocated_bytes'), capacity)} of capacity",
            )
        )
        if peak.get("step") is not None:
            cards.append(_stat("peak in", f"step {peak['step']} {peak.get('phase') or ''}".strip()))
    cards.append(_stat("capacity", fmt(capacity), f"{device.get('kind') or 'device'} memory"))
    if view.get("max_batch_size"):
        whole_run = view.get("whole_run_batch") or {}
        certified = whole_run.get("batch_size")
        sub = f"{view['max_batch_size'] + 1} ran out of memory"
        if certified == view["max_batch_size"] and not whole_run.get("setting"):
            sub += "; certified for the whole run"
        elif whole_run and certified is None:
            sub += "; not certified for the whole run"
        cards.append(_stat("largest batch that fits", str(view["max_batch_size"]), sub, "good"))
        if certified and whole_run.get("setting"):
            cards.append(
                _stat(
                    "largest batch for the whole run",
                    str(certified),
                    f"with {whole_run['setting']} (certified)",
                    "good",
                )
            )
    fitting = [fix for fix in view["fixes"]["items"] if fix["fits"] is True]
    if view["fixes"]["items"]:
        cards.append(
            _stat(
                "fixes that fit",
                f"{len(fitting)} of {len(view['fixes']['items'])}",
                "measured by replays" if view["fixes"]["measured"] else "estimated",
                "good" if fitting else "",
            )
        )
    return f'<div class="stats">{"".join(cards)}</div>'


def _prescription_section(body: str, prescription: dict, ids: Ids) -> str:
    snippet = (
        code_block(prescription["snippet"], ids.next("prescription"))
        if prescription.get("snippet")
        else ""
    )
    return (
        '<section class="card prescription" id="prescription"><h2>Prescription</h2>'
        f"{body}{snippet}</section>"
    )


def prescription_html(view: dict, ids: Ids) -> str:
    prescription = view.get("prescription")
    if prescription and prescription.get("kind") == "leak":
        return _prescription_section(
            f'<p class="lead">Fix the leak first {badge("leak", "bad")}</p>'
            f"<p>{esc(prescription.get('detail') or '')}</p>",
            prescription,
            ids,
        )
    if prescription:
        names = " + ".join(prescription["fixes"]) or "as it is"
        facts = []
        if prescription.get("batch_size") is not None:
            batch = f"batch size {prescription['batch_size']}"
            if (prescription.get("accumulation_steps") or 1) > 1:
                batch += f" x {prescription['accumulation_steps']} accumulation steps"
            facts.append(batch)
        if prescription.get("evaluation_batch_size") is not None:
            facts.append(
                f"evaluation batch {prescription['evaluation_batch_size']} "
                f"({prescription.get('evaluation_batch_option') or ''} "
                f"{prescription['evaluation_batch_size']})"
            )
        if prescription.get("peak_allocated_bytes") is not None:
            facts.append(
                f"peak {fmt(prescription['peak_allocated_bytes'])} of "
                f"{fmt(view['device'].get('capacity_bytes'))}"
            )
        if prescription.get("headroom_bytes") is not None:
            facts.append(f"headroom {fmt(prescription['headroom_bytes'])}")
        if prescription.get("samples_per_second") is not None:
            throughput = f"{prescription['samples_per_second']:.1f} samples/s"
            if prescription.get("samples_per_second_noise"):
                throughput += f" (+-{prescription['samples_per_second_noise']:.0%})"
            measured_at = prescription.get("throughput_batch_size")
            if measured_at is not None and measured_at != prescription.get("batch_size"):
                throughput += f" (measured at batch {measured_at})"
            facts.append(throughput)
        if prescription.get("accumulation_measured") is True:
            facts.append("peak measured with the gradient accumulation running")
        elif prescription.get("accumulation_measured") is False:
            facts.append("peak of one micro-batch, not measured with the accumulation")
        flags = prescription.get("verified_by_flags")
        if flags:
            verdict = flags.get("outcome") or "?"
            if flags.get("peak_allocated_bytes") is not None:
                verdict += f", peak {fmt(flags['peak_allocated_bytes'])}"
            if flags.get("samples_per_second") is not None:
                verdict += f", {flags['samples_per_second']:.1f} samples/s"
            facts.append(f"replayed with your script's own flags ({flags['args']}): {verdict}")
        how = {True: "measured", False: "estimated"}.get(prescription.get("measured"), "")
        fits = prescription.get("fits")
        fit_badge = (
            badge("fits", "good")
            if fits
            else (badge("does not fit", "bad") if fits is False else "")
        )
        return _prescription_section(
            f'<p class="lead">Use <strong>{esc(names)}</strong> {fit_badge} '
            f"{badge(how, 'neutral') if how else ''}</p>"
            f'<ul class="facts">{"".join(f"<li>{esc(fact)}</li>" for fact in facts)}</ul>'
            + (
                f'<pre class="certificate">{esc(chr(10).join(prescription["certificate"]))}</pre>'
                if prescription.get("certificate")
                else ""
            )
            + (
                f'<pre class="considered">{esc(chr(10).join(prescription["considered"]))}</pre>'
                if prescription.get("considered")
                else ""
            ),
            prescription,
            ids,
        )
    top = view.get("top_fixes") or []
    if not top:
        return ""
    measured = view["fixes"]["measured"]
    capacity = view["device"].get("capacity_bytes")
    cards = []
    for fix in top:
        ratio = fix.get("step_time_ratio")
        sub = []
        if fix.get("peak_allocated_bytes") is not None:
            prefix = "" if fix["fits"] or not fix["measured"] else "> "
            sub.append(f"peak {prefix}{fmt(fix['peak_allocated_bytes'])} of {fmt(capacity)}")
        if fix.get("saved_bytes") is not None:
            sub.append(f"saves {fmt(fix['saved_bytes'])}")
        if ratio is not None:
            sub.append(f"step time {ratio:.2f}x")
        status = fix["status"]
        cards.append(
            f'<div class="fixcard {"fits" if fix["fits"] else ""}">'
            f'<div class="fixcard-name">{esc(fix["name"])} '
            f"{badge(status, 'good' if fix['fits'] else 'bad')}</div>"
            f'<div class="fixcard-sub">{esc(" · ".join(sub))}</div></div>'
        )
    title = "Best fixes, measured" if measured else "Best fixes, estimated"
    return (
        f'<section class="card" id="best"><h2>{esc(title)}</h2>'
        f'<div class="fixcards">{"".join(cards)}</div>'
        '<p class="hint"><a href="#fixes">All fixes, with snippets</a></p></section>'
    )


# -- timeline
