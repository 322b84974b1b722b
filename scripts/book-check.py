"""pdm run book-check: open every page of the built book in headless Chromium.

Builds the site into a temporary folder, serves it on 127.0.0.1 and loads each page in the
system's Chromium (driven by Playwright, which downloads no browser here). A page fails on:
a console error or an uncaught exception, a request to another site (the book must read
offline; such requests are blocked and reported), a request that fails, an image that did not
load, and a formula that is not laid out as math (MathML the browser did not render, or TeX
left as text). Exit 0 when every page passes, 1 otherwise, 2 when Chromium is missing.

    pdm run book-check [--site DIR] [--screenshots DIR] [--chromium PATH]
"""

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Flags for a machine without a display or a network (no first-run, sync or update traffic).
CHROMIUM_FLAGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Runs in the page: broken images, formulas the browser did not lay out, TeX left as text.
PAGE_CHECKS = """() => {
  const problems = [];
  for (const img of document.images) {
    if (!img.complete || img.naturalWidth === 0) problems.push(`broken image ${img.src}`);
  }
  const formulas = [...document.querySelectorAll("math")];
  for (const m of formulas) {
    const box = m.getBoundingClientRect();
    const shown = m.closest("details:not([open])") === null;
    if (!getComputedStyle(m).display.includes("math"))
      problems.push(`formula not laid out as MathML: ${m.textContent.slice(0, 60)}`);
    else if (shown && box.width === 0) problems.push(`formula of zero width: ${m.textContent.slice(0, 60)}`);
    if (m.querySelector("merror")) problems.push(`formula with an error: ${m.textContent.slice(0, 60)}`);
  }
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest("pre, code, script, style, math")) continue;
    const text = node.textContent;
    for (const delimiter of ["\\\\(", "\\\\[", "$$"]) {
      if (text.includes(delimiter)) problems.push(`TeX left as text: ${text.trim().slice(0, 80)}`);
    }
  }
  return {problems, formulas: formulas.length, images: document.images.length};
}"""


def build_site(out: Path) -> None:
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    cmd += ["-f", str(ROOT / "book" / "mkdocs.yml"), "-d", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True)


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def find_chromium(given: str | None) -> str | None:
    if given:
        return given if Path(given).exists() else None
    return next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)


def watch(page, base: str, problems: list[str]) -> None:
    """Record a page's console errors and uncaught exceptions in problems, and refuse (and
    record) every request that leaves base: the pages must work offline."""
    page.on(
        "console",
        lambda m: problems.append(f"console error: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))

    def local_only(route, request):
        if request.url.startswith(base):
            route.continue_()
        else:
            problems.append(f"request to another site: {request.url}")
            route.abort()

    page.route("**/*", local_only)


def check_pages(chromium: str, base: str, pages: list[str], shots: Path | None) -> dict:
    """page -> list of problems; also prints one line per page."""
    from playwright.sync_api import sync_playwright

    results, totals = {}, {"formulas": 0, "images": 0}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        for name in pages:
            page = browser.new_page()
            problems: list[str] = []
            watch(page, base, problems)

            def failed(request, out=problems):
                if request.url.startswith(base):  # the others were blocked on purpose, in watch
                    out.append(f"request failed: {request.url} ({request.failure})")

            page.on("requestfailed", failed)
            response = page.goto(base + name, wait_until="networkidle")
            if response is None or response.status != 200:
                problems.append(f"HTTP {response.status if response else 'no response'}")
            found = page.evaluate(PAGE_CHECKS)
            problems += found["problems"]
            totals["formulas"] += found["formulas"]
            totals["images"] += found["images"]
            if shots is not None:
                shot = shots / (name.strip("/").replace("/", "_") or "index")
                page.screenshot(path=f"{shot}.png", full_page=True)
            page.close()
            results[name] = problems
            status = "ok" if not problems else f"{len(problems)} problem(s)"
            print(f"  {name or '/':<45} {found['formulas']:>4} formulas  {status}")
            for problem in problems:
                print(f"      {problem}")
        browser.close()
    print(f"{len(pages)} pages, {totals['formulas']} formulas, {totals['images']} images")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(prog="book-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="check this built site instead of building one")
    parser.add_argument("--screenshots", type=Path, help="save a full-page PNG of every page here")
    parser.add_argument(
        "--chromium", default=os.environ.get("BOOK_CHECK_CHROMIUM"), help="the browser to use"
    )
    args = parser.parse_args()
    chromium = find_chromium(args.chromium)
    if chromium is None:
        print(
            "book-check: no Chromium found. Install it (Debian/Ubuntu: sudo apt-get install "
            "chromium) or set BOOK_CHECK_CHROMIUM to a Chromium or Chrome executable.",
            file=sys.stderr,
        )
        return 2
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="book-check-") as tmp:
        site = args.site or Path(tmp)
        if args.site is None:
            build_site(site)
        pages = sorted(
            p.relative_to(site).as_posix().removesuffix("index.html") for p in site.rglob("*.html")
        )
        server = serve(site)
        try:
            base = f"http://127.0.0.1:{server.server_address[1]}/"
            print(f"book-check: {len(pages)} pages in {chromium}")
            results = check_pages(chromium, base, pages, args.screenshots)
        finally:
            server.shutdown()
    failed = [name for name, problems in results.items() if problems]
    if failed:
        print(f"book-check: FAILED on {len(failed)} page(s): {', '.join(failed)}", file=sys.stderr)
        return 1
    print("book-check: every page passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
