"""A checkpoint's copies in each tier: adding one and setting its state.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    insert,
    select,
    update,
)

from ..records import (
    CopyState,
    Tier,
)
from .tables import checkpoints as ck
from .tables import copies as cp
from .tables import events as ev
from .entries import UnknownCheckpoint
from .core import CatalogCore, _aware, _check_copy_state


class CatalogCopies(CatalogCore):
    """Copies of the catalog: :class:`~ckptier.storage.catalog.protocols.CopyCatalog`."""

    def add_copy(
        self,
        checkpoint_id: int,
        *,
        tier: Tier,
        url: str,
        state: CopyState = CopyState.PRESENT,
        stored_bytes: int | None,
        codec: str | None,
        manifest_key: str | None,
        verified_at: datetime | None,
        now: datetime,
        storage_class: str | None = None,
    ) -> None:
        """Insert or update (on ``(checkpoint_id, tier, url)``) a copy of a
        checkpoint. ``created_at`` is set on insert only. ``storage_class``:
        the S3 class its objects were confirmed in. Idempotent."""
        now = _aware(now)
        state = _check_copy_state(state)
        if verified_at is not None:
            verified_at = _aware(verified_at, "verified_at")
        values = {
            "state": state.value, "stored_bytes": stored_bytes, "codec": codec,
            "manifest_key": manifest_key, "verified_at": verified_at, "storage_class": storage_class,
        }
        stmt = self._insert(cp).values(
            checkpoint_id=checkpoint_id, tier=Tier(tier).value, url=url, created_at=now, **values
        )
        stmt = stmt.on_conflict_do_update(index_elements=["checkpoint_id", "tier", "url"], set_=values)
        with self._write() as conn:
            self._require(conn, checkpoint_id)
            conn.execute(stmt)

    def set_copy_state(self, checkpoint_id: int, *, tier: Tier, url: str, state: CopyState, now: datetime) -> None:
        """Set the state of an existing copy; raises :class:`UnknownCheckpoint`
        when there is no such copy. Logs an event when the state changes."""
        now = _aware(now)
        state = _check_copy_state(state)
        with self._write() as conn:
            row = conn.execute(
                select(cp.c.id, cp.c.state, ck.c.job_id, ck.c.step)
                .join(ck, ck.c.id == cp.c.checkpoint_id)
                .where(cp.c.checkpoint_id == checkpoint_id, cp.c.tier == Tier(tier).value, cp.c.url == url)
            ).first()
            if row is None:
                raise UnknownCheckpoint(
                    f"checkpoint {checkpoint_id} has no {Tier(tier).value} copy at {url}; add it with add_copy"
                )
            if row.state == state:
                return
            conn.execute(update(cp).where(cp.c.id == row.id).values(state=state.value))
            conn.execute(
                insert(ev).values(
                    at=now, kind="copy-" + state.value, job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: {Tier(tier).value} copy {url}: {row.state} -> {state.value}",
                    data={"tier": Tier(tier).value, "url": url, "from": row.state, "to": state.value},
                )
            )
