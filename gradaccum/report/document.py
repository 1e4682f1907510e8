"""The report as one Markdown document, rendered once more to a self-contained HTML page.

Sections add Markdown blocks; figures are kept as PNG bytes. `markdown()` links them as files
(reports/figures/), `html()` renders the same Markdown with markdown-it-py and embeds them, so the
page opens with no network and the two outputs cannot say different things.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from markdown_it import MarkdownIt  # noqa: E402

STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3}"
    "img{max-width:100%}em{color:#555}"
    "pre{background:#f6f6f6;padding:6px;font-size:12px;overflow-x:auto}"
    "blockquote.banner{margin:0;background:#fde8e8;border:2px solid #c44e52;padding:0 8px}"
    "summary{cursor:pointer;color:#555}"
)
FIGURE_DIR = "figures"  # where report.md's image links point, beside it


@dataclass
class Report:
    title: str
    stamp: str = ""  # printed on every figure: the scale, when it is not the tutorial's study
    blocks: list[str] = field(default_factory=list)
    figures: dict[str, bytes] = field(default_factory=dict)
    collapsed: dict[int, str] = field(default_factory=dict)  # block index -> its summary line, folded in the HTML

    def banner(self, text: str) -> None:
        self.blocks.append(f"> **{text}**")

    def heading(self, text: str) -> None:
        self.blocks.append(f"## {text}")

    def text(self, text: str) -> None:
        self.blocks.append(text)

    def pre(self, text: str) -> None:
        self.blocks.append(f"```text\n{text.rstrip()}\n```")

    def details(self, summary: str, text: str) -> None:
        """A long preformatted block: shown in report.md, folded under `summary` in report.html."""
        self.collapsed[len(self.blocks)] = summary
        self.pre(text)

    def table(self, rows: list[dict[str, Any]], explain_once: tuple[str, ...] = ()) -> None:
        """`explain_once`: columns whose cells repeat a long explanation in brackets; each cell keeps its head,
        and each explanation is said once, in a note above the table."""
        if not rows:
            return
        rows = [dict(r) for r in rows]
        notes: dict[tuple[str, str], list[str]] = {}  # (column, explanation) -> the cells' heads it explains
        for column in explain_once:
            for r in rows:
                head, bracket, said = str(r.get(column, "")).partition(" (")
                if bracket:
                    heads = notes.setdefault((column, said.removesuffix(")")), [])
                    heads += [] if f"*{head}*" in heads else [f"*{head}*"]
                    r[column] = head
        if notes:
            self.text("; ".join(f"{col} {', '.join(heads)}: {said}" for (col, said), heads in notes.items()) + ".")
        cols = list(dict.fromkeys(c for r in rows for c in r))  # every row's columns, in order
        lines = ["| " + " | ".join(map(cell, cols)) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(r.get(c, "-")) for c in cols) + " |" for r in rows]  # "-": not measured
        self.blocks.append("\n".join(lines))

    def figure(self, name: str, fig: plt.Figure, caption: str) -> None:
        if self.stamp:
            fig.suptitle(self.stamp, color="#c44e52", fontsize=10, fontweight="bold")
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        self.figures[name] = buffer.getvalue()
        self.blocks.append(f"![{caption}]({FIGURE_DIR}/{name})\n\n*{caption}*")

    def markdown(self) -> str:
        return f"# {self.title}\n\n" + "\n\n".join(self.blocks) + "\n"

    def html(self) -> str:
        """The Markdown rendered (raw HTML off), figures embedded as data URIs, the scale banner marked,
        the collapsed blocks folded in <details>."""
        parts = [self.render(f"# {self.title}")]
        for i, block in enumerate(self.blocks):
            body = self.render(block)
            if i in self.collapsed:
                body = f"<details><summary>{html.escape(self.collapsed[i])}</summary>\n{body}</details>\n"
            parts.append(body)
        body = "".join(parts)
        return (
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(self.title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}</body></html>\n"
        )

    def render(self, text: str) -> str:
        md = MarkdownIt("commonmark", {"html": False}).enable("table")
        tokens = md.parse(text)
        for token in tokens:
            if token.type == "blockquote_open":
                token.attrSet("class", "banner")
            for child in token.children or []:
                src = str(child.attrGet("src") or "")
                if child.type == "image" and src.removeprefix(f"{FIGURE_DIR}/") in self.figures:
                    data = base64.b64encode(self.figures[src.removeprefix(f"{FIGURE_DIR}/")]).decode()
                    child.attrSet("src", f"data:image/png;base64,{data}")
        return md.renderer.render(tokens, md.options, {})


def cell(value: Any) -> str:
    """A Markdown table cell: a pipe would end the cell, a newline the row."""
    return str(value).replace("|", "/").replace("\n", " ")
