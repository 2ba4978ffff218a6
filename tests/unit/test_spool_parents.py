"""The spool's parents: made traversable whatever the umask, and named when they are not
(issue 34; the attack by a real user, against the real daemon, is in tests/security)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from node_agent.atomic_file import ensure_spool_dirs, spool_unreachable


@pytest.fixture
def open_dir():
    """A directory every user may pass (pytest's tmp_path is under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="na-spool-parents-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def test_state_and_spool_made_in_a_new_parent_under_umask_077_leave_the_parent_0755(open_dir):
    base = open_dir / "var" / "lib" / "node-agent"
    code = (
        "import os, sys; os.umask(0o077)\n"
        "from node_agent.atomic_file import ensure_spool_dirs, private_dir\n"
        "private_dir(sys.argv[1] + '/state')\n"
        "print(ensure_spool_dirs(sys.argv[1] + '/spool'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(base)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "cannot reach" not in done.stdout
    modes = {p: os.stat(p).st_mode & 0o7777 for p in (base.parent, base, base / "state")}
    assert modes == {base.parent: 0o755, base: 0o755, base / "state": 0o700}


def test_an_existing_parent_nobody_else_may_pass_is_named_with_its_fix(open_dir):
    base = open_dir / "node-agent"
    base.mkdir()
    base.chmod(0o700)
    notes = ensure_spool_dirs(base / "spool")
    (note,) = [n for n in notes if "cannot reach" in n]
    assert f"{base} is mode 0700" in note and f"chmod o+x {base}" in note
    assert base.stat().st_mode & 0o777 == 0o700  # said, not changed: it is the operator's


def test_a_parent_its_group_may_pass_is_the_operators_choice(open_dir):
    base = open_dir / "node-agent"
    base.mkdir()
    base.chmod(0o710)
    assert spool_unreachable(base / "spool") == []
