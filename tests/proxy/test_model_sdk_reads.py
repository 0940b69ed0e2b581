"""A streamed model turn is read the way the installed SDKs' stream helpers build what they hand
the agent, or ended (fail closed).

A real `openai` / `anthropic` SDK client is the agent, using the stream helpers
(`chat.completions.stream` + `get_final_completion`, `responses.stream` +
`get_final_response`, `messages.stream` + `get_final_message`); a real aiohttp model upstream
on loopback streams one canned turn. Each turn is built so that the SDK assembles a
`check_policy` call (out of order: the contract wants `lookup_order` first) while a reading
that differs from the SDK's sees something else (a name no step matches, let through as
unmatched; or `lookup_order`). The SDK must raise stepguard's stream error instead of handing
the call over, and nothing of the turn may be stored as checked.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from conftest_model import SDK_ERRORS, in_stream, provider_error
from test_model_tool_call_shapes import (
    RESPONSES_FUNCTION,
    TOOL_USE,
    contract,
    sse,
)
from test_stream_faults import streaming_model

from stepguard.proxy.model.dialects import Messages, Responses
from stepguard.proxy.model.turn import Relay, TurnRelay

ASKED = [{"role": "user", "content": "go"}]


# --- what each SDK's stream helper hands the agent ----------------------------------------------


async def chat_helper(base: str) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of every tool call of the completion `get_final_completion` built."""
    async with (openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as client,
                client.chat.completions.stream(model="m", messages=ASKED) as stream):
        completion = await stream.get_final_completion()
    return [(c.id, c.function.name, c.function.arguments)
            for choice in completion.choices for c in choice.message.tool_calls or []]


async def responses_helper(base: str) -> list[tuple[str, str]]:
    """(name, arguments) of every function call of the response `get_final_response` built."""
    async with (openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as client,
                client.responses.stream(model="m", input="go") as stream):
        response = await stream.get_final_response()
    return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]


async def messages_helper(base: str) -> list[tuple[str, Any]]:
    """(name, input) of every tool_use block of the message `get_final_message` built."""
    async with (anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0) as claude,
                claude.messages.stream(model="m", max_tokens=10, messages=ASKED) as stream):
        message = await stream.get_final_message()
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


async def handed(aiohttp_server: Any, stepguard: Any, kind: str, body: bytes,
                 helper: Any) -> tuple[Any, BaseException | None, Any]:
    """What the agent's SDK helper built from `body` streamed through stepguard (None when it
    raised), what it raised, and the guard."""
    guard = await stepguard(contract(await streaming_model(aiohttp_server, body), kind))
    built: Any = None
    raised: BaseException | None = None
    try:
        built = await helper(str(guard.client.make_url("/o")))
    except SDK_ERRORS as exc:
        raised = exc
    return built, raised, guard


async def assert_ended_unchecked(built: Any, raised: BaseException | None, guard: Any) -> None:
    assert built is None, f"the SDK handed the agent {built}"
    assert raised is not None and in_stream(raised), raised
    assert provider_error(raised)["stepguard"]["check"] in ("upstream", "unclassified")
    assert await guard.run_ids() == []      # nothing of the turn was stored as checked


# --- Chat Completions -----------------------------------------------------------------------------


def chat_chunk(*choices: dict[str, Any], obj: str = "chat.completion.chunk") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": obj, "created": 0, "model": "m",
            "choices": list(choices)}


def choice(delta: dict[str, Any], index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish}


