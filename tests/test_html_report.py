"""The HTML report, rendered by a real headless Chromium.

The view (`build_view`) is checked directly; the page is loaded in Debian's
`chromium` (`--dump-dom` gives the DOM after the page's script ran,
`--screenshot` the pixels). Without a chromium binary these tests skip, except
under CI=true, where a missing browser is a failure.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import REPO_ROOT, load_json
from suggest_builders import GiB, MiB, oom_document

from oomdoc.analysis import Analysis, analyse
from oomdoc.categories import REQUIRED
from oomdoc.model import Snapshot
from oomdoc.reporters.html import (
    MAX_SITES,
    MAX_TIMELINE_POINTS,
    build_view,
    downsample,
    render_html,
    render_html_report,
)
from oomdoc.sizes import format_bytes
from oomdoc.snapshot import CATEGORIES


def analysed(document: dict, top: int = 5) -> Analysis:
    """What the page is built from: the document parsed, then analysed."""
    return analyse(Snapshot.from_dict(document), top=top)


XSS_SCRIPT = "<script>alert(1)</script>"
XSS_IMG = "<img src=x onerror=alert(1)>"
HOSTILE = f"{XSS_SCRIPT}{XSS_IMG}"

# ------------------------------------------------------------------ browser


def _chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def chromium():
    binary = _chromium_binary()
    if binary:
        return binary
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(
            "CI is set but no chromium binary is on PATH (.ci/run installs Debian's chromium)"
        )
    pytest.skip("no chromium binary found (apt-get install chromium); under CI=true this fails")


def _chromium(binary: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )


def dump_dom(binary: str, page: Path) -> str:
    completed = _chromium(binary, "--dump-dom", page.resolve().as_uri())
    assert completed.returncode == 0 and "<body" in completed.stdout, completed.stderr[-2000:]
    return completed.stdout


def screenshot(binary: str, page: Path, png: Path) -> Path:
    completed = _chromium(
        binary, f"--screenshot={png}", "--window-size=1280,2000", page.resolve().as_uri()
    )
    assert png.exists(), completed.stderr[-2000:]
    return png


class Node:
    def __init__(self, tag: str, attrs: dict, parent=None):
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list = []  # Nodes and strings

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def classes(self) -> set:
        return set((self.attrs.get("class") or "").split())

    def iter(self):
        for child in self.children:
            if isinstance(child, Node):
                yield child
                yield from child.iter()

    def find_all(self, tag=None, cls=None, **attrs) -> list:
        found = []
        for node in self.iter():
            if tag and node.tag != tag:
                continue
            if cls and cls not in node.classes():
                continue
            if any(node.attrs.get(key.replace("_", "-")) != value for key, value in attrs.items()):
                continue
            found.append(node)
        return found

    def find(self, tag=None, cls=None, **attrs):
        found = self.find_all(tag, cls, **attrs)
        assert found, f"no <{tag} class={cls} {attrs}> in the DOM"
        return found[0]


_VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "wbr",
}


class _DomBuilder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.current = self.root

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {key: value or "" for key, value in attrs}, self.current)
        self.current.children.append(node)
        if tag not in _VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Node(tag, {k: v or "" for k, v in attrs}, self.current))

    def handle_endtag(self, tag):
        node = self.current
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(data)


def parse(markup: str) -> Node:
    builder = _DomBuilder()
    builder.feed(markup)
    builder.close()
    return builder.root


def write_page(tmp_path: Path, document: dict, name: str = "report.html") -> Path:
    page = tmp_path / name
    page.write_text(render_html_report(document), encoding="utf-8")
    return page


# --------------------------------------------------------------- snapshots


def _frames(*locations):
    return [
        {"file": file, "line": line, "function": function} for file, line, function in locations
    ]


def rich_document() -> dict:
    """A CUDA-like OOM with reserved above allocated, a slow leak, measured
    fixes (some fit, some do not), a prescription, modules and two ranks."""
    capacity = 16 * GiB
    steps = []
    for index in range(8):
        end = 6 * GiB + index * 64 * MiB
        steps.append(
            {
                "index": index,
                "peak_allocated_bytes": end + 6 * GiB,
                "peak_reserved_bytes": end + 6 * GiB + 512 * MiB,
                "peak_phase": "backward",
                "end_allocated_bytes": end,
                "phase_peaks": {
                    "forward": end + 5 * GiB,
                    "backward": end + 6 * GiB,
                    "optimizer": end + GiB,
                },
                "forward_calls": 1,
                "forward_calls_with_grad": 1,
                "eval_mode_forward_calls_with_grad": 0,
                "backward_calls": 1,
                "optimizer_steps": 1,
                "duration_s": 0.1,
                "retained_graphs": [],
            }
        )
    breakdown = {
        "parameters": 1 * GiB,
        "gradients": 1 * GiB,
        "optimizer_state": 2 * GiB,
        "activations": 11 * GiB,
        "communication": 200 * MiB,
        "other": 300 * MiB,
    }
    allocated = sum(breakdown.values())
    document = oom_document(
        allocated=allocated,
        requested=2 * GiB,
        capacity=capacity,
        phase="backward",
        step_index=7,
        device={
            "kind": "cuda",
            "name": "NVIDIA H100 80GB HBM3",
            "capacity_bytes": capacity,
            "total_bytes": 80 * GiB,
        },
        breakdown=breakdown,
        steps=steps,
        peak={
            "allocated_bytes": allocated,
            "reserved_bytes": allocated,
            "step": 7,
            "phase": "backward",
        },
        top_allocations=[
            {
                "bytes": 6 * GiB,
                "count": 24,
                "category": "activations",
                "location": {"file": "/work/train.py", "line": 74, "function": "forward"},
                "shape": [32, 512, 4096],
                "dtype": "float32",
                "stack": _frames(
                    ("/work/train.py", 74, "forward"),
                    ("/work/train.py", 119, "main"),
                ),
            },
            {
                "bytes": 2 * GiB,
                "count": 1,
                "category": "optimizer_state",
                "location": {"file": "/work/train.py", "line": 130, "function": "main"},
                "shape": None,
                "dtype": None,
            },
        ],
        fixes=[
            {
                "name": "checkpointing",
                "rank": 1,
                "measured": True,
                "peak_allocated_bytes": 11 * GiB,
                "saved_bytes": 6 * GiB,
                "fits": True,
                "step_time_ratio": 1.12,
                "detail": "checkpointed 24 x Block in `blocks`",
                "snippet": "for block in model.blocks:\n    x = checkpoint(block, x, use_reentrant=False)",
            },
            {
                "name": "autocast",
                "rank": 2,
                "measured": True,
                "peak_allocated_bytes": 15 * GiB + 500 * MiB,
                "saved_bytes": GiB,
                "fits": True,
                "step_time_ratio": 0.14,
                "detail": "bf16 autocast",
                "snippet": "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)",
            },
            {
                "name": "empty_cache",
                "rank": 3,
                "measured": True,
                "peak_allocated_bytes": 16 * GiB,
                "saved_bytes": 0,
                "fits": False,
                "outcome": "oom",
                "step_time_ratio": None,
                "detail": "ran out of memory",
                "snippet": "torch.cuda.empty_cache()",
            },
        ],
        replay={
            "replays": 4,
            "total_s": 30.0,
            "baseline_need_bytes": allocated + 2 * GiB,
            "baseline_need_estimated": False,
            "skipped": [{"name": "expandable_segments", "reason": "nothing cached"}],
        },
        max_batch_size=20,
        prescription={
            "fixes": ["checkpointing", "autocast"],
            "batch_size": 32,
            "accumulation_steps": 1,
            "peak_allocated_bytes": 9 * GiB,
            "fits": True,
            "samples_per_second": 412.5,
            "measured": True,
        },
        modules=[
            {
                "path": "blocks",
                "class": "Block",
                "blocks": 24,
                "bytes": {"activations": 10 * GiB, "parameters": 900 * MiB},
            },
            {
                "path": "lm_head",
                "class": "Linear",
                "blocks": 1,
                "bytes": {"activations": 700 * MiB, "parameters": 100 * MiB},
            },
        ],
        world_size=2,
        first_failing_rank=1,
        ranks=[
            {
                "rank": rank,
                "local_rank": rank,
                "host": "node-a",
                "device": {"kind": "cuda", "name": "NVIDIA H200", "capacity_bytes": capacity},
                "outcome": "oom" if rank == 1 else "interrupted",
                "oom": {
                    "step": 7,
                    "phase": "backward",
                    "requested_bytes": GiB,
                    "allocated_bytes": 15 * GiB,
                }
                if rank == 1
                else None,
                "breakdown": {**breakdown, "activations": (11 + 2 * rank) * GiB},
                "steps": steps,
            }
            for rank in range(2)
        ],
    )
    document["oom"]["location"] = {"file": "/work/train.py", "line": 74, "function": "forward"}
    return document


def hostile_document() -> dict:
    """Every string a snapshot carries, made of markup."""
    document = rich_document()
    document["command"] = [f"train{HOSTILE}.py", "--name", HOSTILE]
    document["cwd"] = "/nowhere"
    document["device"]["name"] = f"GPU{HOSTILE}"
    document["oom"]["message"] = f"out of memory {HOSTILE}"
    document["oom"]["phase"] = f"backward{HOSTILE}"
    document["oom"]["step"] = 8  # a step of its own: its phase goes into the timeline's JSON
    document["oom"]["location"] = {"file": f"/w/{HOSTILE}.py", "line": 3, "function": HOSTILE}
    document["notes"] = [f"note {HOSTILE}"]
    document["optimizers"] = [HOSTILE]
    document["models"][0]["class"] = HOSTILE
    for site in document["top_allocations"]:
        site["location"] = {"file": f"/w/{HOSTILE}.py", "line": 1, "function": HOSTILE}
        site["category"] = HOSTILE
        site["dtype"] = HOSTILE
        site["stack"] = _frames((f"/w/{HOSTILE}.py", 2, HOSTILE))
    for fix in document["fixes"]:
        fix["name"] = f"{fix['name']}{HOSTILE}"
        fix["detail"] = HOSTILE
        fix["snippet"] = f"code('{HOSTILE}')"
    document["replay"]["skipped"] = [{"name": HOSTILE, "reason": HOSTILE}]
    document["prescription"]["fixes"] = [HOSTILE]
    document["prescription"]["snippet"] = HOSTILE
    for module in document["modules"]:
        module["path"] = f"blocks{HOSTILE}"
        module["class"] = HOSTILE
    for rank in document["ranks"]:
        rank["host"] = HOSTILE
        rank["outcome"] = HOSTILE
        rank["device"]["name"] = HOSTILE
    document["created_at"] = HOSTILE
    document["torch_version"] = HOSTILE
    return document


# ------------------------------------------------------------ the view alone


def test_view_holds_every_section_as_plain_json():
    document = rich_document()
    view = build_view(analysed(document, top=10))
    assert json.loads(json.dumps(view, allow_nan=False)) == view
    assert view["outcome"] == "oom"
    assert view["device"] == {
        "name": "NVIDIA H100 80GB HBM3",
        "kind": "cuda",
        "capacity_bytes": 16 * GiB,
    }
    assert view["oom"]["need_bytes"] == view["oom"]["allocated_bytes"] + 2 * GiB
    assert view["oom"]["location"] == "train.py:74 in forward"  # relative to cwd /work
    assert view["prescription"]["fixes"] == ["checkpointing", "autocast"]
    assert "checkpoint(block" in view["prescription"]["snippet"]  # from the fixes' snippets
    assert view["prescription"]["headroom_bytes"] == 7 * GiB
    assert [fix["name"] for fix in view["top_fixes"]][:2] == ["checkpointing", "autocast"]
    assert [item["name"] for item in view["breakdown"]["categories"]] == list(CATEGORIES)
    assert view["breakdown"]["requested_bytes"] == 2 * GiB
    timeline = view["timeline"]
    assert timeline["oom"]["step"] == 7 and timeline["oom"]["phase"] == "backward"
    assert [point[3] for point in timeline["allocated"][:3]] == ["forward", "backward", "optimizer"]
    assert not timeline["reserved_is_allocated"]
    assert [point[2] for point in timeline["end"]] == list(range(7))  # step 7 died: no end
    assert timeline["growth_per_step_bytes"] == 64 * MiB
    assert view["modules"]["items"][0]["path"] == "blocks"
    assert view["modules"]["items"][0]["total_bytes"] == 10 * GiB + 900 * MiB
    assert view["sites"]["items"][0]["stack"] == ["train.py:74 in forward", "train.py:119 in main"]
    statuses = {fix["name"]: fix["status"] for fix in view["fixes"]["items"]}
    assert statuses == {"checkpointing": "fits", "autocast": "fits", "empty_cache": "out of memory"}
    assert view["fixes"]["skipped"] == [{"name": "expandable_segments", "reason": "nothing cached"}]
    assert view["ranks"]["world_size"] == 2 and view["ranks"]["first_failing_rank"] == 1
    assert [rank["rank"] for rank in view["ranks"]["items"]] == [0, 1]


def test_view_of_a_snapshot_without_the_new_fields():
    document = oom_document(allocated=900 * MiB, requested=200 * MiB)
    for field in ("modules", "ranks", "prescription"):
        assert field not in document
    view = build_view(analysed(document))
    assert view["modules"] is None and view["ranks"] is None and view["prescription"] is None
    page = render_html(view)
    assert 'id="modules"' not in page and 'id="ranks"' not in page
    assert 'id="prescription"' not in page and 'id="best"' in page


def test_view_ignores_fields_of_the_wrong_type():
    document = rich_document()
    document["steps"][0]["phase_peaks"] = "lots"
    document["steps"][1]["end_allocated_bytes"] = True
    document["top_allocations"].append({"bytes": "many", "location": 7, "stack": "x"})
    document["modules"] = [{"path": 3, "bytes": {"activations": float("nan")}}, "nope"]
    document["ranks"] = [{"rank": "zero", "breakdown": None, "steps": [None, {"index": "a"}]}]
    document["prescription"] = {"fixes": "autocast", "samples_per_second": float("inf")}
    view = build_view(analysed(document))
    json.dumps(view, allow_nan=False)
    assert (
        view["prescription"]["fixes"] == [] and view["prescription"]["samples_per_second"] is None
    )
    assert view["modules"]["items"][0]["path"] == "?"
    render_html(view)


def test_prescription_with_accumulation_and_the_scripts_own_flags():
    document = rich_document()
    document["prescription"].update(
        batch_size=8,
        accumulation_steps=4,
        accumulation_measured=True,
        verified_by_flags={
            "args": ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4"],
            "outcome": "fits",
            "peak_allocated_bytes": 9 * GiB + 100 * MiB,
        },
    )
    text = parse(render_html(build_view(analysed(document)))).find("section", id="prescription")
    assert text is not None
    body = text.text()
    assert "batch size 8 x 4 accumulation steps" in body
    assert "412.5 samples/s" in body and "measured at batch" not in body
    assert "peak measured with the gradient accumulation running" in body
    assert (
        "replayed with your script's own flags (--per_device_train_batch_size 8 "
        f"--gradient_accumulation_steps 4): fits, peak {format_bytes(9 * GiB + 100 * MiB)}"
    ) in body
    document["prescription"]["accumulation_measured"] = False
    document["prescription"]["throughput_batch_size"] = 10
    body = parse(render_html(build_view(analysed(document)))).text()
    assert "peak of one micro-batch, not measured with the accumulation" in body
    assert "412.5 samples/s (measured at batch 10)" in body


def test_a_leak_prescription_says_fix_the_leak_not_use_as_it_is():
    document = rich_document()
    document["prescription"] = {
        "kind": "leak",
        "fixes": [],
        "batch_size": None,
        "fits": False,
        "measured": False,
        "detail": "total_loss keeps each step's graph; no configuration fixes a leak",
        "snippet": "total_loss += loss.item()",
    }
    section = parse(render_html(build_view(analysed(document)))).find("section", id="prescription")
    assert section is not None
    body = section.text()
    assert "Fix the leak first" in body and "total_loss keeps each step's graph" in body
    assert "total_loss += loss.item()" in body
    assert "as it is" not in body and "does not fit" not in body


def test_downsampling_keeps_extremes_the_oom_and_the_peak():
    points = [[float(index), (index * 7919) % 1000, index, "forward"] for index in range(50_000)]
    points[31_337][1] = 10**6  # the peak
    kept = downsample(points, 1000, keep=[12_345.0])
    assert len(kept) <= 1001
    assert [point[0] for point in kept] == sorted(point[0] for point in kept)
    assert max(point[1] for point in kept) == 10**6
    assert min(point[1] for point in kept) == 0
    assert 12_345.0 in {point[0] for point in kept}


def _benchmark_module():
    spec = importlib.util.spec_from_file_location(
        "html_report_benchmark", REPO_ROOT / "benchmarks" / "html_report.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def big_page(tmp_path_factory):
    """The benchmark's snapshot at 100,000 allocation events, rendered."""
    document = _benchmark_module().synthetic_document(steps=20_000, sites=40_000)
    view = build_view(analysed(document, top=10))
    page = tmp_path_factory.mktemp("big") / "big.html"
    page.write_text(render_html(view), encoding="utf-8")
    return document, view, page


