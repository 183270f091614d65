"""README.md's Configuration tables against the command line's parsers: every server flag is
documented with its default, and no documented flag is stale."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from twinplane.clients.cli import build_parser

README = Path(__file__).resolve().parent.parent / "README.md"
DOCUMENTED_COMMANDS = ("dataplane", "controlplane", "serve")  # and the options before the command
FLAG = re.compile(r"`(--?[a-z][a-z0-9-]*)`")


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    # some defaults are read from the environment when the parser is built
    for name in ("TWINPLANE_API_KEY", "TWINPLANE_DATAPLANE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def documented_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    commands = subcommands(parser)
    return options(parser) + [a for name in DOCUMENTED_COMMANDS for a in options(commands[name])]


def table_rows() -> list[tuple[set[str], str]]:
    """(flags in the first cell, the rest of the row) for each table row of the Configuration section."""
    text = README.read_text()
    section = re.search(r"^## Configuration\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no '## Configuration' section followed by another section"
    rows = []
    for line in section.group(1).splitlines():
        if line.startswith("|"):
            first, _, rest = line.strip("|").partition("|")
            rows.append((set(FLAG.findall(first)), rest))
    return rows


def test_every_server_flag_is_in_the_configuration_tables(parser):
    documented = {flag for flags, _ in table_rows() for flag in flags}
    missing = sorted({s for a in documented_options(parser) for s in a.option_strings} - documented)
    assert not missing, f"flags missing from README.md's Configuration tables: {missing}"


def test_documented_defaults_match_the_parsers(parser):
    rows = table_rows()
    wrong = set()
    for action in documented_options(parser):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            continue  # no default, or a switch that is off: described in words
        cells = [rest for flags, rest in rows if flags & set(action.option_strings)]
        if not any(f"`{action.default}`" in rest for rest in cells):
            wrong.add(f"{action.option_strings[0]} (default {action.default!r})")
    assert not wrong, f"README.md's Configuration tables do not give these defaults: {sorted(wrong)}"


def test_every_documented_flag_exists(parser):
    known = {s for p in (parser, *subcommands(parser).values()) for a in options(p) for s in a.option_strings}
    stale = sorted({flag for flags, _ in table_rows() for flag in flags} - known)
    assert not stale, f"README.md documents flags that no command has: {stale}"


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_inside_the_readme_point_at_headings():
    text = README.read_text()
    anchors = {heading_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    broken = sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors)
    assert not broken, f"README.md links to headings it does not have: {broken}"
