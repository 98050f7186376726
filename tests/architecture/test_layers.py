"""The import-linter layer list matches the folders: one layer entry per package of
`gateway/`, each named whole, so a new package cannot slip between the layers unchecked."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import gateway

ROOT = Path(gateway.__file__).parent
CONTRACTS = ROOT.parent / ".importlinter"


def layer_names() -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS)
    text = parser["importlinter:contract:layers"]["layers"]
    return [name for name in re.split(r"[\s|()]+", text) if name]


def test_one_layer_per_package() -> None:
    names = layer_names()
    packages = sorted(f"gateway.{path.parent.name}" for path in ROOT.glob("*/__init__.py"))
    assert sorted(name for name in names if name != "gateway.__main__") == packages
    assert len(names) == len(set(names))
