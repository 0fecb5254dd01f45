"""A TCP proxy that delays every reply: a slow Redis, without touching Redis itself.

:class:`SlowProxy` listens on a free loopback port, forwards each client
connection to the target, passes requests on at once and holds every chunk of
the server's replies for ``delay_s`` (read when the chunk arrives, so lowering it
takes effect for the replies that follow). It runs on the caller's event loop.
:meth:`SlowProxy.lose_reply` makes it drop one reply and the connection it came on.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["SlowProxy"]

_CHUNK = 65536


class SlowProxy:
    """Forwards 127.0.0.1:``port`` to ``target_host``:``target_port``, replies ``delay_s`` late."""

    def __init__(self, target_host: str, target_port: int, *, delay_s: float = 0.0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.delay_s = delay_s
        self.connections = 0
        """Client connections accepted so far."""
        self.lost = 0
        """Replies dropped by :meth:`lose_reply` so far."""
        self.armed = 0
        """Requests that contained :meth:`lose_reply`'s ``sent`` since it was last called:
        a request sent before it does not lose its reply."""
        self._lose: tuple[bytes, bytes] | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port the proxy listens on (after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        """A redis:// URL that goes through the proxy."""
        return f"redis://127.0.0.1:{self.port}"

    def lose_reply(self, sent: bytes, reply: bytes) -> None:
        """Drop the next chunk of replies that contains ``reply`` on a connection whose
        requests contained ``sent``, and close that connection: the server ran the
        command, its answer never arrives (the network dropped it on the way back)."""
        self._lose = (sent, reply)
        self.armed = 0

    async def start(self) -> SlowProxy:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def aclose(self) -> None:
        """Stop listening and drop every connection."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if server is not None:
            await asyncio.wait_for(server.wait_closed(), 5)

    async def __aenter__(self) -> SlowProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        server_w: asyncio.StreamWriter | None = None
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
            sent: list[bytes] = []  # what this connection sent, as far as lose_reply asks
            up = asyncio.create_task(self._pipe(client_r, server_w, sent))
            down = asyncio.create_task(self._delayed_pipe(server_r, client_w, sent))
            try:
                await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (up, down):
                    t.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except OSError:
            pass  # the target is down: the client sees its connection closed
        finally:
            for w in (client_w, server_w):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 1)
            self._tasks.discard(task)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, sent: list[bytes]
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(_CHUNK):
                lose = self._lose
                if lose is not None and lose[0] in data:
                    self.armed += 1
                    if lose[0] not in sent:
                        sent.append(lose[0])
                dst.write(data)
                await dst.drain()

    def _loses(self, data: bytes, sent: list[bytes]) -> bool:
        """Whether ``data`` is the reply :meth:`lose_reply` asked to drop (then it is)."""
        lose = self._lose
        if lose is None or lose[0] not in sent or lose[1] not in data:
            return False
        self._lose = None
        self.lost += 1
        return True

    async def _delayed_pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, sent: list[bytes]
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await src.read(_CHUNK):
                    queue.put_nowait((loop.time() + self.delay_s, data))
            except OSError:
                pass
            finally:
                queue.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - loop.time()))
                if self._loses(data, sent):
                    return  # the connection closes with the reply unsent
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
