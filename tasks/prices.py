"""What storage costs: prices per storage class, and the arithmetic on them.

Pure. ``[prices]`` in ``ckptier.toml`` (parsed in :mod:`.config`) overrides
any field of any class; every class and field not given keeps the built-in
default below, and every default is a **list-price assumption**:

* S3 classes: AWS's published list prices for US East (N. Virginia), first
  50 TB per month, from https://aws.amazon.com/s3/pricing/ as recorded for
  ckptier in January 2025 (not re-checked since; negotiated rates, other
  regions and volume tiers differ).
* ``hot`` (local/POSIX storage: the training job's hot directory, a local
  archive): Amazon FSx for Lustre, persistent SSD at 125 MB/s per TiB, US
  East (N. Virginia), from https://aws.amazon.com/fsx/lustre/pricing/,
  recorded January 2025, as a stand-in for a shared training filesystem.

Units: storage in dollars per GB-month, where a GB is 2^30 bytes and a month
730 hours (how AWS bills); requests in dollars per 1,000; retrieval in
dollars per GB read. Every figure computed from a default carries
:data:`LIST_PRICE_NOTE` so that nobody mistakes it for a quote.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ckptier.storage.errors import ConfigError

from .tiers import NEEDS_RESTORE

#: Bytes in a billed GB (AWS bills storage per 2^30 bytes).
BILLING_GB = 1 << 30
#: Hours in a billed month (AWS's convention).
HOURS_PER_MONTH = 730
#: Seconds in a billed month.
MONTH_SECONDS = HOURS_PER_MONTH * 3600

PRICES_RECORDED = "2025-01"
LIST_PRICE_NOTE = (
    f"list-price assumption: AWS US East (N. Virginia) list prices recorded {PRICES_RECORDED} "
    "(S3: aws.amazon.com/s3/pricing; hot = FSx for Lustre persistent SSD 125 MB/s/TiB: "
    "aws.amazon.com/fsx/lustre/pricing); set [prices] in ckptier.toml for yours"
)

FIELDS = ("storage", "put", "get", "retrieval", "restore", "min_days")


@dataclass(frozen=True)
class ClassPrice:
    """The price of one storage class.

    ``storage``: $ per GB-month. ``put``: $ per 1,000 PUT, COPY, POST or LIST
    requests into the class; lifecycle transitions into the class cost the
    same. ``get``: $ per 1,000 GET requests. ``retrieval``: $ per GB read
    back. ``restore``: $ per 1,000 restore requests (classes that need a
    restore before a GET). ``min_days``: minimum storage duration billed
    (an object deleted or moved earlier is billed the remaining days).
    ``source``: where the figures come from (:data:`LIST_PRICE_NOTE` for
    defaults); ``defaulted``: fields of a configured class left at their
    list-price default.
    """

    storage: float
    put: float = 0.0
    get: float = 0.0
    retrieval: float = 0.0
    restore: float = 0.0
    min_days: int = 0
    source: str = LIST_PRICE_NOTE
    defaulted: tuple[str, ...] = ()

    @property
    def assumed(self) -> bool:
        """True when any figure of this class is a list-price assumption."""
        return self.source == LIST_PRICE_NOTE or bool(self.defaulted)


#: ckptier's built-in prices (see the module docstring for their source and date).
DEFAULT_CLASS_PRICES: Mapping[str, ClassPrice] = MappingProxyType({
    "hot": ClassPrice(storage=0.145),
    "STANDARD": ClassPrice(storage=0.023, put=0.005, get=0.0004),
    "STANDARD_IA": ClassPrice(storage=0.0125, put=0.01, get=0.001, retrieval=0.01, min_days=30),
    "GLACIER_IR": ClassPrice(storage=0.004, put=0.02, get=0.01, retrieval=0.03, min_days=90),
    # Standard retrievals (3-5 hours); bulk ones are cheaper and slower.
    "GLACIER": ClassPrice(storage=0.0036, put=0.03, get=0.0004, retrieval=0.01, restore=0.05, min_days=90),
    "DEEP_ARCHIVE": ClassPrice(storage=0.00099, put=0.05, get=0.0004, retrieval=0.02, restore=0.10, min_days=180),
})


@dataclass(frozen=True)
class Prices:
    """Prices per storage class (keys of :data:`~.tiers.ALL_CLASSES`).

    ``currency`` labels the figures; it converts nothing.
    """

    classes: Mapping[str, ClassPrice] = field(default_factory=lambda: DEFAULT_CLASS_PRICES)
    currency: str = "USD"

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.classes.items())), self.currency))

    def of(self, storage_class: str) -> ClassPrice:
        """The price of ``storage_class``; raises :class:`ConfigError` naming the
        missing ``[prices]`` table when there is none."""
        try:
            return self.classes[storage_class]
        except KeyError:
            raise ConfigError(
                f"no price for storage class {storage_class!r}: add [prices.{storage_class}] "
                f"with storage = <$ per GB-month> to ckptier.toml"
            ) from None

    def monthly(self, nbytes: float, storage_class: str) -> float:
        """Storage cost of ``nbytes`` held for one month in ``storage_class``."""
        return nbytes / BILLING_GB * self.of(storage_class).storage

    def puts(self, requests: float, storage_class: str) -> float:
        """Cost of ``requests`` PUT-class requests (or lifecycle transitions) into ``storage_class``."""
        return requests / 1000 * self.of(storage_class).put

    def read_back(self, nbytes: float, objects: int, storage_class: str) -> float:
        """Cost of reading ``nbytes`` in ``objects`` objects back out of
        ``storage_class``: retrieval per GB, GET requests, and restore
        requests for classes that need them (:data:`~.tiers.NEEDS_RESTORE`)."""
        p = self.of(storage_class)
        restore = objects / 1000 * p.restore if storage_class in NEEDS_RESTORE else 0.0
        return nbytes / BILLING_GB * p.retrieval + objects / 1000 * p.get + restore

    def note(self, used: Iterable[str]) -> str:
        """Where the prices of the ``used`` classes come from, one line: the
        configured sources, then :data:`LIST_PRICE_NOTE` whenever any figure
        of them is a default (naming the defaulted fields of configured classes)."""
        ps = {c: self.of(c) for c in sorted(set(used))}
        parts = sorted({p.source for p in ps.values() if p.source != LIST_PRICE_NOTE})
        partial = [f"{c} {', '.join(p.defaulted)}" for c, p in ps.items() if p.source != LIST_PRICE_NOTE and p.defaulted]
        if any(p.assumed for p in ps.values()):
            parts.append(LIST_PRICE_NOTE + (f" (also for {'; '.join(partial)})" if partial else ""))
        return "; ".join(parts) or "no prices used"

    def assumed(self, used: Iterable[str]) -> bool:
        """True when any of the ``used`` classes is priced by a list-price assumption."""
        return any(self.of(c).assumed for c in used)


DEFAULT_PRICES = Prices()


def requests_for(nbytes: int, objects: int, part_size: int) -> int:
    """PUT-class requests to upload ``nbytes`` in ``objects`` objects with
    multipart parts of ``part_size`` bytes (each part is one request; objects
    of one part or less take one PUT). An estimate: it spreads bytes evenly."""
    if objects <= 0 or nbytes <= 0:
        return max(objects, 0)
    per_object = nbytes / objects
    parts = 1 if per_object <= part_size else math.ceil(per_object / part_size) + 2  # + create and complete
    return objects * parts
