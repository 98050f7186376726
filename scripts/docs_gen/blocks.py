"""The generated blocks in their docs: a Markdown table, the block between
`<!-- generated: NAME -->` and `<!-- end generated -->`, and what is stale in a doc's
block against a fresh rendering."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

END = "<!-- end generated -->"


def begin(tag: str) -> str:
    return f"<!-- generated: {tag} -->"


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table, one line a row."""
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines) + "\n"


def block(text: str, tag: str) -> str | None:
    """The generated block `tag` of a doc, between its markers (None: no markers)."""
    start, end = text.find(begin(tag)), text.find(END, text.find(begin(tag)))
    if start < 0 or end < 0:
        return None
    return text[start + len(begin(tag)) : end].strip("\n") + "\n"


def with_block(text: str, tag: str, body: str) -> str:
    start = text.index(begin(tag)) + len(begin(tag))
    return text[:start] + "\n" + body + text[text.index(END, start) :]


def _rows(body: str) -> dict[str, str]:
    """A table's rows by their first cell (the key or metric)."""
    rows = {}
    for line in body.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) > 1:
            rows[cells[0].removeprefix("| ")] = line
    return rows


def stale(tag: str, doc: str, fresh: str) -> list[str]:
    """What is out of date in the doc text's block `tag`, against a fresh rendering: rows
    missing, rows for what no longer exists, rows that changed."""
    committed = block(doc, tag)
    if committed is None:
        return [f"{tag}: no `{begin(tag)}` ... `{END}` block"]
    if committed == fresh:
        return []
    have, want = _rows(committed), _rows(fresh)
    problems = [f"{tag}: missing row {name}" for name in want if name not in have]
    problems += [
        f"{tag}: row for {name}, which no longer exists" for name in have if name not in want
    ]
    problems += [
        f"{tag}: row {name} differs" for name in want if name in have and have[name] != want[name]
    ]
    return problems or [f"{tag}: the table differs (header or order)"]
