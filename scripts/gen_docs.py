"""Generate the reference tables of the docs from the code, so they cannot drift from it:
every configuration key (docs/configuration.md, from the pydantic schema in gateway/config)
and every metric family (docs/metrics.md, from the Prometheus registries the gateway builds).

    .venv/bin/python scripts/gen_docs.py          # rewrite the tables in place
    .venv/bin/python scripts/gen_docs.py --check  # exit 1, naming what is stale

Each table sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; the prose
around it is hand-written and left alone. tests/architecture/test_docs_current.py runs the
check. A key's meaning is its field's `description=` in gateway/config (NOT_IN_SCHEMA in
scripts/docs_gen/config_facts.py: the few keys that are no field); a key without one (or
an entry there for a key that no longer exists) stops the generator: the table says what
every key means. The tables are made in scripts/docs_gen/; this is the command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts.docs_gen, when run by its path

from scripts.docs_gen.blocks import block, stale, with_block  # noqa: E402
from scripts.docs_gen.config_keys import config_table  # noqa: E402
from scripts.docs_gen.metrics_table import metrics_table  # noqa: E402

CONFIG_DOC = ROOT / "docs" / "configuration.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
BLOCKS: dict[str, tuple[Path, Callable[[], str]]] = {
    "config": (CONFIG_DOC, config_table),
    "metrics": (METRICS_DOC, metrics_table),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    problems = []
    for tag, (path, render) in BLOCKS.items():
        text, fresh = path.read_text(), render()
        if args.check:
            problems += stale(tag, text, fresh)
        elif block(text, tag) != fresh:
            path.write_text(with_block(text, tag, fresh))
            print(f"rewrote the {tag} table in {path.relative_to(ROOT)}")
    for problem in problems:
        print(problem)
    if problems:
        print("regenerate with `.venv/bin/python scripts/gen_docs.py`")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
