"""Keeps an engine serving for one ``LLM``: each life of the engine (``Engine``: its processes,
the client's sockets to its scheduler, the thread that receives from it) and, when one dies,
the restart of a fresh one (``EngineSupervisor``). It does not know requests: on a death it
hands the client the reason, and the client fails its requests in flight.

When an engine process dies, every request in flight ends at once with ``EngineDeadError``
(the server's 503). With ``restart_on_failure`` (the server's default) a fresh engine then
starts in the background, with new processes, shared memory and sockets, while new requests
get ``EngineRestartingError``; deaths in a crash loop (``envs.crash_loop()``: 3 within 60 s)
stop the restarts and leave the LLM dead, for a supervisor to act.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
import time
import weakref
from typing import Callable

import zmq

from guidespec import envs
from guidespec.config import EngineConfig
from guidespec.ipc.zmq_channel import Channel
from guidespec.launch.launcher import EngineProcesses
from guidespec.protocol import EngineDead, EngineReady, Shutdown

logger = logging.getLogger(__name__)
RESTART_GRACE_S = 0.5  # a dead engine's other processes get this long to exit before SIGKILL


class EngineDeadError(RuntimeError):
    """The engine's processes are gone: a request in flight when it died, or a new one."""


class EngineRestartingError(EngineDeadError):
    """The engine died and a fresh one is starting: retry in a few seconds."""


class EngineSupervisor:
    """The live engine of one ``LLM``, and its replacement after a death. ``state_lock`` guards
    the states below and, held by the client, its requests in flight: they change together.

    ``fail_in_flight(message)`` is called under that lock when the engine dies: the client ends
    each request in flight with ``message``. ``give_up(reason)`` is called (once) when the engine
    died for good."""

    def __init__(
        self,
        config: EngineConfig,
        restart_on_failure: bool,
        route: Callable[[object], None],
        fail_in_flight: Callable[[str], None],
        give_up: Callable[[str], None],
    ) -> None:
        self.config = config
        self.restart_on_failure = restart_on_failure
        self.route = route
        self.fail_in_flight = fail_in_flight
        self.give_up = give_up
        self.num_restarts = 0  # fresh engines started after a death
        self.engine: Engine | None = None  # the one serving (None until the first has started)
        self.state_lock = threading.Lock()
        self.dead_reason: str | None = None  # set for good: closed, or a crash loop
        self.restarting: str | None = None  # why the engine is restarting
        self.closed = False
        self._deaths: collections.deque[float] = collections.deque()
        # restarts run on one thread that lives as long as the LLM: the engine processes die with
        # the thread that started them (PR_SET_PDEATHSIG), so it must outlive them
        self._restarter: threading.Thread | None = None
        self._restart_queue: queue.Queue[Engine | None] = queue.Queue()
        self._ctx = zmq.Context()
        self._current: list[Engine] = []  # the live engine (a list, so the finalizer sees restarts)
        self._finalizer = weakref.finalize(self, _close_engines, self._current)
        atexit.register(self._finalizer)

    def start(self) -> None:
        """Start the first engine; raises (``EngineDeadError``) if it does not come up."""
        self.engine = self._start_engine()

    @property
    def is_healthy(self) -> bool:
        """Serving now: not closed, not dead, not restarting."""
        return not self.closed and self.dead_reason is None and self.restarting is None

    @property
    def gave_up(self) -> bool:
        """The engine died and will not be restarted (restarts off, or a crash loop)."""
        return not self.closed and self.dead_reason is not None

    def check_alive(self) -> None:
        if self.closed:
            raise EngineDeadError("this LLM is closed")
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        if self.restarting is not None:
            raise EngineRestartingError(f"the engine is restarting after a failure ({self.restarting}): retry shortly")

    def close(self) -> None:
        with self.state_lock:
            if self.closed:
                return
            self.closed = True
        restarter = self._restarter
        if restarter is not None:  # it closes the engine it was starting when it sees closed
            self._restart_queue.put(None)
            restarter.join(timeout=envs.worker_start_timeout_s())
        self._finalizer()
        atexit.unregister(self._finalizer)
        self._ctx.term()

    # ------------------------------------------------------------------ failure and restart

    def _start_engine(self) -> Engine:
        engine = Engine(self.config, self._ctx, self._on_engine_death, self.route)
        self._current[:] = [engine]
        try:
            engine.start()
        except BaseException:
            engine.close(RESTART_GRACE_S)
            self._current.clear()
            raise
        return engine

    def _on_engine_death(self, engine: Engine, reason: str) -> None:
        """An engine process died (the launcher's monitor) or the scheduler said so: fail every
        request in flight now, then restart or give up."""
        with self.state_lock:
            # an engine still starting (the first, or a restart) is not this: its start fails instead
            if engine is not self.engine or self.closed or self.dead_reason or self.restarting:
                return
            logger.error("the engine died: %s", reason)
            gave_up = self._record_death(reason)
            message = f"the engine died ({reason}); " + (
                "it is restarting: retry shortly" if not gave_up else "it will not be restarted"
            )
            # under the lock: a stream that then sees the engine down finds its own error queued
            self.fail_in_flight(message)
            if not gave_up:
                self.restarting = reason
                if self._restarter is None:
                    self._restarter = threading.Thread(target=self._restart_loop, daemon=True, name="guidespec-restart")
                    self._restarter.start()
        if gave_up:
            engine.close(RESTART_GRACE_S)
            self.give_up(self.dead_reason or reason)
        else:
            self._restart_queue.put(engine)

    def _record_death(self, reason: str) -> bool:
        """Count a death (under the state lock); True if the LLM now gives up (no restart wanted,
        or a crash loop), with ``dead_reason`` set."""
        now = time.monotonic()
        max_deaths, window_s = envs.crash_loop()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > window_s:
            self._deaths.popleft()
        if not self.restart_on_failure:
            self.dead_reason = reason
        elif len(self._deaths) >= max_deaths:
            self.dead_reason = (
                f"{reason} (a crash loop: {len(self._deaths)} engine deaths within {window_s:g} s; not restarting)"
            )
        return self.dead_reason is not None

    def _restart_loop(self) -> None:
        while (dead := self._restart_queue.get()) is not None:
            self._restart(dead)
        self._finalizer()  # the LLM closed: the engines this thread started stop before it ends

    def _restart(self, dead: Engine) -> None:
        """The restart thread: the dead engine's processes and shared resources gone, a fresh one up."""
        dead.close(RESTART_GRACE_S)
        while not self.closed:
            start = time.monotonic()
            try:
                engine = self._start_engine()
            except Exception as e:
                logger.exception("a fresh engine failed to start")
                with self.state_lock:
                    gave_up = self._record_death(f"the restarted engine failed to start: {e}")
                if gave_up:
                    self.restarting = None
                    self.give_up(self.dead_reason or str(e))
                    return
                continue
            with self.state_lock:
                if not self.closed:
                    self.engine, self.restarting = engine, None
                    self.num_restarts += 1
                    logger.warning(
                        "a fresh engine is serving (restart %d took %.1f s)",
                        self.num_restarts,
                        time.monotonic() - start,
                    )
                    return
            engine.close()  # closed while starting
            return