def test_a_big_snapshot_stays_small(big_page):
    document, view, page = big_page
    assert page.stat().st_size < 5 * 1000**2
    timeline = view["timeline"]
    assert timeline["downsampled"] and timeline["points_total"] > 90_000
    for series in ("allocated", "reserved", "end"):
        assert len(timeline[series]) <= MAX_TIMELINE_POINTS + 2
    last = document["steps"][-1]["index"]
    assert timeline["oom"]["step"] == last
    assert any(point[2] == last and point[3] == "backward" for point in timeline["allocated"])
    assert len(view["sites"]["items"]) == MAX_SITES and view["sites"]["total"] == 40_000


# ------------------------------------------------------ rendered in Chromium


@pytest.fixture(scope="module")
def rich_dom(chromium, tmp_path_factory):
    page = write_page(tmp_path_factory.mktemp("rich"), rich_document())
    return parse(dump_dom(chromium, page)), page


def test_the_page_script_ran(rich_dom):
    dom, _ = rich_dom
    body = dom.find("body")
    assert float(body.attrs["data-script-ms"]) > 0
    assert float(body.attrs["data-rendered-ms"]) > 0
    assert dom.find("button", cls="copy")


def test_breakdown_shows_each_category_with_its_bytes(rich_dom):
    dom, _ = rich_dom
    document = rich_document()
    section = dom.find("section", id="breakdown")
    assert "What filled NVIDIA H100 80GB HBM3 (at the OOM)" in section.text()
    for category in CATEGORIES:
        row = section.find("tr", data_category=category)
        assert category in row.text()
        assert format_bytes(document["breakdown"][category]) in row.text()
    bar = section.find("div", id="breakdown-bar")
    segments = [
        node.attrs["data-category"]
        for node in bar.find_all("div", cls="seg")
        if "data-category" in node.attrs
    ]
    assert segments == list(CATEGORIES)
    assert format_bytes(2 * GiB) in section.find("tr", cls="requested").text()


