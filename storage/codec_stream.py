"""The ckz1 encoder as a readable stream: an archive produced while a store reads it.

A store's ``write(key, stream)`` pulls bytes from a stream until EOF, while
:func:`~.codec.encode` pushes its output into a sink. :class:`EncodingReader`
joins the two without a spool file: :func:`~.codec.encode` runs on a thread
of its own and every block it emits is handed straight to the reader
(rendezvous: the encoder waits until the reader has taken a block before it
emits the next, so nothing is buffered here beyond the encoder's own
bounded pool). The reader sees EOF only after the encoder has finished and
``before_eof`` (if given) has accepted the result: a store that commits
on EOF (a temporary file renamed into place, a multipart upload completed)
therefore commits only a whole archive that passed that check, and an
encoder failure or a refusal reaches the store as the exception of its
``read``, so that it discards what it wrote.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from . import codec


class ReaderClosed(Exception):
    """The reader of an :class:`EncodingReader` was closed before the archive was complete."""


class EncodingReader(io.RawIOBase):
    """Read the ckz1 archive of ``src`` as it is encoded (see the module docstring).

    ``name``, ``level``, ``threads`` and ``block_size`` are
    :func:`~.codec.encode`'s. ``before_eof(stats)`` runs on the encoder's
    thread once the archive is complete, before the reader may see EOF;
    what it raises is raised by the reader's next read instead. After EOF,
    :attr:`stats` holds the encoder's :class:`~.codec.CodecStats`.
    :meth:`close` (or leaving the ``with`` block) stops an unfinished
    encoder and waits for its thread; it never raises the encoder's error.
    Reads must come from one thread at a time.
    """

    def __init__(
        self,
        src: BinaryIO,
        *,
        name: str = "",
        level: int = 1,
        threads: int = 2,
        block_size: int = codec.BLOCK_SIZE,
        before_eof: Callable[[codec.CodecStats], None] | None = None,
    ) -> None:
        super().__init__()
        self._cond = threading.Condition()
        self._piece: memoryview | None = None  # the block the encoder is handing over
        self._at = 0  # bytes of it already read
        self._done = False  # the encoder returned (or failed)
        self._error: BaseException | None = None
        self._cancelled = False
        self.stats: codec.CodecStats | None = None
        self._thread = threading.Thread(
            target=self._encode, args=(src, name, level, threads, block_size, before_eof),
            name="ckz-encode-stream", daemon=True,
        )
        self._thread.start()

    # -- the encoder's side ------------------------------------------------------

    def _encode(self, src: BinaryIO, name: str, level: int, threads: int, block_size: int,
                before_eof: Callable[[codec.CodecStats], None] | None) -> None:
        error: BaseException | None = None
        stats = None
        try:
            stats = codec.encode(src, _Handover(self), name=name, level=level, threads=threads,  # type: ignore[arg-type]
                                 block_size=block_size)
            if before_eof is not None:
                before_eof(stats)
        except BaseException as exc:  # handed to the reader, which raises it
            error = exc
        with self._cond:
            self.stats = stats
            self._error = error
            self._done = True
            self._cond.notify_all()

    def _hand_over(self, data: Any) -> int:
        """Block until the reader has taken all of ``data`` (or is gone: :class:`ReaderClosed`)."""
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return 0
        with self._cond:
            if self._cancelled:
                raise ReaderClosed("the archive's reader was closed")
            self._piece, self._at = view, 0
            self._cond.notify_all()
            while self._piece is not None and not self._cancelled:
                self._cond.wait()
            if self._piece is not None:
                self._piece = None
                raise ReaderClosed("the archive's reader was closed")
        return view.nbytes

    # -- the reader's side -------------------------------------------------------

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        with self._cond:
            piece = self._wait_for_piece()
            if piece is None:
                return 0
            n = min(out.nbytes, piece.nbytes - self._at)
            out[:n] = piece[self._at : self._at + n]
            self._took(n)
        return n

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes (all that remain with ``size < 0``); ``b""`` only at EOF."""
        if size is None or size < 0:
            return self.readall()
        with self._cond:
            piece = self._wait_for_piece()
            if piece is None:
                return b""
            n = min(size, piece.nbytes - self._at)
            data = bytes(piece[self._at : self._at + n])
            self._took(n)
        return data

    def readall(self) -> bytes:
        parts = []
        while chunk := self.read(1 << 20):
            parts.append(chunk)
        return b"".join(parts)

    def _wait_for_piece(self) -> memoryview | None:
        """The block being handed over, or None at EOF; raises the encoder's error (holding the lock)."""
        if self._cancelled:
            raise ValueError("read of a closed EncodingReader")
        while self._piece is None and not self._done:
            self._cond.wait()
        if self._piece is not None:
            return self._piece
        if self._error is not None:
            raise self._error
        return None

    def _took(self, n: int) -> None:
        self._at += n
        if self._piece is not None and self._at >= self._piece.nbytes:
            self._piece = None
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the encoder if it is still running and wait for its thread."""
        if self.closed:
            return
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        self._thread.join()
        super().close()


class _Handover:
    """The sink the encoder writes to: each write waits until the reader has taken it."""

    def __init__(self, reader: EncodingReader) -> None:
        self._reader = reader

    def write(self, data: Any) -> int:
        return self._reader._hand_over(data)
