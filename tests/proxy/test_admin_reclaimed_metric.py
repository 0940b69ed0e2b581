"""The admin listener's reclaimed connections are exported (`stepguard_connections_reclaimed_total`,
label `listener`): an operator sees that silent connections took its slots. Against a real
`stepguard serve` (the fixtures of test_admin_listener_flood)."""

from __future__ import annotations

import asyncio
import re

import pytest
from test_admin_listener_flood import serving, tools  # noqa: F401  (tools: a fixture)

from stepguard.proxy.listener import ADMIN_CONNECTIONS

pytestmark = pytest.mark.timeout(90)

RECLAIMED = re.compile(r'^stepguard_connections_reclaimed_total\{listener="admin"\} (\S+)$', re.M)
EXTRA = 6       # silent connections past the admin listener's slots


async def test_connections_the_admin_listener_reclaims_are_counted(tmp_path, tools):  # noqa: F811
    async with serving(tmp_path, tools) as running:
        async with running.session.get(f"{running.admin}/metrics") as reply:
            before = RECLAIMED.search(await reply.text())
        silent = [await asyncio.open_connection("127.0.0.1", running.admin_port)
                  for _ in range(ADMIN_CONNECTIONS + EXTRA)]
        try:
            # accepted in order: by this request's turn every silent one has been admitted,
            # the last EXTRA each by reclaiming a slot
            async with running.session.get(f"{running.admin}/metrics") as reply:
                assert reply.status == 200
                after = RECLAIMED.search(await reply.text())
        finally:
            for _, writer in silent:
                writer.close()
    assert before is None or float(before.group(1)) == 0.0
    assert after is not None, "stepguard_connections_reclaimed_total is not exported"
    # the silent ones past the slots, and the scrape itself (a slot of a silent one, unless one
    # of them was cut at the header timeout meanwhile)
    assert EXTRA <= float(after.group(1)) <= EXTRA + 1
