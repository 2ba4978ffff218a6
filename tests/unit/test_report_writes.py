"""Reports and HTML pages are written through an unguessable temp file and os.replace: a
symlink another user planted at the final name or at the old predictable temp name is replaced,
never written through (an operator's shared --out directory)."""

from __future__ import annotations

from pathlib import Path

from node_agent import atomic_file
from node_agent.report.html import write_text_atomic


def plant(directory: Path, name: str, victim: Path) -> None:
    (directory / name).symlink_to(victim)


def test_write_text_replaces_a_symlink_at_the_final_name_and_leaves_its_target(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    out = tmp_path / "out"
    out.mkdir()
    plant(out, "report.json", victim)
    plant(out, ".report.json.tmp", victim)  # the temp name the writer used to use
    atomic_file.write_text(out / "report.json", "{}\n")
    assert victim.read_text() == "root's file"
    assert not (out / "report.json").is_symlink()
    assert (out / "report.json").read_text() == "{}\n"
    assert (out / "report.json").stat().st_mode & 0o777 == 0o600


def test_html_page_is_written_the_same_way(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    plant(tmp_path, ".page.html.tmp", victim)
    write_text_atomic("<html></html>", tmp_path / "page.html")
    assert victim.read_text() == "root's file"
    assert (tmp_path / "page.html").read_text() == "<html></html>"
