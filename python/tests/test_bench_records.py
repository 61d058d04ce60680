"""docs/benchmarks.md's tables and plots are rendered from the benchmark records in
benches/records/: the committed page matches them, a table edited by hand (or a record
changed without regenerating the page) is caught, and so is an image that is missing or not
drawn from a record."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # for `benches`; after the installed packages
from benches import plots, records  # noqa: E402


def test_every_table_of_the_page_matches_its_record(capsys: pytest.CaptureFixture[str]) -> None:
    assert records.report(check=True) == 0, capsys.readouterr().err


def test_a_table_edited_by_hand_fails_the_check_and_report_restores_it(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(
        "# A page\n\n<!-- benches:table socket-settings -->\n<!-- /benches:table -->\n",
        encoding="utf-8",
    )
    assert records.report(check=True, page=page) == 1  # an empty block: not its record
    assert records.report(check=False, page=page) == 0
    text = page.read_text(encoding="utf-8")
    assert records.report(check=True, page=page) == 0
    row = text.index("| ours |")
    page.write_text(text[:row] + "| theirs |" + text[row + len("| ours |") :], encoding="utf-8")
    assert records.report(check=True, page=page) == 1
    assert records.report(check=False, page=page) == 0
    assert page.read_text(encoding="utf-8") == text


def test_a_block_without_a_record_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("<!-- benches:table no-such-suite -->\n<!-- /benches:table -->\n")
    assert records.report(check=True, page=page) == 1


def test_a_plot_block_names_its_record_and_needs_its_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_matplotlib(*_: object) -> None:
        raise ImportError("matplotlib")

    monkeypatch.setattr(plots, "plot_record", no_matplotlib)
    page = tmp_path / "benchmarks.md"
    page.write_text("<!-- benches:plot core tcp-latency -->\n<!-- /benches:plot -->\n")
    assert records.report(check=False, page=page) == 1  # no matplotlib and no PNG to keep
    text = page.read_text(encoding="utf-8")
    assert "](img/core-tcp-latency.png)" in text
    assert "benches/records/core.json" in text
    assert records.report(check=True, page=page) == 1
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "core-tcp-latency.png").write_bytes(b"kept")
    assert records.report(check=False, page=page) == 0  # kept as it is
    assert (tmp_path / "img" / "core-tcp-latency.png").read_bytes() == b"kept"
    assert records.report(check=True, page=page) == 0
    page.write_text(text + "![by hand](img/core-tcp-latency.png)\n", encoding="utf-8")
    assert records.report(check=True, page=page) == 1  # an image outside a plot block


def test_a_plot_no_record_or_suite_draws_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    for block in ("no-such-suite tcp-latency", "core no-such-plot"):
        page.write_text(f"<!-- benches:plot {block} -->\n<!-- /benches:plot -->\n")
        assert records.report(check=True, page=page) == 1