def test_timeline_marks_the_oom_and_the_capacity(rich_dom):
    dom, _ = rich_dom
    section = dom.find("section", id="timeline")
    marker = section.find("g", id="oom-marker")
    assert marker.attrs["data-step"] == "7" and marker.attrs["data-phase"] == "backward"
    assert "OOM in step 7 backward" in marker.text()
    assert section.find("text", cls="capacity-label").text() == f"capacity {format_bytes(16 * GiB)}"
    assert section.find("polyline", cls="allocated") and section.find("path", cls="reserved")
    assert f"grows by {format_bytes(64 * MiB)} per step" in section.find("p", id="growth").text()


def test_fixes_are_bars_with_the_fitting_ones_highlighted(rich_dom):
    dom, _ = rich_dom
    section = dom.find("section", id="fixes")
    rows = {
        row.attrs["data-fix"]: row
        for row in section.find_all("div", cls="fixrow")
        if "data-fix" in row.attrs
    }
    assert list(rows) == ["checkpointing", "autocast", "empty_cache"]
    for name in ("checkpointing", "autocast"):
        assert "fits" in rows[name].classes() and rows[name].attrs["data-fits"] == "yes"
        assert rows[name].find("div", cls="bar-fits")
    assert "fits" not in rows["empty_cache"].classes()
    assert rows["empty_cache"].attrs["data-fits"] == "no"
    assert f"> {format_bytes(16 * GiB)}" in rows["empty_cache"].text()  # a lower bound: it ran out
    assert format_bytes(11 * GiB) in rows["checkpointing"].text()
    snippet = rows["checkpointing"].find("pre")
    assert "checkpoint(block, x" in snippet.text()
    button = rows["checkpointing"].find("button", cls="copy")
    assert button.attrs["data-copy"] == snippet.attrs["id"]
    assert "expandable_segments" in section.find("ul", cls="skipped").text()


