"""The book (not a course day): measured numbers come from committed results, and the built
site reads offline.

Every measured figure in a chapter is a `{{ source:path | format }}` placeholder that
book/hooks/figures.py fills from a JSON in benches/results/ (see book/README.md). These tests
check that every placeholder resolves from a committed file, and that no chapter types a
measured-looking number by hand, except the ones listed in EXCEPTIONS with the reason. Then
they build the site and check that it needs nothing from another site: no TeX left for a
script to typeset, no script or stylesheet from a CDN.
"""

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CHAPTERS = sorted((BOOK / "src").glob("*.md"))
sys.path.insert(0, str(BOOK / "hooks"))

import figures  # noqa: E402

# A number with a unit of time or speed, a speed-up ("1.9x", "36 times"; not "16 x 128"), a
# percentage, or a decimal with two or more places (a ratio such as 0.96), and the first number
# of a range ("306 to 500 ms"). Versions like 0.32.4 and sizes (2.41 GB, 1.75 MiB) are left
# alone: sizes follow from the config.
NUMBER = r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?"
UNIT = r"(?:ms|s|seconds?|minutes?|min|hours?|µs|tokens?/s|tok/s|GFLOP/s|GB/s|MB/s|%)(?![\w/])"
MEASURED = re.compile(
    rf"{NUMBER}\s*(?:{UNIT}|(?:x|×|times)(?![\w/])(?!\s*\d))"
    rf"|{NUMBER}(?=\s*(?:to|and|against)\s+\d+(?:\.\d+)?\s*{UNIT})"
    r"|(?<![\w.])\d+\.\d{2,}(?![\d.])(?!\s*(?:GB|GiB|MB|MiB|KiB|GFLOP)\b)"
)

# file -> [(a regex that matches the text around the number, why it is not a measurement)]
EXCEPTIONS: dict[str, list[tuple[str, str]]] = {
    "README.md": [
        (r"Python 3\.10", "a version"),
        (r"--pool-fractions 1 0\.5 0\.25", "a command's settings: pool sizes as fractions"),
        (
            r"about \d+ minutes on 2 cores",
            "how long a first run takes, rounded, for a new user to plan by (CI prints the times)",
        ),
    ],
    "setup.md": [
        (r"Python 3\.10", "a version"),
    ],
    "week4-03-serving.md": [
        (
            r"within 20 s|after 5 s|within 10 s of|at most 3 in 10 minutes",
            "the server's settings (server.BODY_TIMEOUT_S, server_run's KEEP_ALIVE_S and "
            "HEADERS_S, server_engine's MAX_RESTARTS in RESTART_WINDOW_S), not measurements",
        ),
        (r"arriving within 1 ms of each other", "bench-token-delivery's definition of a burst"),
    ],
    "week4-04-prefix-caching.md": [
        (
            r"about 23 s of prefill|about 400 ms when it was",
            "another project's report (mlx-lm issue 1803), not measured here",
        ),
    ],
    "appendix-demo.md": [
        (r"^\d+\.\d s   passes .* tokens/s$", "a sample frame of the demo's screen, its layout"),
        (r"^request \d+ finished: .*, first token after \d+\.\d+ s$", "the same sample frame"),
        (r"^ +\d+\.\d+s pass +\d+  (prefill|decode|finish|request) ", "sample plain output"),
    ],
    "week3-03-shape-stable-prefill.md": [
        (
            r"1\.19 s for a small$|4 to 20 ms there|about 20% of running it",
            "measured by hand in an earlier session (COURSE.md's platform facts), no JSON yet: "
            "the planned bench-shape-stable should record the compile times",
        ),
        (r"under 100% of the real rows", "a bound, not a measurement"),
        (r"instead of 342, 65%$|from 4\.9 s to 7\.0 s", "the seed's measurement of another engine"),
    ],
    "week3-05-flash-attention.md": [
        (
            r"^\| \d+ \| dense \| FIGURE \| FIGURE \| 1\.00 \|$",
            "the row the ratios are taken against",
        ),
    ],
    "week3-06-memory-planning.md": [
        (r"At 100% no request|\| (100|50|33|25)% \|", "pool sizes, settings"),
        (r"--pool-fractions 1 0\.5 0\.33 0\.25", "a command's settings: pool sizes as fractions"),
    ],
    "week1-04-rmsnorm-mlp.md": [
        (r"60% of the weights", "computed from the config: 3 x 1024 x 3072 of 15.7M per layer"),
        (r"about 0\.4%\s*$|^to 0\.8%", "the spacing of bfloat16 numbers, a property of the format"),
        (r"at least 99% of them", "a test's threshold"),
        (r"about \\\(-0\.28\\\), near \\\(z = -1\.28\\\)", "the minimum of silu, mathematics"),
    ],
    "week1-06-generate.md": [
        (r"42 times less work", "computed: 3,936 token-passes against 93"),
        (r"0\.40, 0\.25, 0\.15, 0\.10, 0\.05|0\.65 < 0\.75|is 0\.80", "a worked top-p example"),
        (r"within 0\.025", "a test's tolerance"),
        (r"\\\(p = 0\.75\\\)", "a worked top-p example"),
        (r"one token at 99%", "an example of a confident distribution"),
    ],
    "week4-01-quantization.md": [
        (
            r"^\| (float32|bfloat16|[48]-bit, groups of 64, bf16 scales) \| \d+ MB \| [\d.]+% \|$",
            "computed: 596 M parameters at 32, 16, 8.5 and 4.5 bits each",
        ),
        (r"is a 3\.6x or 7x smaller", "computed: 16 / 4.5 and 32 / 4.5 bits a weight"),
        (r"\*\*28\.1%\*\* of float32|^28\.1% of the bytes", "computed: 144 bytes of 512"),
        (r"every logit within 5%|most 30% of", "a test's threshold"),
    ],
    "week4-02-tensor-parallel.md": [
        (
            r"596 M parameters, 26%|74% / 2 \+ 26% = 63%|replicated 26%|1 / 0\.63 \\approx 1\.59",
            "computed from the config: the head's 151936 x 1024 of 596 M parameters",
        ),
        (r"512 times as much|paid 56 times", "counts: tokens of a prefill, all-reduces of a pass"),
        (r"^\| (Ethernet|Thunderbolt)\b.* \|$", "computed: bytes over the link's nominal rate"),
        (r"it is 5\.6 ms per$|it is 0\.56 ms", "computed: 56 all-reduces at an assumed latency"),
        (
            r"about 90 ms per token on a device that streams 400 GB/s|45 ms per token, .*\(16 ms\)"
            r"|in about 3 ms|\(5\.6 ms\) would",
            "a worked example on an assumed device: arithmetic",
        ),
    ],
}