def call_piece(index: int, name: str, arguments: str, call_id: str | None = None
               ) -> dict[str, Any]:
    piece: dict[str, Any] = {"index": index, "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        piece |= {"id": call_id, "type": "function"}
    return {"tool_calls": [piece]}


def chat_turn(*chunks: dict[str, Any]) -> bytes:
    return (sse(chat_chunk(choice({"role": "assistant", "content": None})))
            + b"".join(sse(c) for c in chunks)
            + sse(chat_chunk(choice({}, finish="tool_calls"))) + sse(b"[DONE]"))


async def test_a_chat_chunk_the_stream_helper_skips_ends_the_turn(aiohttp_server, stepguard):
    """The openai stream helper skips every chunk whose `object` is not
    `chat.completion.chunk` (Azure's asynchronous filter events): a name piece in one is in
    what stepguard assembles (`check_xpolicy`, no step) and not in the agent's (`check_policy`)."""
    body = chat_turn(chat_chunk(choice(call_piece(0, "check_", "", "call_1"))),
                     chat_chunk(choice(call_piece(0, "x", ""))) | {"object": ""},
                     chat_chunk(choice(call_piece(0, "policy", "{}"))))

    built, raised, guard = await handed(aiohttp_server, stepguard, "openai", body, chat_helper)

    await assert_ended_unchecked(built, raised, guard)


async def test_a_chat_tool_call_at_a_negative_index_ends_the_turn(aiohttp_server, stepguard):
    """The SDK inserts a first tool call at index -1 at position 0 of its list, and merges the
    call at index 0 into it: one `check_policy` call, where a reading keyed by index has two
    (`check_` and `policy`, neither a step)."""
    body = chat_turn(chat_chunk(choice(call_piece(-1, "check_", "", "call_1"))),
                     chat_chunk(choice(call_piece(0, "policy", "{}"))))

    built, raised, guard = await handed(aiohttp_server, stepguard, "openai", body, chat_helper)

    await assert_ended_unchecked(built, raised, guard)


async def test_a_chat_choice_at_a_negative_index_ends_the_turn(aiohttp_server, stepguard):
    """The SDK finds a choice by its index in its list, so choice -1 is the last choice there
    (here choice 0): its tool-call pieces join choice 0's (`check_policy`), where a reading
    keyed by choice index has two choices of one call each (`check_`, `policy`)."""
    body = chat_turn(chat_chunk(choice(call_piece(0, "check_", "", "call_1"))),
                     chat_chunk(choice(call_piece(0, "policy", "{}"), index=-1)))

    built, raised, guard = await handed(aiohttp_server, stepguard, "openai", body, chat_helper)

    await assert_ended_unchecked(built, raised, guard)


# --- Responses ------------------------------------------------------------------------------------


def response(**more: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", **more}


def item_finished(item: dict[str, Any]) -> bytes:
    """A Responses stream's first events: the response created, `item` added and done (at
    sequence numbers 0 to 2, output index 0)."""
    return (sse({"type": "response.created", "sequence_number": 0,
                 "response": response(status="in_progress", output=[])}, "response.created")
            + sse({"type": "response.output_item.added", "sequence_number": 1,
                   "output_index": 0, "item": item}, "response.output_item.added")
            + sse({"type": "response.output_item.done", "sequence_number": 2,
                   "output_index": 0, "item": item}, "response.output_item.done"))


async def test_a_call_a_lifecycle_event_replaces_is_the_call_checked(aiohttp_server, stepguard):
    """The openai stream helper replaces a finished output item with the item of the same
    identity a later `response.in_progress` (or created, queued) carries, and builds the final
    output from the finished items when `response.completed` has none: the agent gets
    `check_policy` while the item the events finished says `lookup_order`."""
    lookup = {**RESPONSES_FUNCTION, "name": "lookup_order"}
    body = (item_finished(lookup)
            + sse({"type": "response.in_progress", "sequence_number": 3,
                   "response": response(status="in_progress", output=[RESPONSES_FUNCTION])},
                  "response.in_progress")
            + sse({"type": "response.completed", "sequence_number": 4,
                   "response": response(status="completed")}, "response.completed"))

    built, raised, guard = await handed(aiohttp_server, stepguard, "openai", body,
                                        responses_helper)

    assert built is None, f"the SDK handed the agent {built}"
    assert raised is not None and in_stream(raised), raised
    details = provider_error(raised)["stepguard"]
    assert details["check"] == "order"      # check_policy, as the agent would have had it
    stored = (await guard.history(details["run"]))[-1]
    assert (stored["step"], stored["violation"]["check"]) == ("check_policy", "order")


# --- Anthropic Messages ---------------------------------------------------------------------------


MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
           "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


def messages_end() -> bytes:
    return (sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                 "usage": {"output_tokens": 1}}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))


