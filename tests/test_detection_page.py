"""bench.detection's page writer: tables replace their marked blocks, prose is kept."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.detection import write_page


def test_write_page_replaces_only_the_marked_block(tmp_path: Path) -> None:
    page = tmp_path / "d.md"
    page.write_text("# T\nprose\n<!-- detection:clean:begin -->\nold\n<!-- detection:clean:end -->\ntail\n")
    write_page(page, {"clean": "| new |"})
    assert page.read_text() == ("# T\nprose\n<!-- detection:clean:begin -->\n| new |\n"
                                "<!-- detection:clean:end -->\ntail\n")


def test_write_page_refuses_a_missing_page_or_block(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such page"):
        write_page(tmp_path / "none.md", {"clean": "x"})
    page = tmp_path / "d.md"
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="detection:bugs:begin"):
        write_page(page, {"bugs": "x"})
    assert page.read_text() == "no markers\n"