def test_prescription_modules_sites_and_ranks(rich_dom):
    dom, _ = rich_dom
    prescription = dom.find("section", id="prescription")
    assert "checkpointing + autocast" in prescription.text()
    assert "batch size 32" in prescription.text() and "412.5 samples/s" in prescription.text()
    modules = dom.find("section", id="modules")
    first = modules.find("tbody").find_all("tr")[0]
    assert "blocks" in first.text() and "24 blocks" in first.text()
    assert format_bytes(10 * GiB + 900 * MiB) in first.text()
    sites = dom.find("section", id="sites")
    site = sites.find_all("details", cls="site")[0]
    assert "train.py:74 in forward" in site.find("summary").text()
    assert "train.py:119 in main" in site.find("ol", cls="stack-frames").text()
    ranks = dom.find("section", id="ranks")
    columns = ranks.find_all("th", cls="rankcol")
    assert [column.attrs["data-rank"] for column in columns] == ["0", "1"]
    assert "first" in columns[1].classes() and "first to fail" in columns[1].text()
    assert "rank 1 ran out of memory first" in ranks.text()
    assert len(ranks.find_all("svg", cls="rankbar")) == 2


def test_screenshot_is_not_blank(chromium, rich_dom, tmp_path):
    from PIL import Image

    _, page = rich_dom
    png = screenshot(chromium, page, tmp_path / "shot.png")
    with Image.open(png) as image:
        assert image.size == (1280, 2000)
        rgb = image.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 200, "too few colours: a blank page?"
        background = max(colors)[1]
        covered = sum(count for count, color in colors if color != background)
        assert covered > 0.15 * 1280 * 2000
        # The OOM red and the fixes' green are painted.
        assert any(r > 200 and g < 80 and b < 80 for _, (r, g, b) in colors)
        assert any(g > 150 and r < 80 and b < 120 for _, (r, g, b) in colors)


