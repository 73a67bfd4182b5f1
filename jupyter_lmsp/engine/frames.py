"""Reading the worker's messages off the pipe in large reads (issue 42).

`multiprocessing.Connection.recv` reads each message with two system calls (its 4-byte length,
then its bytes), one message at a time: for a small model, whose worker sends a message per
decode step, hundreds a second, those reads were most of the engine reader thread's CPU.
`FrameReader` reads whatever the pipe holds (up to `CHUNK` bytes) in one call and cuts it into
the same frames `Connection.send_bytes` writes: a signed 4-byte big-endian length, or -1 and an
8-byte length for a message over 2 GiB, then the pickled message. Messages that piled up while
the reader was busy come out of one read.

`read` blocks (the reader thread's); `read_ready` takes only what is there, without blocking
and without changing the pipe's mode, which its writer shares (an event loop's reader).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct

# One read's most bytes, into a buffer kept for every read: `os.read(fd, n)` allocates n bytes
# each call, and at 1 MiB that was an mmap and munmap per message (the reader's CPU per token
# went up by a third).
CHUNK = 1 << 16
_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


class Unreadable(Exception):
    """One frame whose message could not be unpickled (the frames after it are read on)."""


class FrameReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()
        self._chunk = bytearray(CHUNK)
        self._view = memoryview(self._chunk)
        self._socket: socket.socket | None = None

    def read(self) -> list[object | Unreadable]:
        """The next messages, in order, at least one: each frame complete in what was read so
        far (an `Unreadable` in place of one that does not unpickle). Blocks until a frame is
        complete; EOFError when the pipe closes."""
        while True:
            messages = self._frames()
            if messages:
                return messages
            n = os.readv(self.fd, [self._chunk])
            if not n:
                raise EOFError
            self._buffer += self._view[:n]

    def read_ready(self) -> list[object | Unreadable]:
        """The messages complete in what the pipe holds now, in order (maybe none), without
        waiting: reads with `MSG_DONTWAIT` (the worker's pipe is a socket pair) until nothing
        is left. EOFError when the pipe is closed and nothing is left to read."""
        if self._socket is None:
            # A socket of our own on a copy of the descriptor: closing it leaves the pipe's.
            self._socket = socket.socket(fileno=os.dup(self.fd))
        while True:
            try:
                n = self._socket.recv_into(self._chunk, CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return self._frames()
            if not n:
                messages = self._frames()
                if messages:
                    return messages  # EOF again on the next call, with nothing left
                raise EOFError
            self._buffer += self._view[:n]
            if n < CHUNK:
                return self._frames()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _frames(self) -> list[object | Unreadable]:
        buffer = self._buffer
        messages: list[object | Unreadable] = []
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, start)
            head = _LENGTH.size
            if size == -1:
                if len(buffer) - start < head + _LONG_LENGTH.size:
                    break
                (size,) = _LONG_LENGTH.unpack_from(buffer, start + head)
                head += _LONG_LENGTH.size
            end = start + head + size
            if len(buffer) < end:
                break
            try:
                messages.append(pickle.loads(buffer[start + head : end]))
            except Exception as exc:
                messages.append(Unreadable(str(exc)))
            start = end
        if start:
            del buffer[:start]
        return messages
