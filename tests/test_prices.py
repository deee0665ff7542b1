"""Prices (``[prices]``), archive tiers by age (``archive_tiers``) and their arithmetic."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import load_config, parse_config, parse_prices
from ckptier.tasks.prices import (
    BILLING_GB,
    DEFAULT_CLASS_PRICES,
    DEFAULT_PRICES,
    LIST_PRICE_NOTE,
    Prices,
    requests_for,
)
from ckptier.tasks.tiers import (
    ALL_CLASSES,
    ArchiveTier,
    archive_tiers_problem,
    class_at,
    lifecycle_problem,
)

D = timedelta(days=1)


# ------------------------------------------------------------------ defaults


def test_every_default_class_is_priced_and_labelled_as_an_assumption() -> None:
    for cls in ("hot", "STANDARD", "STANDARD_IA", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE"):
        p = DEFAULT_PRICES.of(cls)
        assert p.storage > 0 and p.assumed and p.source == LIST_PRICE_NOTE
    assert "list-price assumption" in LIST_PRICE_NOTE and "2025-01" in LIST_PRICE_NOTE
    # colder classes are cheaper to keep and dearer to read
    order = ["STANDARD", "STANDARD_IA", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE"]
    storage = [DEFAULT_PRICES.of(c).storage for c in order]
    assert storage == sorted(storage, reverse=True)
    assert DEFAULT_PRICES.of("STANDARD").retrieval == 0 < DEFAULT_PRICES.of("GLACIER_IR").retrieval


def test_arithmetic_in_billed_gb_and_months() -> None:
    assert DEFAULT_PRICES.monthly(BILLING_GB, "STANDARD") == pytest.approx(0.023)
    assert DEFAULT_PRICES.monthly(100 * BILLING_GB, "GLACIER_IR") == pytest.approx(0.4)
    assert DEFAULT_PRICES.puts(2000, "GLACIER_IR") == pytest.approx(0.04)
    # GLACIER_IR: retrieval per GB plus GETs; GLACIER adds restore requests
    assert DEFAULT_PRICES.read_back(10 * BILLING_GB, 1000, "GLACIER_IR") == pytest.approx(0.3 + 0.01)
    assert DEFAULT_PRICES.read_back(10 * BILLING_GB, 1000, "GLACIER") == pytest.approx(0.1 + 0.0004 + 0.05)
    assert DEFAULT_PRICES.read_back(BILLING_GB, 1, "hot") == 0


def test_requests_for_multipart_saves() -> None:
    assert requests_for(1000, 4, 8 << 20) == 4  # small objects: one PUT each
    # 1 GiB in one object with 8 MiB parts: 128 parts + create + complete
    assert requests_for(1 << 30, 1, 8 << 20) == 130
    assert requests_for(0, 3, 8 << 20) == 3


def test_unknown_class_names_the_table_to_add() -> None:
    with pytest.raises(ConfigError, match=r"no price for storage class 'ONEZONE_IA': add \[prices.ONEZONE_IA\]"):
        DEFAULT_PRICES.monthly(1, "ONEZONE_IA")


# ------------------------------------------------------------------ [prices]


def test_prices_table_overrides_fields_and_labels_them(tmp_path: Path) -> None:
    f = tmp_path / "ckptier.toml"
    f.write_text(
        """
