"""MkDocs hook: formulas become MathML when the book is built, so reading it needs no network.

Chapters write TeX as `\\( ... \\)` inline and `\\[ ... \\]` for a display. The arithmatex
extension keeps that TeX away from Markdown and wraps it in `class="arithmatex"`; this hook
converts each one with latex2mathml into MathML, which browsers lay out themselves (no
JavaScript, no fonts or scripts fetched while reading). A formula latex2mathml cannot convert,
or one that would leave TeX on the page, stops the build and names the page.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError

ARITHMATEX = re.compile(
    r'<(span|div) class="arithmatex">\s*\\[(\[](.*?)\\[)\]]\s*</\1>',
    re.S,
)
TAG = re.compile(r"<[^>]+>")


def to_mathml(tex: str, display: bool) -> str:
    mathml = convert(tex, display="block" if display else "inline")
    leftover = html.unescape(TAG.sub("", mathml))
    if "\\" in leftover or "merror" in mathml:
        raise ValueError(f"latex2mathml left TeX behind: {leftover.strip()!r}")
    return mathml


def on_page_content(content: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        tex = html.unescape(match.group(2)).strip()
        try:
            return to_mathml(tex, display=match.group(1) == "div")
        except Exception as error:  # latex2mathml raises its own types for bad TeX
            raise PluginError(f"{page.file.src_path}: formula {tex!r}: {error}") from None

    return ARITHMATEX.sub(replace, content)
