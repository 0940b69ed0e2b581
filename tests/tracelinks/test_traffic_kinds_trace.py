"""Model and MCP traffic store the trace too: every event committed while stepguard handles a
traced model request or MCP tools/call carries the span of that request."""

from __future__ import annotations

from pathlib import Path

import openai
from prometheus_client import CollectorRegistry
from tracelinks_support import Spans, ids, traced

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.examples.order_confirmation import (
    contract_path,
    fake_model,
    mcp_agent,
    mcp_tools,
    model_agent,
)
from stepguard.metrics.prom import Metrics
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app


async def test_model_traffic_events_carry_the_span_of_the_request_that_stored_them(
        spans: Spans, tmp_path: Path) -> None:
    model = fake_model.FakeModel()
    model.script("model-traced", model_agent.script_for(17, None))
    async with fake_model.serve(model) as model_url:
        contract = contract_with_upstreams(contract_path("contract.model.yaml"),
                                           {"model": model_url})
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract],
                   metrics=Metrics(CollectorRegistry()))
        async with running(traced(create_app(sg), spans.tracer)) as proxy_url, \
                openai.AsyncOpenAI(base_url=f"{proxy_url}{contract.upstreams['model'].mount}/v1",
                                   api_key="test", max_retries=0) as client:
            run = await model_agent.run_model_agent(client, "model-traced", 17)
            assert run.completed and run.run_id is not None
            history = await sg.store.history(run.run_id)
    requests = [ids(s) for s in spans.servers()]
    assert len(requests) == len(run.calls) and len(history) >= 8
    stored = [(e["trace_id"], e["span_id"]) for e in history]
    assert set(stored) <= set(requests)
    # a tool call's entry is stored by the turn that issued it, its exit by the next request
    by_seq = {e["seq"]: requests.index((e["trace_id"], e["span_id"])) for e in history}
    assert sorted(by_seq.values()) == list(by_seq.values()) and len(set(by_seq.values())) > 1


async def test_mcp_tool_call_events_carry_the_span_of_their_tools_call(
        spans: Spans, tmp_path: Path) -> None:
    with mcp_tools.serve(mcp_tools.create_app()) as tools_url:
        contract = contract_with_upstreams(contract_path("contract.mcp.yaml"),
                                           {"tools": tools_url})
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract],
                   metrics=Metrics(CollectorRegistry()))
        async with running(traced(create_app(sg), spans.tracer)) as proxy_url:
            url = f"{proxy_url}{contract.upstreams['tools'].mount}{mcp_tools.MCP_PATH}"
            run = await mcp_agent.run_mcp_agent(url, "mcp-traced", 17)
            assert run.completed
            history = await sg.store.history("mcp-traced")
    requests = {ids(s) for s in spans.servers()}
    assert len(history) == 8
    for entry, exit_ in zip(history[::2], history[1::2], strict=True):
        assert (entry["step"], entry["boundary"], exit_["boundary"]) == (
            exit_["step"], "entry", "exit")
        # one tools/call: entry and exit stored while handling it
        assert (entry["trace_id"], entry["span_id"]) == (exit_["trace_id"], exit_["span_id"])
        assert (entry["trace_id"], entry["span_id"]) in requests
    assert len({e["span_id"] for e in history}) == 4