[prices]
source = "our negotiated rates, 2026-10"
currency = "EUR"
hot = 0.08
ONEZONE_IA = 0.01
[prices.GLACIER_IR]
storage = 0.0035
retrieval = 0.02
"""
    )
    prices = load_config(f).prices  # load_config keeps what parse_config built
    assert prices.currency == "EUR"
    assert prices.of("hot").storage == 0.08 and prices.of("hot").source == "our negotiated rates, 2026-10"
    gir = prices.of("GLACIER_IR")
    assert (gir.storage, gir.retrieval) == (0.0035, 0.02)
    assert gir.put == DEFAULT_CLASS_PRICES["GLACIER_IR"].put  # unset fields keep the defaults ...
    assert gir.defaulted == ("put", "get", "min_days") and gir.assumed  # ... and say so
    assert gir.source == "our negotiated rates, 2026-10"
    assert prices.note(["GLACIER_IR"]) == (
        f"our negotiated rates, 2026-10; {LIST_PRICE_NOTE} (also for GLACIER_IR put, get, min_days)"
    )
    assert prices.of("ONEZONE_IA").storage == 0.01 and not prices.of("ONEZONE_IA").assumed
    assert prices.of("STANDARD") == DEFAULT_CLASS_PRICES["STANDARD"]
    assert not prices.assumed(["hot", "ONEZONE_IA"]) and prices.note(["hot"]) == "our negotiated rates, 2026-10"
    assert parse_prices({"EXPRESS_ONEZONE": 0.11}).of("EXPRESS_ONEZONE").storage == 0.11  # any S3 class can be priced
    assert prices.assumed(["hot", "STANDARD"])
    assert prices.note(["hot", "STANDARD"]) == f"our negotiated rates, 2026-10; {LIST_PRICE_NOTE}"
    assert DEFAULT_PRICES.note(["hot", "GLACIER_IR"]) == LIST_PRICE_NOTE


def test_no_prices_table_means_the_defaults() -> None:
    assert parse_config("").prices is DEFAULT_PRICES
    assert parse_prices(None) is DEFAULT_PRICES
    assert parse_prices({}, where="x.toml").of("hot").assumed


@pytest.mark.parametrize(
    "text, message",
    [
        ("prices = 3", r"prices must be a table"),
        ("[prices]\nGLACIER_INSTANT = 0.004", r"prices.GLACIER_INSTANT = 0.004: unknown key; did you mean GLACIER_IR\?"),
        ("[prices]\nhot = -1", r"prices.hot = -1: must be a price ≥ 0"),
        ("[prices]\nhot = \"cheap\"", r"prices.hot = \"cheap\": must be a price ≥ 0"),
        ("[prices]\nhot = nan", r"prices.hot = nan: must be a price ≥ 0"),
        ("[prices.STANDARD]\nstorage = true", r"prices.STANDARD.storage = true: must be a price"),
        ("[prices.STANDARD]\nstorag = 0.02", r"prices.STANDARD.storag = 0.02: unknown key; did you mean storage\?"),
        ("[prices.STANDARD_IA]\nmin_days = 1.5", r"prices.STANDARD_IA.min_days = 1.5: must be a whole number"),
        ("[prices.ONEZONE_IA]\nput = 0.01", r"prices.ONEZONE_IA has no built-in price: give its storage price"),
        ("[prices]\nsource = 3", r"prices.source = 3: must be a non-empty string"),
    ],
)
def test_prices_errors_are_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(text, where="ckptier.toml")
    assert "\n" not in str(info.value) and str(info.value).startswith("ckptier.toml: ")


# ------------------------------------------------------------------ archive_tiers


def test_archive_tiers_parse_into_the_policy() -> None:
    cfg = parse_config(
        """
