"""The two factories that open a store from its location, the writable store (`make_store`) and
the read-only reader of its recorded runs (`recorded_store`), refuse a location alike: one that
no store can have, and a PostgreSQL URL whose driver (the `postgres` extra) is not installed.
Neither message shows the URL's password."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from stepguard.contracts.errors import StoreError
from stepguard.contracts.recorded_stores import recorded_store
from stepguard.contracts.stores import make_store

FACTORIES: dict[str, Callable[[str], Any]] = {"make_store": make_store,
                                              "recorded_store": recorded_store}
URL = "postgresql://admin:hunter2@127.0.0.1:5432/runs"


@pytest.mark.parametrize("factory", FACTORIES)
def test_a_location_no_store_can_have_is_refused_without_its_password(factory: str) -> None:
    with pytest.raises(StoreError) as caught:
        FACTORIES[factory]("mysql://admin:hunter2@db/runs")
    assert str(caught.value).startswith("store mysql://admin:***@db/runs: a store URL of "
                                        "scheme 'mysql'")
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(("factory", "driver"), [("make_store", "stepguard.contracts.pg_store"),
                                                 ("recorded_store",
                                                  "stepguard.contracts.pg_recorded")])
def test_a_postgresql_store_without_its_driver_says_how_to_install_it(
        factory: str, driver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, driver, None)     # its import fails, as with no asyncpg
    with pytest.raises(StoreError) as caught:
        FACTORIES[factory](URL)
    message = str(caught.value)
    assert message.startswith("store postgresql://admin:***@127.0.0.1:5432/runs: PostgreSQL "
                              "needs its driver (")
    assert message.endswith("pip install -e '.[postgres]' in stepguard's clone")
    assert "hunter2" not in message
