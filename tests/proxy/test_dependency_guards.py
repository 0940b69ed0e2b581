"""aiohttp's private names that proxy/http/listener.py relies on, checked on the installed aiohttp
(issue 24, §6). pyproject.toml bounds aiohttp below the next minor release; a failure here names
the private name that changed, so raising the bound is a decision, not an accident."""

from __future__ import annotations

import collections
import inspect
from importlib.metadata import version

import pytest
from aiohttp import web

AIOHTTP = version("aiohttp")


def guard(holds: bool, what: str) -> None:
    if not holds:
        pytest.fail(f"aiohttp {AIOHTTP} changed a private name proxy/http/listener.py relies on: "
                    f"{what}. Adapt proxy/http/listener.py (its _Handler, _Server, GuardedRunner) "
                    "and keep pyproject.toml's aiohttp bound below this version until it does.",
                    pytrace=False)


def test_the_request_handler_still_handles_each_request_through_handle_request() -> None:
    method = getattr(web.RequestHandler, "_handle_request", None)
    guard(method is not None, "RequestHandler._handle_request is gone")
    params = list(inspect.signature(method).parameters)
    guard(params == ["self", "request", "start_time", "request_handler"],
          f"RequestHandler._handle_request takes {params}, not "
          "(self, request, start_time, request_handler)")
    guard("self._handle_request(" in inspect.getsource(web.RequestHandler.start),
          "RequestHandler.start no longer calls self._handle_request")


async def test_a_request_handler_still_queues_parsed_heads_in_messages() -> None:
    server = web.Server(lambda request: web.Response())
    handler = server()
    guard(isinstance(getattr(handler, "_messages", None), collections.deque),
          "RequestHandler._messages is no longer the deque of parsed requests")
    guard(getattr(handler, "_loop", None) is not None, "RequestHandler._loop is gone")
    guard("self._messages.append(" in inspect.getsource(web.RequestHandler.data_received),
          "RequestHandler.data_received no longer appends parsed heads to _messages")


async def test_the_app_runner_still_builds_its_server_in_make_server_with_kwargs() -> None:
    guard(callable(getattr(web.AppRunner, "_make_server", None)), "AppRunner._make_server is gone")
    runner = web.AppRunner(web.Application(), keepalive_timeout=7.0, access_log=None)
    await runner.setup()
    try:
        server = runner.server
        assert server is not None
        kwargs = getattr(server, "_kwargs", None)
        guard(isinstance(kwargs, dict) and kwargs.get("keepalive_timeout") == 7.0,
              "Server._kwargs no longer holds the keyword arguments its handlers get")
        guard(getattr(server, "_loop", None) is not None, "Server._loop is gone")
        for name in ("request_handler", "request_factory", "handler_cancellation"):
            guard(hasattr(server, name), f"Server.{name} is gone")
        accepted = set(inspect.signature(web.Server.__init__).parameters)
        guard({"request_factory", "handler_cancellation", "loop"} <= accepted,
              f"Server() takes {sorted(accepted)}")
        guard(isinstance(server(), web.RequestHandler), "Server() no longer makes RequestHandlers")
    finally:
        await runner.cleanup()


def test_the_listener_overrides_what_it_means_to() -> None:
    """The names proxy/http/listener.py's subclasses override exist on aiohttp's classes (an
    override of a name aiohttp no longer has would silently never run)."""
    from stepguard.proxy.http import listener

    for base, names in ((web.RequestHandler, ("_handle_request", "connection_made",
                                              "connection_lost", "data_received",
                                              "pause_writing", "resume_writing")),
                        (web.AppRunner, ("_make_server",))):
        for name in names:
            guard(callable(getattr(base, name, None)), f"{base.__name__}.{name} is gone")
    guard(issubclass(listener._Handler, web.RequestHandler)
          and listener._Handler._handle_request.__code__.co_varnames[:4]
          == ("self", "request", "start_time", "request_handler"),
          "listener._Handler._handle_request no longer matches")
