"""The catalog dashboard and ``ckptier report``.

What operators look at: every job's checkpoints by state, proof and tier,
bytes per tier, verification and drill coverage, the recovery point, and
alerts; per job a step chart, storage over time, the retention plan, drill
and verification history; per checkpoint its files, copies and the exact
``ckptier fetch`` command.

Layout:

* :mod:`.source` opens an existing catalog (never creates one);
* :mod:`.queries` holds this package's own SQL (aggregates, read only);
* :mod:`.tables` computes every table once, with pandas, from those queries
  and the catalog's public reads (:meth:`Catalog.drills`, events, records);
  the web pages, their CSV/JSON downloads and ``ckptier report`` all use it;
* :mod:`.history` (storage over time) and :mod:`.alerts` are pure functions;
* :mod:`.charts` draws inline SVG on the server (no JavaScript, no CDN);
* :mod:`.security` binds, tokens, CSRF and credential redaction;
* :mod:`.prefect_api` starts the ``restore-drill`` deployment over REST;
* :mod:`.app` is the FastAPI application, :mod:`.cli` the two commands.

Imports ``ckptier.storage`` and ``ckptier.tasks`` only (never ``flows`` or
``deployments``).
"""