async def test_a_tool_use_block_in_message_start_is_checked(aiohttp_server, stepguard):
    """The anthropic SDK starts its message from `message_start`'s message, content included:
    a tool_use block there is handed to the agent like one a `content_block_start` began."""
    block = {**TOOL_USE, "id": "toolu_1", "name": "check_policy", "input": {"order_id": "o"}}
    body = (sse({"type": "message_start", "message": {**MESSAGE, "content": [block]}},
                "message_start") + messages_end())

    built, raised, guard = await handed(aiohttp_server, stepguard, "anthropic", body,
                                        messages_helper)

    assert built is None, f"the SDK handed the agent {built}"
    assert raised is not None and in_stream(raised), raised
    details = provider_error(raised)["stepguard"]
    assert details["check"] == "order"
    stored = (await guard.history(details["run"]))[-1]
    assert (stored["step"], stored["violation"]["check"]) == ("check_policy", "order")


async def test_an_input_delta_at_a_negative_block_index_ends_the_turn(aiohttp_server, stepguard):
    """The SDK finds a delta's block by position in its list, so index -1 is the last block:
    the tool_use block's input becomes the delta's (ord-A), where a reading keyed by index
    takes the delta for another block and checks the start's input (ord-1)."""
    block = {**TOOL_USE, "id": "toolu_1", "name": "lookup_order", "input": {"order_id": "ord-1"}}
    body = (sse({"type": "message_start", "message": MESSAGE}, "message_start")
            + sse({"type": "content_block_start", "index": 0, "content_block": block},
                  "content_block_start")
            + sse({"type": "content_block_delta", "index": -1, "delta": {
                "type": "input_json_delta", "partial_json": '{"order_id": "ord-A"}'}},
                "content_block_delta")
            + sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + messages_end())

    built, raised, guard = await handed(aiohttp_server, stepguard, "anthropic", body,
                                        messages_helper)

    await assert_ended_unchecked(built, raised, guard)



async def test_a_chat_chunk_after_done_ends_the_turn(aiohttp_server, stepguard):
    """The openai SDK stops reading at `[DONE]`: a name piece after it (`x`) is in no call the
    agent gets (`check_policy`), where a reading that goes on to the stream's end checks
    `check_policyx` (no step). A reader of the raw stream may read on: the turn is ended."""
    body = (chat_turn(chat_chunk(choice(call_piece(0, "check_policy", "{}", "call_1"))))
            + sse(chat_chunk(choice(call_piece(0, "x", "")))))

    built, raised, guard = await handed(aiohttp_server, stepguard, "openai", body, chat_helper)

    await assert_ended_unchecked(built, raised, guard)


async def test_an_item_finished_again_after_the_completed_response_ends_the_turn(
        aiohttp_server, stepguard):
    """The openai stream helper builds its final response at `response.completed` (from the
    finished items, when it carries no output): an `output_item.done` after it changes nothing
    the agent gets (`check_policy`), where a reading that lets it replace the item checks
    `lookup_order`."""
    lookup = {**RESPONSES_FUNCTION, "name": "lookup_order"}
    body = (item_finished(RESPONSES_FUNCTION)
            + sse({"type": "response.completed", "sequence_number": 3,
                   "response": response(status="completed")}, "response.completed")
            + sse({"type": "response.output_item.done", "sequence_number": 4,
                   "output_index": 0, "item": lookup}, "response.output_item.done"))

    built, raised, guard = await handed(aiohttp_server, stepguard, "openai", body,
                                        responses_helper)

    assert built is None, f"the SDK handed the agent {built}"
    assert raised is not None and in_stream(raised), raised
    assert provider_error(raised)["stepguard"]["check"] in ("order", "unclassified")
    assert [e["step"] for run in await guard.run_ids()
            for e in await guard.history(run) if e["verdict"] == "pass"] == []