def test_hostile_strings_are_text_not_markup(chromium, tmp_path):
    page = write_page(tmp_path, hostile_document())
    source = page.read_text()
    assert source.count("<script") == 2  # the timeline's JSON and the page's own script
    assert XSS_SCRIPT not in source and XSS_IMG not in source
    assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in source  # in the JSON
    dumped = dump_dom(chromium, page)
    dom = parse(dumped)
    assert dom.find_all("img") == []
    scripts = dom.find_all("script")
    assert [node.attrs.get("id") for node in scripts] == ["timeline-data", None]
    for node in dom.iter():
        assert not [name for name in node.attrs if name.startswith("on")], node.tag
    text = dom.find("body").text()
    assert text.count(XSS_SCRIPT) >= 10 and text.count(XSS_IMG) >= 10
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dumped
    assert "&lt;img src=x onerror=alert(1)&gt;" in dumped
    # The page ran to its end and the embedded data still parses back.
    assert "data-rendered-ms" in dom.find("body").attrs
    data = json.loads(dom.find("script", id="timeline-data").text())
    assert any(XSS_SCRIPT in str(point) for point in data["allocated"])


def test_big_snapshot_renders_in_chromium(chromium, big_page):
    _, view, page = big_page
    dom = parse(dump_dom(chromium, page))
    marker = dom.find("g", id="oom-marker")
    assert marker.attrs["data-step"] == str(view["timeline"]["oom"]["step"])
    assert len(dom.find_all("details", cls="site")) == MAX_SITES
    assert "data-rendered-ms" in dom.find("body").attrs


