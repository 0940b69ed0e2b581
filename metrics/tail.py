"""`stepguard tail`: stepguard's JSON log as one aligned, coloured line per event, for the person
on call (`kubectl logs -f stepguard | stepguard tail --violations`).

The input is what `metrics.logs` writes: one JSON object per line. A run's events are grouped
under a header line (run id, workflow, contract version), printed whenever an event of a run
follows any other line; escalations are marked `!!` in the gutter. Times are shown as logged, in
UTC.

Filtering choices:

* A line that is not a JSON object (a Python traceback, a kubectl prefix, a banner) is printed
  as it is, never dropped. It has no fields, so --run, --step and --violations cannot judge it:
  it is shown even when they are active, because it may be the clue.
* --since is a position in the stream. A line with a readable `timestamp` is judged by it; a
  line without one (raw lines, events with a missing or odd time) follows the last timed line
  before it, and is hidden when no timed line has been seen yet. A naive ISO time is UTC.
* Odd input never stops the tail: bytes that are not UTF-8 are replaced, missing or mistyped
  fields show as `-` or as text, values are cut to DETAIL_CHARS, and control characters are
  shown escaped, so log content cannot move the cursor or recolour the terminal.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import IO, Any, TextIO

import orjson

__all__ = ["TailOptions", "parse_since", "tail"]

DETAIL_CHARS = 200
POLL_SECONDS = 0.2

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(?:\d+[smhd])+")
_DURATION_PART = re.compile(r"(\d+)([smhd])")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARN", "error": "ERROR",
           "critical": "CRIT"}
_SHOWN = frozenset({"event", "level", "timestamp", "run_id", "step", "workflow",
                    "contract_version"})
_RESET, _BOLD, _RED, _YELLOW, _GREEN = "\x1b[0m", "\x1b[1m", "\x1b[31m", "\x1b[33m", "\x1b[32m"


@dataclass(frozen=True, slots=True)
class TailOptions:
    run: str | None = None
    step: str | None = None
    violations: bool = False
    since: str | None = None
    follow: bool = False
    color: str = "auto"


def tail(path: str, options: TailOptions, out: TextIO) -> int:
    """Print the log at `path` (`-`: standard input) to `out`; the exit code."""
    try:
        since = parse_since(options.since, datetime.now(UTC))
    except ValueError as exc:
        print(f"stepguard tail: {exc}", file=sys.stderr)
        return 2
    try:
        source = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        print(f"stepguard tail: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return 1
    printer = Printer(out, Selection(options, since), colour=wants_colour(options.color, out))
    lines = read_lines(path, source, follow=options.follow and path != "-")
    try:
        for line in lines:
            printer.feed(line)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        _silence(out)
    finally:
        lines.close()
    return 0


def parse_since(text: str | None, now: datetime) -> datetime | None:
    """--since as an aware UTC time: an ISO 8601 time, or a duration back from `now`."""
    if text is None:
        return None
    value = text.strip()
    try:
        if _DURATION.fullmatch(value):
            seconds = sum(int(n) * _UNITS[unit] for n, unit in _DURATION_PART.findall(value))
            return now - timedelta(seconds=seconds)
        return _utc(datetime.fromisoformat(value))
    except (ValueError, OverflowError):
        raise ValueError(f"--since {text!r}: expected an ISO 8601 time (2024-05-01T10:00:00Z) "
                         "or a duration (30s, 10m, 2h, 1d, 1h30m)") from None


def wants_colour(choice: str, out: TextIO) -> bool:
    if choice in ("always", "never"):
        return choice == "always"
    return "NO_COLOR" not in os.environ and _is_tty(out)


def read_lines(path: str, source: IO[bytes], follow: bool) -> Generator[bytes, None, None]:
    """Complete lines from `source`, which it closes unless it is standard input. With `follow`,
    it waits for more at the end, and starts over from the top of `path` when the file there
    was truncated or replaced (log rotation)."""
    pending = b""
    try:
        while True:
            chunk = source.readline()
            if chunk:
                pending += chunk
                if pending.endswith(b"\n"):
                    yield pending
                    pending = b""
            elif not follow:
                break
            else:
                time.sleep(POLL_SECONDS)
                if _rotated(path, source):
                    if pending:
                        yield pending
                    pending = b""
                    source = _reopen(path, source)
        if pending:
            yield pending
    finally:
        if path != "-":
            source.close()


class Selection:
    """What the filters let through. Events are judged by their fields; raw lines by --since
    only (see the module docstring)."""

    def __init__(self, options: TailOptions, since: datetime | None) -> None:
        self.run, self.step, self.violations_only = options.run, options.step, options.violations
        self.since = since
        self.in_window = since is None

    def keeps_raw(self) -> bool:
        return self.in_window

    def keeps(self, event: dict[str, Any]) -> bool:
        moment = event_time(event)
        if self.since is not None and moment is not None:
            self.in_window = moment >= self.since
        return (self.in_window
                and (self.run is None or _as_text(event.get("run_id")) == self.run)
                and (self.step is None or _as_text(event.get("step")) == self.step)
                and (not self.violations_only or is_violation(event)))


class Printer:
    """Turns input lines into output lines: run headers, aligned events, raw lines."""

    def __init__(self, out: TextIO, selection: Selection, colour: bool) -> None:
        self.out, self.selection, self.colour = out, selection, colour
        self.current_run: str | None = None
        self.widths = {"run": 12, "step": 14}

    def feed(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        event = parse_event(line)
        if event is None:
            if self.selection.keeps_raw():
                self.current_run = None
                self._write(_escape(line))
            return
        if not self.selection.keeps(event):
            return
        run = _as_text(event.get("run_id"))
        if run is not None and run != self.current_run:
            self._write(self._paint(run_header(event), _BOLD))
        self.current_run = run
        self._write(self._paint(self.render(event), severity(event)))

    def render(self, event: dict[str, Any]) -> str:
        gutter = "!! " if event.get("event") == "escalation" else "   "
        return (f"{gutter}{format_time(event)} {format_level(event):<5} "
                f"{self._cell('run', event.get('run_id'))} {self._cell('step', event.get('step'))} "
                f"{describe(event)}").rstrip()

    def _cell(self, column: str, value: Any) -> str:
        text = _field(value)
        self.widths[column] = max(self.widths[column], min(len(text), 40))
        return text.ljust(self.widths[column])

    def _paint(self, text: str, code: str | None) -> str:
        return f"{code}{text}{_RESET}" if self.colour and code else text

    def _write(self, text: str) -> None:
        try:
            self.out.write(text + "\n")
        except UnicodeEncodeError:
            encoding = getattr(self.out, "encoding", None) or "ascii"
            self.out.write(text.encode(encoding, "backslashreplace").decode(encoding) + "\n")
        self.out.flush()


def parse_event(line: str) -> dict[str, Any] | None:
    """The JSON object on this line, or None for anything else."""
    if not line.lstrip().startswith("{"):
        return None
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def describe(event: dict[str, Any]) -> str:
    """Everything after the time, level, run and step columns."""
    name = _field(event.get("event"))
    if name == "boundary":
        return describe_boundary(event)
    if name == "escalation":
        return describe_escalation(event)
    extras = " ".join(f"{_escape(key)}={_field(value)}" for key, value in event.items() if key not in _SHOWN)
    return _cut(f"{name}  {extras}")


def describe_boundary(event: dict[str, Any]) -> str:
    text = (f"{_field(event.get('boundary')):<5} {_field(event.get('verdict')):<9} "
            f"{_field(event.get('action')):<8}")
    if event.get("check") is not None:
        text += f" {_field(event.get('check'))} ({_field(event.get('drift'))}): {_field(event.get('detail'))}"
        if event.get("field") is not None:
            text += f" at {_field(event.get('field'))}"
    attempt = event.get("attempt")
    if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt > 1:
        text += f"  attempt {attempt}"
    if event.get("verdict") != "pass" and event.get("decision_id") is not None:
        text += f"  decision {_field(event.get('decision_id'))}"
    if event.get("trace_id") is not None:
        text += f"  trace {_field(event.get('trace_id'))} span {_field(event.get('span_id'))}"
    return text


def describe_escalation(event: dict[str, Any]) -> str:
    delivered = event.get("webhook_delivered")
    webhook = ("webhook delivered" if delivered is True
               else f"webhook FAILED: {_field(event.get('webhook_error'))}" if delivered is False
               else "no webhook")
    trace = f"  ({_field(event.get('trace'))})" if event.get("trace") else ""
    if event.get("trace_id") is not None:
        trace += f"  trace {_field(event.get('trace_id'))} span {_field(event.get('span_id'))}"
    return (f"ESCALATION at {_field(event.get('detection_point'))}  "
            f"decision {_field(event.get('decision_id'))}  {webhook}{trace}")


def run_header(event: dict[str, Any]) -> str:
    return (f"run {_field(event.get('run_id'))}  workflow {_field(event.get('workflow'))}  "
            f"contract v{_field(event.get('contract_version'))}")


def is_violation(event: dict[str, Any]) -> bool:
    return (event.get("verdict") == "violation" or event.get("action") == "refuse"
            or event.get("event") == "escalation" or event.get("level") in ("error", "critical"))


def severity(event: dict[str, Any]) -> str | None:
    """The colour of an event's line: red stops a run or is an error, yellow lets it go on
    after a problem, green is a pass."""
    action, level = event.get("action"), event.get("level")
    if event.get("event") == "escalation":
        return _BOLD + _RED
    if action in ("halt", "escalate", "refuse") or level in ("error", "critical"):
        return _RED
    if action in ("observe", "retry") or level == "warning":
        return _YELLOW
    return _GREEN if event.get("verdict") == "pass" else None


def event_time(event: dict[str, Any]) -> datetime | None:
    stamp = event.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return _utc(datetime.fromisoformat(stamp))
    except ValueError:
        return None


def format_time(event: dict[str, Any]) -> str:
    moment = event_time(event)
    if moment is None:
        return "--:--:--.---"
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def format_level(event: dict[str, Any]) -> str:
    level = _field(event.get("level"))
    return _LEVELS.get(level, level.upper()[:5])


def _field(value: Any) -> str:
    """A field's value as display text on one line, at most DETAIL_CHARS long; `-` when absent."""
    text = _as_text(value)
    return "-" if text is None or text == "" else _cut(_escape(text))


def _as_text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _cut(text: str, limit: int = DETAIL_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _escape(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _is_tty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (ValueError, OSError):
        return False


def _rotated(path: str, source: IO[bytes]) -> bool:
    try:
        now, opened = os.stat(path), os.fstat(source.fileno())
    except OSError:
        return False
    return now.st_ino != opened.st_ino or now.st_dev != opened.st_dev or now.st_size < source.tell()


def _reopen(path: str, source: IO[bytes]) -> IO[bytes]:
    try:
        fresh = open(path, "rb")  # noqa: SIM115 - read_lines closes it
    except OSError:
        return source
    source.close()
    return fresh


def _silence(out: TextIO) -> None:
    """After the reader went away (`| head`): point `out` at /dev/null, so that flushing it at
    exit does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
    except (OSError, ValueError):
        pass