def chapter_text(path: Path) -> str:
    return path.read_text()


def measured_numbers(path: Path) -> list[tuple[int, str, str]]:
    """(line number, the number as written, the line) for every measured-looking number
    outside the placeholders."""
    found = []
    text = figures.PLACEHOLDER.sub("FIGURE", chapter_text(path))
    for number, line in enumerate(text.splitlines(), start=1):
        for match in MEASURED.finditer(line):
            found.append((number, match, line))
    return found


def excused(name: str, match: re.Match, line: str, used: set) -> bool:
    for pattern, _why in EXCEPTIONS.get(name, []):
        for hit in re.finditer(pattern, line):
            if hit.start() <= match.start() and match.end() <= hit.end():
                used.add((name, pattern))
                return True
    return False


# --- numbers come from committed results ------------------------------------------------------


@pytest.fixture(scope="module")
def results():
    return figures.load_results(BOOK / "mkdocs.yml")


def test_every_placeholder_resolves_from_a_committed_result(results):
    errors = []
    for path in CHAPTERS:
        for placeholder in figures.find_placeholders(chapter_text(path)):
            try:
                results.render(placeholder)
            except (ValueError, SyntaxError) as error:
                errors.append(f"{path.name}: {{{{{placeholder}}}}}: {error}")
    assert not errors, "placeholders that do not resolve:\n" + "\n".join(errors)


def test_every_source_is_a_committed_file(results):
    tracked = subprocess.run(
        ["git", "ls-files", "benches/results"], cwd=ROOT, capture_output=True, text=True
    )
    for name, file in results.sources.items():
        path = results.results_dir / file
        assert path.is_file(), (
            f"book/results.yml: source {name!r} names {file}, not in benches/results/"
        )
        if tracked.returncode == 0:  # in a git checkout: the file must be committed
            assert f"benches/results/{file}" in tracked.stdout.split(), (
                f"source {name!r}: benches/results/{file} is not committed (git add it)"
            )