def test_real_run_report(chromium, tmp_path, tiny_gpt_oom_run):
    """The report of a real `oomdoc run` (the tiny GPT out of memory on the
    simulated device), rendered."""
    completed, snapshot = tiny_gpt_oom_run
    assert completed.returncode == 1, completed.stderr[-2000:]
    document = load_json(snapshot)
    dom = parse(dump_dom(chromium, write_page(tmp_path, document)))
    oom = document["oom"]
    marker = dom.find("g", id="oom-marker")
    assert marker.attrs["data-step"] == str(oom["step"])
    assert marker.attrs["data-phase"] == oom["phase"]
    headline = dom.find("h1", id="headline").text()
    assert f"tried to allocate {format_bytes(oom['requested_bytes'])}" in headline
    breakdown = dom.find("section", id="breakdown")
    for category in REQUIRED:
        assert (
            format_bytes(document["breakdown"][category])
            in breakdown.find("tr", data_category=category).text()
        )
    assert not breakdown.find_all("tr", data_category="communication")  # none: not shown
    fixes = dom.find("section", id="fixes")
    assert "estimated" in fixes.find("h2").text()
    shown = [row for row in fixes.find_all("div", cls="fixrow") if "data-fix" in row.attrs]
    assert shown and all(
        ("fits" in row.classes()) == (row.attrs["data-fits"] == "yes") for row in shown
    )
    sites = dom.find("section", id="sites").find_all("details", cls="site")
    assert len(sites) == len(document["top_allocations"])
    assert re.search(r"examples/gpt_train\.py:\d+ in ", sites[0].text())
    assert copy.deepcopy(document) == load_json(snapshot)  # rendering does not touch the document


def test_the_largest_batch_for_the_whole_run_has_its_own_card():
    document = rich_document()
    document["replay"]["batch_search"] = {
        "source": "--batch-size",
        "original_batch_size": 32,
        "max_batch_size": 20,
        "exact": True,
        "trials": [[20, True], [21, False]],
        "whole_run_batch_size": 21,
        "whole_run_setting": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "whole_run_note": "at the allocator's defaults batch 20's reserved memory grew 400 MiB a step",
    }
    view = build_view(analysed(document))
    assert view["whole_run_batch"]["batch_size"] == 21
    page = render_html(view)
    assert "largest batch for the whole run" in page
    assert "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (certified)" in page
    # Certified as it is: said on the largest batch's own card.
    document["replay"]["batch_search"].update(
        whole_run_batch_size=20,
        whole_run_setting=None,
        whole_run_note="certified for the whole run",
    )
    page = render_html(build_view(analysed(document)))
    assert "21 ran out of memory; certified for the whole run" in page
    assert "largest batch for the whole run" not in page