class Engine:
    """One life of the engine: its processes and the client's two sockets to its scheduler, with
    the thread that receives from it. ``EngineSupervisor`` replaces it with a fresh one after a death."""

    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.Context,
        on_death: Callable[[Engine, str], None],
        route: Callable[[object], None],
    ) -> None:
        self.on_death = on_death
        self.route = route
        self.processes = EngineProcesses(config, on_death=lambda reason: on_death(self, reason))
        self.from_scheduler = Channel(ctx, zmq.PULL, self.processes.endpoints.client_out, bind=True)
        self.to_scheduler = Channel(ctx, zmq.PUSH, self.processes.endpoints.client_in, bind=False)
        self.send_lock = threading.Lock()
        self.closed = False
        self.receiver: threading.Thread | None = None
        self.ready: EngineReady | None = None  # what the scheduler said once every process was up

    def start(self) -> None:
        self.processes.start()
        self._wait_ready()
        self.receiver = threading.Thread(target=self._receive_loop, name="guidespec-receiver", daemon=True)
        self.receiver.start()

    def send(self, message: object) -> None:
        with self.send_lock:
            if not self.closed:
                self.to_scheduler.send(message)

    def close(self, grace_s: float = 3.0) -> None:
        """Stop every process (asked, then killed after ``grace_s``) and remove every shared resource."""
        with self.send_lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.to_scheduler.send(Shutdown("client closed"))
            except Exception:
                pass
            self.to_scheduler.close()
        self.processes.shutdown(grace_s)
        if self.receiver is not None and self.receiver is not threading.current_thread():
            self.receiver.join(timeout=2.0)
        self.from_scheduler.close()

    def _receive_loop(self) -> None:
        while not self.closed:
            try:
                message = self.from_scheduler.recv(timeout_s=0.1)
            except zmq.ZMQError:
                return
            if isinstance(message, EngineDead):
                self.on_death(self, message.reason)
            elif message is not None:
                self.route(message)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + envs.worker_start_timeout_s()
        while time.monotonic() < deadline:
            message = self.from_scheduler.recv(timeout_s=0.2)
            if isinstance(message, EngineReady):
                self.ready = message
                return
            if isinstance(message, EngineDead):
                raise EngineDeadError(f"the engine failed to start: {message.reason}")
            dead = self.processes.first_dead()
            if dead is not None:
                raise EngineDeadError(f"the engine failed to start: {dead}")
        raise EngineDeadError(f"the engine did not start within {envs.worker_start_timeout_s():.0f} s")


def _close_engines(current: list[Engine]) -> None:
    for engine in current:
        engine.close()