def test_every_pending_number_says_how_to_measure_it(results):
    for name, entry in results.pending.items():
        missing = {"value", "why", "command"} - entry.keys()
        assert not missing, f"book/results.yml: pending {name!r} lacks {sorted(missing)}"
        assert entry["command"].startswith("pdm run "), f"pending {name!r}: give a pdm command"


def test_no_chapter_types_a_measured_number(results):
    used: set = set()
    typed = []
    for path in [*CHAPTERS, ROOT / "README.md"]:
        for number, match, line in measured_numbers(path):
            if not excused(path.name, match, line, used):
                typed.append(f"{path.name}:{number}: {match.group(0)!r} in: {line.strip()}")
    assert not typed, (
        "measured numbers typed by hand; write {{ source:path | format }} instead (book/README.md),"
        " or add the line to EXCEPTIONS with the reason:\n" + "\n".join(typed)
    )
    declared = {(name, pattern) for name, rules in EXCEPTIONS.items() for pattern, _ in rules}
    assert not declared - used, f"EXCEPTIONS that no longer match anything: {declared - used}"


def test_the_scan_finds_typed_numbers():
    # the scanner itself: these must be caught, versions and placeholders must not
    caught = lambda s: [m.group(0) for m in MEASURED.finditer(figures.PLACEHOLDER.sub("F", s))]
    assert caught("prefilled 79 tokens/s, decoded at 306 ms, 36 times faster, 1.9x, 41%") == [
        "79 tokens/s",
        "306 ms",
        "36 times",
        "1.9x",
        "41%",
    ]
    assert caught("a ratio of 0.96 and a step of 1.6 s") == ["0.96", "1.6 s"]
    assert caught("it went from 306 to 500 ms, 1,961 ms") == ["306", "500 ms", "1,961 ms"]
    assert caught("MLX 0.32.4, 8 steps, 2048x2048, 16 x 128, {{ model:x | .1f }} ms") == []
    assert caught("2.41 GB per step, 1.75 MiB, \\([0, s) \\cup [s, p]\\)") == []


# --- the built site reads offline --------------------------------------------------------------


class PageScan(HTMLParser):
    """Text outside code and math, and every resource a page would load."""

    SKIP = {"code", "pre", "script", "style", "math"}
    LOADS = {("script", "src"), ("link", "href"), ("img", "src"), ("iframe", "src")}

    def __init__(self):
        super().__init__()
        self.depth = 0
        self.text: list[str] = []
        self.resources: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if (tag, name) in self.LOADS and value:
                self.resources.append(value)
        if tag in self.SKIP:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if not self.depth:
            self.text.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(BOOK / "mkdocs.yml")]
        + ["-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    return out


def test_site_has_no_tex_left_for_a_script(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= len(CHAPTERS), f"only {len(pages)} pages built"
    raw = []
    for page in pages:
        scan = PageScan()
        scan.feed(page.read_text())
        text = "".join(scan.text)
        for delimiter in (r"\(", r"\)", r"\[", r"\]", "$$"):
            if delimiter in text:
                at = text.index(delimiter)
                raw.append(
                    f"{page.relative_to(site)}: {delimiter!r} in {text[at - 40 : at + 40]!r}"
                )
    assert not raw, "TeX left unrendered outside code:\n" + "\n".join(raw)
    chunked = (site / "week3-02-chunked-prefill" / "index.html").read_text()
    assert chunked.count("<math") > 20, "chapter 3.2's formulas were not turned into MathML"


def test_site_loads_nothing_from_another_site(site):
    off_site = []
    for page in sorted(site.rglob("*.html")):
        scan = PageScan()
        scan.feed(page.read_text())
        for url in scan.resources:
            if re.match(r"^([a-z][a-z0-9+.-]*:)?//", url, re.I):
                off_site.append(f"{page.relative_to(site)}: {url}")
    assert not off_site, "pages load from other sites:\n" + "\n".join(off_site)


def test_no_chapter_is_left_with_a_placeholder():
    """A `TBD(...)` marks a number still to measure: none may reach the published book."""
    left = [
        f"{path.name}:{n}: {line.strip()[:80]}"
        for path in [*CHAPTERS, ROOT / "README.md"]
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if "TBD(" in line
    ]
    assert not left, "placeholders left:\n" + "\n".join(left)