@pytest.mark.parametrize("later", ["1", "call_1"], ids=["rest-of-the-id", "the-id-again"])
async def test_a_call_id_sent_in_more_than_one_piece_ends_the_turn(aiohttp_server, stepguard,
                                                                   later: str):
    """The openai stream helper joins every piece of a streamed call's id, as it joins its name
    and arguments (`call_` + `1` is `call_1`; `call_1` sent twice is `call_1call_1`), where a
    reader of the raw chunks keeps the first: the agent's result could name an id no checked
    call has, and its exit would go unchecked. Such a turn ends; nothing of it is stored."""
    first = "call_" if later == "1" else "call_1"
    body = chat_turn(chat_chunk(choice(call_piece(0, "check_policy", "", first))),
                     chat_chunk(choice({"tool_calls": [{"index": 0, "id": later, "function": {
                         "arguments": "{}"}}]})))

    built, raised, guard = await handed(aiohttp_server, stepguard, "openai", body, chat_helper)

    await assert_ended_unchecked(built, raised, guard)


async def test_an_unterminated_event_after_message_stop_ends_the_turn(aiohttp_server, stepguard):
    """The SDKs dispatch an event at its blank line: one the stream ends without never reaches
    the agent. Its input piece (`1"}`) would turn the input the SDK parses, partially, as
    ord-A into one stepguard parses whole as ord-1 (the last of a key named twice)."""
    block = {**TOOL_USE, "id": "toolu_1", "name": "lookup_order", "input": {}}

    def delta(piece: str) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": piece}}

    body = (sse({"type": "message_start", "message": MESSAGE}, "message_start")
            + sse({"type": "content_block_start", "index": 0, "content_block": block},
                  "content_block_start")
            + sse(delta('{"order_id": "ord-A", "order_id": "ord-'), "content_block_delta")
            + sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + messages_end() + sse(delta('1"}'), "content_block_delta")[:-2])

    built, raised, guard = await handed(aiohttp_server, stepguard, "anthropic", body,
                                        messages_helper)

    await assert_ended_unchecked(built, raised, guard)


# --- with model traffic alone, an event that hands over a whole call is held until checked ------


def relayed(dialect: Any, body: bytes) -> bytes:
    """What a turn's relay writes to the agent before the turn is checked, with model traffic
    alone (`hold_calls`)."""
    relay = TurnRelay(dialect, hold_calls=True, max_bytes=1 << 20, max_calls=64,
                      max_event_bytes=1 << 20)
    return b"".join(a.data for a in relay.feed(body) if isinstance(a, Relay))


def test_a_message_start_that_holds_a_tool_use_block_is_held_until_the_turn_is_checked():
    block = {**TOOL_USE, "id": "toolu_1", "name": "check_policy", "input": {"order_id": "o"}}

    sent = relayed(Messages(), sse({"type": "message_start", "message": {
        **MESSAGE, "content": [block]}}, "message_start") + messages_end())

    assert b"toolu_1" not in sent


def test_a_lifecycle_event_whose_output_holds_a_call_is_held_until_the_turn_is_checked():
    sent = relayed(Responses(), sse({"type": "response.created", "sequence_number": 0,
                                     "response": response(status="in_progress",
                                                          output=[RESPONSES_FUNCTION])},
                                    "response.created")
                   + sse({"type": "response.completed", "sequence_number": 1,
                          "response": response(status="completed",
                                               output=[RESPONSES_FUNCTION])},
                         "response.completed"))

    assert b"call_1" not in sent
