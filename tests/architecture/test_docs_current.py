"""The docs keep up with the code: the generated tables (every configuration key in
docs/configuration.md, every metric family in docs/metrics.md) match what
scripts/gen_docs.py makes of the code today, and every link between the docs leads to a
file and a heading that exist."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from gateway.config import GatewayConfig
from scripts.docs_gen import blocks
from scripts.docs_gen.config_keys import config_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "sim" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EMPTY = "before\n<!-- generated: {tag} -->\n<!-- end generated -->\nafter\n"


def test_the_generated_tables_are_current() -> None:
    # A process of its own: the generator starts serving processes to read their metrics.
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_names_a_missing_row_and_a_row_for_what_is_gone() -> None:
    fresh = config_table()
    assert (
        blocks.stale(
            "config", blocks.with_block(EMPTY.format(tag="config"), "config", fresh), fresh
        )
        == []
    )
    dropped = next(line for line in fresh.splitlines() if line.startswith("| `limits.max_choices`"))
    ghost = "| `limits.max_gone` | int | 1 |  | restart | call | no longer a key |"
    edited = fresh.replace(dropped + "\n", "") + ghost + "\n"
    doc = blocks.with_block(EMPTY.format(tag="config"), "config", edited)
    assert blocks.stale("config", doc, fresh) == [
        "config: missing row `limits.max_choices`",
        "config: row for `limits.max_gone`, which no longer exists",
    ]


def test_the_check_names_a_changed_metric_and_a_doc_without_its_block() -> None:
    fresh = blocks.block((ROOT / "docs" / "metrics.md").read_text(), "metrics")
    assert fresh is not None and "| `gateway_requests_total` |" in fresh
    edited = fresh.replace(
        "| `gateway_requests_total` | counter |", "| `gateway_requests_total` | gauge |"
    )
    doc = blocks.with_block(EMPTY.format(tag="metrics"), "metrics", edited)
    assert blocks.stale("metrics", doc, fresh) == ["metrics: row `gateway_requests_total` differs"]
    assert blocks.stale("metrics", "no markers here\n", fresh) == [
        "metrics: no `<!-- generated: metrics -->` ... `<!-- end generated -->` block"
    ]


def test_every_configuration_key_has_a_row() -> None:
    table = blocks.block((ROOT / "docs" / "configuration.md").read_text(), "config")
    assert table is not None
    for field in dataclasses.fields(GatewayConfig):
        assert f"| `{field.name}" in table, field.name


# -- links ---------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug, n = _slug(heading), 1
        while slug in found:  # GitHub numbers repeated headings
            slug, n = f"{_slug(heading)}-{n}", n + 1
        found.add(slug)
    return found


def _links(path: Path) -> list[str]:
    return LINK.findall(CODE.sub("", FENCE.sub("", path.read_text())))


def test_every_link_between_the_docs_leads_somewhere() -> None:
    broken = []
    for doc in DOCS:
        for target in _links(doc):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            where = (doc.parent / file).resolve() if file else doc
            if not where.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_keeps_the_commands_ci_reads_near_the_top() -> None:
    head = (ROOT / "README.md").read_text().splitlines()[:30]
    assert any(line.startswith("make run ") for line in head)
    assert any(line.startswith("make test ") for line in head)
