"""Server-sent events cut into whole events and decoded one at a time (`stepguard.proxy.core.sse`)."""

from __future__ import annotations

import pytest

from stepguard.proxy.core.sse import EventTooLarge, SSESplitter, decode_event


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
