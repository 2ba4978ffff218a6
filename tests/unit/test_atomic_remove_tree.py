"""``atomic_file.remove_tree``: removal of a tree another user made, without recursion, never
through a link (the attack itself, by a real user, is in tests/security)."""

from __future__ import annotations

import os
from pathlib import Path

from node_agent.atomic_file import remove_tree


def _nest(top: Path, depth: int) -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(depth):
        os.close(os.open(f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)


def _remove(parent: Path, name: str, **caps: int) -> str | None:
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return remove_tree(fd, name, where=parent, **caps)
    finally:
        os.close(fd)


def test_a_tree_deeper_than_the_fds_it_may_hold_is_removed_whole(tmp_path):
    (tmp_path / "t").mkdir()
    _nest(tmp_path / "t", 60)
    assert _remove(tmp_path, "t", max_depth=4) is None
    assert list(tmp_path.iterdir()) == []


def test_a_link_in_the_tree_is_unlinked_and_its_target_kept(tmp_path):
    target = tmp_path / "keep"
    target.mkdir()
    (target / "precious").write_text("x")
    (tmp_path / "t" / "sub").mkdir(parents=True)
    (tmp_path / "t" / "sub" / "to-dir").symlink_to(target)
    (tmp_path / "t" / "to-file").symlink_to(target / "precious")
    assert _remove(tmp_path, "t") is None
    assert (target / "precious").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]


def test_a_link_or_file_at_the_name_itself_is_unlinked(tmp_path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "t").symlink_to(tmp_path / "keep")
    assert _remove(tmp_path, "t") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]


def test_more_entries_than_the_cap_leave_a_sentence_naming_the_directory(tmp_path):
    (tmp_path / "t").mkdir()
    for i in range(30):
        (tmp_path / "t" / f"{i}").write_text("")
    left = _remove(tmp_path, "t", max_entries=10)
    assert left is not None and str(tmp_path / "t") in left and "more than 10 entries" in left
    assert "rm -rf --one-file-system" in left


def test_a_missing_name_is_already_removed(tmp_path):
    assert _remove(tmp_path, "absent") is None
