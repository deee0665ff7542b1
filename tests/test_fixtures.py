"""The test fixtures find their services the way a fresh Debian machine installs them."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.pg import server_binary


def test_postgres_binaries_are_found_off_path_in_debians_directory(tmp_path: Path) -> None:
    """Debian's postgresql-15 puts initdb and pg_ctl in /usr/lib/postgresql/15/bin, not on PATH."""
    for version in ("9", "13", "15"):
        bin_dir = tmp_path / "lib" / "postgresql" / version / "bin"
        bin_dir.mkdir(parents=True)
        for tool in ("initdb", "pg_ctl"):
            (bin_dir / tool).write_text("#!/bin/sh\n")
            (bin_dir / tool).chmod(0o755)
    glob = str(tmp_path / "lib" / "postgresql" / "*" / "bin")
    empty = tmp_path / "empty-path"
    empty.mkdir()
    assert server_binary("initdb", path=str(empty), debian_glob=glob) == str(tmp_path / "lib/postgresql/15/bin/initdb")
    assert server_binary("postgres", path=str(empty), debian_glob=glob) is None
    on_path = tmp_path / "on-path"
    on_path.mkdir()
    (on_path / "pg_ctl").write_text("#!/bin/sh\n")
    (on_path / "pg_ctl").chmod(0o755)
    assert server_binary("pg_ctl", path=str(on_path), debian_glob=glob) == str(on_path / "pg_ctl")  # PATH first
