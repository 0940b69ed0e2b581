"""Server-sent events cut into whole events and decoded one at a time (`stepguard.proxy.core.sse`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepguard.proxy.core.sse import (
    EventTooLarge,
    EventUnreadable,
    SSESplitter,
    _decoded,
    decode_event,
    model_event,
)


def test_an_event_with_an_id_keeps_its_data() -> None:
    event = decode_event(b'id: 12\r\nevent: message\r\ndata: {"id": 2}\r\n\r\n')
    assert event is not None
    assert (event.id, event.event, event.data) == ("12", "message", '{"id": 2}')


def test_an_event_without_its_blank_line_still_decodes() -> None:
    event = decode_event(b"id: 7\ndata: last")
    assert event is not None and (event.id, event.data) == ("7", "last")


def test_data_lines_are_joined_with_newlines() -> None:
    event = decode_event(b"data: a\ndata: b\n\n")
    assert event is not None and event.data == "a\nb"


def test_a_comment_alone_is_no_event() -> None:
    assert decode_event(b": keep-alive\n\n") is None


def test_events_split_across_chunks_come_out_whole_with_their_raw_bytes() -> None:
    splitter = SSESplitter()
    first = list(splitter.events(b"id: 1\r\ndata: x\r"))
    rest = list(splitter.events(b"\n\r\nid: 2\r\ndata: y\r\n\r\n"))
    assert first == []
    assert [(raw, e.id if e else None, e.data if e else None) for raw, e in rest] == [
        (b"id: 1\r\ndata: x\r\n\r\n", "1", "x"), (b"id: 2\r\ndata: y\r\n\r\n", "2", "y")]


@pytest.mark.parametrize("cut", range(30))
def test_lf_ended_events_come_out_with_exactly_their_own_bytes(cut: int) -> None:
    stream = b"data: a\n\nevent: e\ndata: b\n\n"
    splitter = SSESplitter()
    events = [*splitter.events(stream[:cut]), *splitter.events(stream[cut:])]
    assert [(raw, e.event if e else None, e.data if e else None) for raw, e in events] == [
        (b"data: a\n\n", "message", "a"), (b"event: e\ndata: b\n\n", "e", "b")]
    assert splitter.rest() == b""


def test_an_event_growing_past_the_limit_raises() -> None:
    splitter = SSESplitter(limit=16)
    with pytest.raises(EventTooLarge):
        list(splitter.events(b"data: " + b"x" * 32))


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n", b"\r\n\r",
                                 b"\n\r"])
def test_every_mix_of_line_endings_ends_an_event(sep: bytes) -> None:
    splitter = SSESplitter()
    events = list(splitter.events(b"data: a" + sep + b"data: b" + sep))
    events += list(splitter.events(b"data: end\n\n"))
    assert [e.data for _, e in events if e is not None] == ["a", "b", "end"]


def test_a_crlf_inside_an_event_is_one_line_ending_not_a_blank_line() -> None:
    splitter = SSESplitter()
    events = list(splitter.events(b"event: message\r\ndata: x\r\n\r\n"))
    assert len(events) == 1
    assert events[0][1] is not None and (events[0][1].event, events[0][1].data) == ("message", "x")


def test_a_blank_line_ending_in_a_cr_ends_the_event_at_once() -> None:
    splitter = SSESplitter()
    first = [(raw, e.data if e else None) for raw, e in splitter.events(b"data: a\r\n\r")]
    rest = [(raw, e.data if e else None) for raw, e in splitter.events(b"\ndata: b\r\n\r\n")]
    assert first == [(b"data: a\r\n\r", "a")]
    assert rest == [(b"\ndata: b\r\n\r\n", "b")]          # the CR's LF goes with the next


def test_a_stream_of_cr_line_endings_is_cut_event_by_event() -> None:
    splitter = SSESplitter()
    events = list(splitter.events(b"event: message\rdata: a\r\r"))
    assert [(e.event, e.data) for _, e in events if e is not None] == [("message", "a")]


@pytest.mark.parametrize("number", ["9223372036854775807", "-9223372036854775808",
                                    "18446744073709551615"])
def test_an_event_integer_orjson_holds_exactly_is_read(number: str) -> None:
    assert model_event(f'{{"seed": {number}, "name": "ñ 5"}}') == {
        "seed": int(number), "name": "ñ 5"}


@pytest.mark.parametrize("number", ["18446744073709551616", "-9223372036854775809",
                                    "123456789012345678901234567890"])
def test_an_event_integer_past_64_bits_is_unreadable(number: str) -> None:
    with pytest.raises(EventUnreadable, match="64-bit float"):
        model_event(f'{{"name": "ñ", "seed": {number}}}')


def test_a_long_run_of_digits_inside_an_event_string_is_text_not_an_integer() -> None:
    digits = "1234567890" * 3
    assert model_event(f'{{"id": "{digits}", "x": 1.{digits}, "y": 1e{digits[:2]}}}') == {
        "id": digits, "x": float(f"1.{digits}"), "y": float(f"1e{digits[:2]}")}


# lines of the shapes the fast path reads and of those it must leave to the decoder
_VALUES = st.text(alphabet="ab :é\u2028\x00{}\"", max_size=5)
_LINES = st.one_of(
    st.builds(lambda name, space, value: f"{name}:{space}{value}",
              st.sampled_from(["data", "event", "id", "retry", "", "x"]),
              st.sampled_from(["", " ", "  "]), _VALUES),
    st.sampled_from(["", "data", "event", ": comment"]))
_EVENTS = st.builds(lambda lines, end: "".join(line + eol for line, eol in lines) + end,
                    st.lists(st.tuples(_LINES, st.sampled_from(["\n", "\n", "\r", "\r\n"])),
                             max_size=4),
                    st.sampled_from(["", "\n", "\r\n"]))
# the fast path's own shapes, give or take a space, a line or a line ending
_NEAR = st.builds(lambda head, space, value, end: f"{head}data:{space}{value}{end}",
                  st.sampled_from(["", "event: ", "event:", "event: a\n", "event:  a \n",
                                   "event: \n", "event:a\n", "id: 1\n", "data: x\n"]),
                  st.sampled_from(["", " ", "  "]), _VALUES,
                  st.sampled_from(["\n\n", "\n", "\r\n\r\n", "\n\n\n", "\ndata: y\n\n",
                                   "\r\n\n", "\n\r"]))


@settings(max_examples=500, deadline=None)
@given(st.one_of(_NEAR, _EVENTS))
def test_an_event_is_read_as_the_spec_following_decoder_reads_it(text: str) -> None:
    fast, spec = decode_event(text.encode()), _decoded(text)
    assert (fast is None) == (spec is None)
    if fast is not None and spec is not None:
        assert (fast.event, fast.data, fast.id, fast.retry) == (
            spec.event, spec.data, spec.id, spec.retry)


@pytest.mark.parametrize(("raw", "event", "data"), [
    (b"data: {}\n\n", "message", "{}"),
    (b"event: message_start\ndata: {\"a\": 1}\n\n", "message_start", '{"a": 1}'),
    (b"event: \ndata:  x\n\n", "message", " x"),
])
def test_the_usual_event_shapes_are_read_whole(raw: bytes, event: str, data: str) -> None:
    decoded = decode_event(raw)
    assert decoded is not None and (decoded.event, decoded.data, decoded.id) == (event, data, "")
