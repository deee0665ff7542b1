"""Which catalog and which policy are in force: table tests of the pure decisions."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptier.storage.catalog.db import resolve_catalog_url
from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import default_config, parse_config
from ckptier.tasks.settings import catalog_location, unwritten_policy_problem

FILE = ("sqlite:////from/file.db", "/etc/ckptier.toml")


@pytest.mark.parametrize(
    ("explicit", "environ", "config", "url", "source"),
    [
        ("sqlite:////given.db", {"CKPTIER_CATALOG_URL": "sqlite:////env.db"}, FILE, "sqlite:////given.db", "--catalog"),
        (None, {"CKPTIER_CATALOG_URL": "sqlite:////env.db"}, FILE, "sqlite:////env.db", "CKPTIER_CATALOG_URL"),
        (None, {}, FILE, "sqlite:////from/file.db", "[catalog] url in /etc/ckptier.toml"),
        (None, {"CKPTIER_CATALOG_URL": "  "}, FILE, "sqlite:////from/file.db", "[catalog] url in /etc/ckptier.toml"),
        ("", {}, FILE, "sqlite:////from/file.db", "[catalog] url in /etc/ckptier.toml"),
        (None, {"HOME": "/home/u"}, (None, "/etc/ckptier.toml"), "sqlite:////home/u/.local/share/ckptier/catalog.db", "default"),
        (None, {"HOME": "/home/u"}, None, "sqlite:////home/u/.local/share/ckptier/catalog.db", "default"),
        (None, {"CKPTIER_HOME": "/srv/ck", "HOME": "/home/u"}, None, "sqlite:////srv/ck/catalog.db", "default"),
        (None, {"XDG_DATA_HOME": "/xdg", "HOME": "/home/u"}, None, "sqlite:////xdg/ckptier/catalog.db", "default"),
    ],
)
def test_catalog_url_precedence(explicit: str | None, environ: dict[str, str], config: tuple[str | None, str] | None,
                                url: str, source: str) -> None:
    got = resolve_catalog_url(explicit, config_url=config, environ=environ)
    assert (got.url, got.source) == (url, source)


def test_the_config_file_is_read_only_when_it_decides() -> None:
    def boom() -> tuple[str | None, str | None]:
        raise AssertionError("config read although --catalog or the environment decided")

    assert resolve_catalog_url("sqlite:////a.db", config_url=boom, environ={}).source == "--catalog"
    assert resolve_catalog_url(None, config_url=boom, environ={"CKPTIER_CATALOG_URL": "sqlite:////b.db"}).url == "sqlite:////b.db"


def test_catalog_location_reads_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTIER_CATALOG_URL", raising=False)
    config = tmp_path / "ckptier.toml"
    config.write_text('[catalog]\nurl = "postgresql://u:pw@db/ckptier"\n')
    loc = catalog_location(None, config)
    assert (loc.url, loc.source) == ("postgresql://u:pw@db/ckptier", f"[catalog] url in {config}")
    assert str(loc) == f"postgresql://u:***@db/ckptier ([catalog] url in {config})"
    config.write_text("[catalog\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        catalog_location(None, config)  # a broken file that decides is an error, never silently skipped
    assert catalog_location("sqlite:////x.db", config).url == "sqlite:////x.db"  # ... unless it does not decide


@pytest.mark.parametrize(
    ("text", "jobs", "problem"),
    [
        (None, ["a"], "there is no ./ckptier.toml"),
        ("", ["a"], "has no [[policy]] with a retention rule"),
        ('[[policy]]\njobs = "*"\n', ["a"], "has no [[policy]] with a retention rule"),
        ('[[policy]]\njobs = "*"\ngrace = "1h"\narchive = "/tmp/a"\n', ["a"], "has no [[policy]] with a retention rule"),
        ('[[policy]]\njobs = "x-*"\nkeep_last = 2\n[[policy]]\njobs = "*"\n', ["x-1", "y"],
         "policy[1] (jobs = '*') in ckptier.toml sets no retention rule (job 'y')"),
        ('[[policy]]\njobs = "x-*"\nkeep_last = 2\n[[policy]]\njobs = "*"\n', ["x-1"], None),
        ('[[policy]]\njobs = "x-*"\nkeep_last = 2\n', ["y"], None),  # no policy matches: kept whole
        ('[[policy]]\njobs = "*"\nkeep_last = 3\n', ["a"], None),  # written, even though it equals the default
        ('[[policy]]\nmilestones = "log"\n', ["a"], None),
        ('[[policy]]\npinned = [5]\n', ["a"], None),
        ('[[policy]]\nkeep_within = "2d"\n', ["a"], None),
    ],
)
def test_apply_needs_a_written_policy(text: str | None, jobs: list[str], problem: str | None) -> None:
    if text is None:
        config = default_config()
    else:
        config = parse_config(text)
        config = type(config)(config.policies, config.drills, config.catalog_url, source=Path("ckptier.toml"),
                              unwritten=config.unwritten)
    got = unwritten_policy_problem(config, jobs)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got and "keep_last" in got and "\n" not in got