[[policy]]
milestones = "log"
archive = "s3://cold/ckpt"
archive_tiers = [{ after = "14d", storage_class = "STANDARD_IA" }, { after = "90d", storage_class = "GLACIER_IR" }]
"""
    )
    assert cfg.policies[0].archive_tiers == (ArchiveTier(14 * D, "STANDARD_IA"), ArchiveTier(90 * D, "GLACIER_IR"))
    assert str(cfg.policies[0].archive_tiers[1]) == "GLACIER_IR after 90d"
    assert parse_config("[[policy]]\nkeep_last = 2").policies[0].archive_tiers == ()


@pytest.mark.parametrize(
    "extra, message",
    [
        ('archive_tiers = [{ after = "30d", storage_class = "GLACIER_IR" }]', r"has no effect without archive"),
        ('archive = "/mnt/cold"\narchive_tiers = [{ after = "30d", storage_class = "GLACIER_IR" }]',
         r"storage classes need an S3 archive"),
        ('archive = "s3://cold/a"\narchive_tiers = []', r"must be a non-empty list"),
        ('archive = "s3://cold/a"\narchive_tiers = [{ after = "30d" }]', r"entry 0 must have exactly the keys after and storage_class"),
        ('archive = "s3://cold/a"\narchive_tiers = [{ after = "36h", storage_class = "GLACIER_IR" }]',
         r"entry 0: after = \"36h\" must be a whole number of days"),
        ('archive = "s3://cold/a"\narchive_tiers = [{ after = "soon", storage_class = "GLACIER_IR" }]', r"whole number of days"),
        ('archive = "s3://cold/a"\narchive_tiers = [{ after = "30d", storage_class = "STANDARD" }]',
         r"entry 0: storage_class = \"STANDARD\" must be one of STANDARD_IA"),
        ('archive = "s3://cold/a"\narchive_tiers = [{ after = "90d", storage_class = "GLACIER" }, { after = "30d", storage_class = "DEEP_ARCHIVE" }]',
         r"entry 1 \(DEEP_ARCHIVE after 30d\) must come later"),
        ('archive = "s3://cold/a"\narchive_tiers = [{ after = "30d", storage_class = "GLACIER_IR" }, { after = "90d", storage_class = "STANDARD_IA" }]',
         r"entry 1 \(STANDARD_IA after 90d\) must move to a colder class than GLACIER_IR"),
        ('archive = "s3://cold/a"\nstorage_class = "GLACIER_IR"\narchive_tiers = [{ after = "30d", storage_class = "STANDARD_IA" }]',
         r"must move to a colder class than GLACIER_IR"),
    ],
)
def test_archive_tiers_errors_are_one_line(extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(f"[[policy]]\nmilestones = \"log\"\n{extra}\n", where="ckptier.toml")
    assert "\n" not in str(info.value) and "policy[0].archive_tiers" in str(info.value)


def test_class_at_follows_the_tiers_by_age() -> None:
    tiers = (ArchiveTier(30 * D, "STANDARD_IA"), ArchiveTier(90 * D, "GLACIER_IR"))
    assert class_at(timedelta(0), None, tiers) == "STANDARD"
    assert class_at(29 * D, "STANDARD", tiers) == "STANDARD"
    assert class_at(30 * D, None, tiers) == "STANDARD_IA"
    assert class_at(400 * D, None, tiers) == "GLACIER_IR"
    assert class_at(400 * D, "GLACIER_IR", ()) == "GLACIER_IR"


def test_lifecycle_limits_are_separate_from_the_config_rules() -> None:
    early_ia = (ArchiveTier(14 * D, "STANDARD_IA"), ArchiveTier(90 * D, "GLACIER_IR"))
    assert archive_tiers_problem(early_ia, None) is None  # a valid policy ...
    problem = lifecycle_problem(early_ia)  # ... that S3's lifecycle cannot carry out
    assert problem is not None and "before 30 days" in problem and 'after = "30d"' in problem
    short_stay = (ArchiveTier(30 * D, "STANDARD_IA"), ArchiveTier(45 * D, "GLACIER_IR"))
    assert "set the second after ≥ \"60d\"" in (lifecycle_problem(short_stay) or "")
    assert lifecycle_problem((ArchiveTier(30 * D, "STANDARD_IA"), ArchiveTier(60 * D, "GLACIER_IR"))) is None
    assert lifecycle_problem((ArchiveTier(1 * D, "GLACIER_IR"),)) is None


def test_archive_tier_itself_refuses_nonsense() -> None:
    with pytest.raises(ConfigError, match="whole number of days"):
        ArchiveTier(timedelta(hours=1), "GLACIER_IR")
    with pytest.raises(ConfigError, match="must be one of"):
        ArchiveTier(D, "hot")
    assert set(ALL_CLASSES) >= set(DEFAULT_CLASS_PRICES)


def test_prices_hash_and_equality() -> None:
    assert Prices() == DEFAULT_PRICES and hash(Prices()) == hash(DEFAULT_PRICES)
