"""MkDocs hook: every measured number in the book is read from a committed result.

A chapter never types a measured number. It writes a placeholder, and the build puts in the
value from a JSON file in benches/results/, so a re-run of a benchmark updates every chapter
at once and no two chapters can disagree:

    prefilled about {{ model:prefill[0].impls.ref.tokens_per_s.median | .0f }} tokens/s

    {{ SOURCE:PATH | FORMAT }}

SOURCE is a short name from book/results.yml for one JSON file. PATH walks into it with keys
and list indices (`decode[1].impls.mlx-lm.ms_per_step.median`); a key with a dot or a space
goes in brackets and double quotes (`times["course, mx.softmax"]`). FORMAT is a Python format
spec (`.1f`, `.0%`, `,.0f`); whole numbers and text (a version) may leave it out. A path that
ends at a summary with median, min and max is written `median (min-max)`. The value may be
arithmetic over several lookups and numbers, with spaces around the operators:

    {{ model:decode[1].impls.ref.ms_per_step.median / model:decode[0].impls.ref.ms_per_step.median | .2f }}

`{{ SOURCE:@file }}` writes the file's path (benches/results/...), to name it in the text, and
a plot saved beside the results is an image of the site: `![what it shows](results/NAME.png)`.

A number that was measured but has no committed JSON yet is a `pending:NAME` lookup, typed in
book/results.yml together with the command that will measure it. Any error (an unknown source,
a path that is not there, a missing format) stops the build and names the page.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path
from typing import Any

import yaml
from mkdocs.exceptions import PluginError

PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}", re.S)
LOOKUP = re.compile(r"([a-z][\w-]*):((?:\[[^\]]*\]|[^\s|(){}\[])+)")
PATH_PART = re.compile(r"\[(\d+)\]|\[\"([^\"]*)\"\]|\.?([^.\[\]]+)")
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,  # whole pages: -(-tokens // page_size)
}


class Results:
    """The sources named in book/results.yml, loaded on first use."""

    def __init__(self, registry: Path, results_dir: Path):
        spec = yaml.safe_load(registry.read_text())
        self.results_dir = results_dir
        self.sources: dict[str, str] = spec.get("sources") or {}
        self.pending: dict[str, dict[str, Any]] = spec.get("pending") or {}
        self._loaded: dict[str, Any] = {}

    def data(self, source: str) -> Any:
        if source == "pending":
            return {name: entry["value"] for name, entry in self.pending.items()}
        if source not in self.sources:
            raise ValueError(f"unknown source {source!r}: add it to book/results.yml")
        if source not in self._loaded:
            path = self.results_dir / self.sources[source]
            if not path.is_file():
                raise ValueError(f"source {source!r}: {path} does not exist")
            self._loaded[source] = json.loads(path.read_text())
        return self._loaded[source]

    def lookup(self, source: str, path: str) -> Any:
        if path == "@file":  # the file itself, to name it in the text
            self.data(source)
            return f"benches/results/{self.sources[source]}"
        value = self.data(source)
        for index, quoted, key in PATH_PART.findall(path):
            key = quoted or key
            try:
                value = value[int(index)] if index else value[key]
            except (KeyError, IndexError, TypeError):
                raise ValueError(f"{source}:{path}: no {index or key!r} there") from None
        return value

    def render(self, placeholder: str) -> str:
        """The text for one placeholder's inside, `EXPR | FORMAT`."""
        expr, _, spec = placeholder.partition("|")
        value = self.evaluate(expr.strip())
        return format_value(value, spec.strip())

    def evaluate(self, expr: str) -> Any:
        values: dict[str, Any] = {}

        def name_lookup(match: re.Match) -> str:
            name = f"_v{len(values)}"
            values[name] = self.lookup(match.group(1), match.group(2))
            return name

        tree = ast.parse(LOOKUP.sub(name_lookup, expr), mode="eval")
        return arithmetic(tree.body, values)


def arithmetic(node: ast.AST, values: dict[str, Any]) -> Any:
    """+ - * / // and parentheses over numbers and looked-up values; nothing else."""
    if isinstance(node, ast.Name) and node.id in values:
        return values[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -arithmetic(node.operand, values)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = arithmetic(node.left, values), arithmetic(node.right, values)
        if isinstance(left, dict) or isinstance(right, dict):
            raise ValueError("arithmetic needs numbers: pick .median, .min or .max")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not a lookup, a number or + - * / //: {ast.unparse(node)!r}")


def format_value(value: Any, spec: str) -> str:
    if isinstance(value, dict) and {"median", "min", "max"} <= value.keys():
        parts = [format_value(value[k], spec) for k in ("median", "min", "max")]
        return f"{parts[0]} ({parts[1]}-{parts[2]})"
    if isinstance(value, str) and not spec:
        return value  # a version or a name recorded with the result
    if isinstance(value, bool) and not spec:
        return "yes" if value else "no"  # a check recorded with the result
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number")
    if not spec:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} needs a format, for example | .1f")
        return str(int(value))
    return format(value, spec)


def find_placeholders(markdown: str) -> list[str]:
    return [m.group(1) for m in PLACEHOLDER.finditer(markdown)]


def load_results(config_file: str | Path) -> Results:
    book = Path(config_file).resolve().parent
    return Results(book / "results.yml", book.parent / "benches" / "results")


# --- MkDocs events ---------------------------------------------------------------------------

_results: Results | None = None


def on_config(config):
    global _results
    _results = load_results(config.config_file_path)
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        try:
            return _results.render(match.group(1))
        except (ValueError, SyntaxError) as error:
            raise PluginError(f"{page.file.src_path}: {match.group(0)}: {error}") from None

    return PLACEHOLDER.sub(replace, markdown)


def on_files(files, config):
    """The plots beside the results are pages' images too: `![...](results/NAME.png)`."""
    from mkdocs.structure.files import File

    for plot in sorted(_results.results_dir.glob("*.png")):
        files.append(File.generated(config, f"results/{plot.name}", abs_src_path=str(plot)))
    return files


def on_serve(server, config, builder):
    book = Path(config.config_file_path).resolve().parent
    server.watch(str(book / "results.yml"))
    server.watch(str(book.parent / "benches" / "results"))
    return server
