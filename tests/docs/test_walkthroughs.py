"""The README's walkthrough, and each guide's, runs as written and shows what the page says.

A page marks its shell blocks: `<!-- walkthrough -->` runs in one shell, in page order, and
`<!-- walkthrough: terminal 2 -->` in a second one alongside it; a `<!-- walkthrough: output -->`
(or `terminal 2 output`) text block after them holds the output those commands show, line for
line: `...` stands for lines left out, and only a `...` may leave lines out (times, ids and runs
of spaces may differ, blank lines do not count). The commands run
verbatim in a copy of the repository whose `.venv` is this checkout's, in a network namespace of
their own: the default ports the pages use (8080, 9090, 9001-9003) are free there whatever else
runs on this machine.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from docblocks import DOCS, ROOT, Block, blocks

RUN_TIMEOUT_S = 150
FOLLOW_WAIT_S = 20      # how long a second terminal (a follower) may take to show its lines
PAGES = [ROOT / "README.md", DOCS / "guides" / "http.md", DOCS / "guides" / "model.md",
         DOCS / "guides" / "mcp.md", DOCS / "guides" / "a2a.md", DOCS / "guides" / "hybrid.md",
         DOCS / "guides" / "from-traffic.md"]
# brings the loopback interface of a fresh network namespace up (SIOCGIFFLAGS / SIOCSIFFLAGS)
LOOPBACK_UP = ("import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
               "f = struct.unpack('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH', b'lo', 0))[:18])[1]; "
               "fcntl.ioctl(s, 0x8914, struct.pack('16sH', b'lo', f | 1))")


@dataclass
class Step:
    block: Block
    terminal: int
    expected: list[str] = field(default_factory=list)


def walkthrough(page: Path) -> list[Step]:
    steps: list[Step] = []
    for block in blocks(page):
        marker = block.marker
        if marker in ("walkthrough", "walkthrough: terminal 2"):
            steps.append(Step(block, 2 if marker.endswith("terminal 2") else 1))
        elif marker in ("walkthrough: output", "walkthrough: terminal 2 output"):
            terminal = 2 if "terminal 2" in marker else 1
            owner = next((s for s in reversed(steps) if s.terminal == terminal), None)
            assert owner is not None, f"{block.where()}: output before any command"
            owner.expected += block.text.splitlines()
    return steps


_NOISE = [(re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z?"), "<time>"),
          (re.compile(r"\b\d\d:\d\d:\d\d(\.\d+)?\b"), "<time>"),
          (re.compile(r"\brun-[0-9a-f]{20}\b"), "run-<id>"),
          (re.compile(r"\b[0-9a-f]{12,64}\b"), "<hex>"),
          (re.compile(r"\x1b\[[0-9;]*m"), ""),
          (re.compile(r"\s+"), " ")]


def normal(line: str) -> str:
    for pattern, replacement in _NOISE:
        line = pattern.sub(replacement, line)
    return line.strip()


def missing(expected: list[str], output: str) -> list[str]:
    """What the page shows that the run did not, as one line (empty: the page shows the output).

    The page shows the whole output, line for line (blank lines aside): a `...` line stands for
    lines left out there, and only there. So a line the page drops, or a line it shortens, is
    as much a difference as one it makes up."""
    if not expected:            # a block with no output shown claims nothing
        return []
    lines = [n for n in (normal(line) for line in output.splitlines()) if n]
    wants = [n for n in (normal(line) for line in expected) if n]
    segments: list[list[str]] = [[]]
    for want in wants:
        if want == "...":
            segments.append([])
        else:
            segments[-1].append(want)
    position = 0
    for k, segment in enumerate(segments):
        last = k == len(segments) - 1
        if not segment:
            continue
        starts = [position] if k == 0 else range(position, len(lines) - len(segment) + 1)
        if last:
            starts = [s for s in starts if s == len(lines) - len(segment)]
        found = next((s for s in starts if lines[s:s + len(segment)] == segment), None)
        if found is None:
            return [_first_difference(segment, lines, position, anchored=k == 0)]
        position = found + len(segment)
    return []


def _first_difference(segment: list[str], lines: list[str], position: int, anchored: bool) -> str:
    """The first line of `segment` the run did not show where the page puts it."""
    if anchored:
        for offset, want in enumerate(segment):
            got = lines[position + offset] if position + offset < len(lines) else "(end of output)"
            if want != got:
                return f"{want}  (the run showed: {got})"
        extra = lines[position + len(segment)] if position + len(segment) < len(lines) else ""
        return f"(nothing more shown, but the run showed) {extra}"
    for want in segment:
        if want not in lines[position:]:
            return want
    return f"{segment[0]}  (these lines are not shown consecutively, or do not end the output)"


def repository_copy(target: Path) -> None:
    """The files of this checkout that git would hand over (tracked, or new and not ignored),
    times kept; `.venv` is this checkout's."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    (target / ".venv").symlink_to(ROOT / ".venv")


def script(steps: list[Step], outputs: Path) -> str:
    """One bash script: terminal 1's blocks in order, each after a marker line; terminal 2's as
    background subshells writing to a file each. A command that fails does not stop it (an agent
    stopped by stepguard exits 1): what a block must show is in its expected output."""
    parts = []
    for n, step in enumerate(steps):
        if step.terminal == 1:
            parts += [f"echo '@@block {n}@@'", step.block.text]
        else:
            parts.append(f"( {step.block.text} ) >{shlex.quote(str(outputs / f'{n}.out'))} 2>&1 &")
    parts += ["echo '@@blocks done@@'", "wait"]
    return "\n".join(parts) + "\n"


def namespaces_work() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--net", "true"], capture_output=True).returncode == 0


def require_what_the_walkthroughs_need() -> None:
    """`unshare --net` and this checkout's `.venv` (the pages activate it); a skip saying which
    is missing, a failure when CI is set."""
    if not (ROOT / ".venv" / "bin" / "activate").exists():
        reason = "the walkthroughs activate .venv: run `make install` first"
    elif not namespaces_work():
        reason = "running the walkthroughs needs `unshare --net` (util-linux, root or user namespaces)"
    else:
        return
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason}; CI is set, so this test may not be skipped")
    pytest.skip(reason)


def clean_environment(home: Path) -> dict[str, str]:
    """A login-like environment: no virtualenv active, no stepguard or SDK settings inherited."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if Path(p).resolve() != (ROOT / ".venv" / "bin").resolve())
    return {"PATH": path, "HOME": str(home), "LANG": os.environ.get("LANG", "C.UTF-8"),
            "TERM": "dumb"}


def section(output: str, n: int) -> str:
    start = output.find(f"@@block {n}@@")
    assert start >= 0, f"block {n} never ran"
    rest = output[start:].split("\n", 1)[1] if "\n" in output[start:] else ""
    ends = [i for i in (rest.find("@@block "), rest.find("@@blocks done@@")) if i >= 0]
    return rest[: min(ends)] if ends else rest


def run(steps: list[Step], workdir: Path) -> Iterator[tuple[Step, str]]:
    """Run the walkthrough; yields each step with the output it showed."""
    outputs = workdir / "outputs"
    outputs.mkdir()
    repo = workdir / "repo"
    repo.mkdir()
    repository_copy(repo)
    (workdir / "walkthrough.sh").write_text(script(steps, outputs))
    log = workdir / "main.out"
    command = ["unshare", "--net", "sh", "-c",
               f'{shlex.quote(sys.executable)} -c "{LOOPBACK_UP}" && exec bash {workdir / "walkthrough.sh"}']
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, cwd=repo, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=clean_environment(workdir),
                                start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while "@@blocks done@@" not in log.read_text(errors="replace") and proc.poll() is None:
            assert time.monotonic() < deadline, f"the walkthrough did not finish:\n{log.read_text()}"
            time.sleep(0.1)
        main = log.read_text(errors="replace")
        assert "@@blocks done@@" in main, f"the walkthrough stopped (status {proc.returncode}):\n{main}"
        deadline = min(deadline, time.monotonic() + FOLLOW_WAIT_S)
        for n, step in enumerate(steps):
            if step.terminal == 2:       # a follower: give it until the deadline to show its lines
                out = outputs / f"{n}.out"
                while missing(step.expected, out.read_text(errors="replace") if out.exists() else ""):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                yield step, out.read_text(errors="replace") if out.exists() else ""
            else:
                yield step, section(main, n)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_the_pages_mark_their_walkthroughs() -> None:
    for page in PAGES:
        steps = walkthrough(page)
        assert steps, f"{page.relative_to(ROOT)} has no walkthrough"
        assert any(step.expected for step in steps), f"{page.relative_to(ROOT)} shows no output"


TAIL = ("run r1  workflow order-confirmation  contract v1\n"
        "   04:16:07.004 WARN  r1  check_policy  entry violation halt  precondition (freshness): "
        "stale id  decision 1542fc71acd66140\n")


def test_a_page_that_leaves_out_a_line_of_the_output_differs_from_it() -> None:
    # the README's second terminal once showed tail's violation line without the header before it
    shown = [TAIL.splitlines()[1]]
    assert missing(shown, TAIL) != []


def test_a_page_that_shortens_a_line_differs_from_the_output() -> None:
    # a guide once showed a completion_proof refusal without its "(cannot evaluate ...)" suffix
    output = "confirm -> 422 exit completion_proof: no id (cannot evaluate \"x\": field x is missing)\n"
    assert missing(["confirm -> 422 exit completion_proof: no id"], output) != []


def test_a_page_that_stops_before_the_output_ends_differs_from_it() -> None:
    refused = "refused 422: stepguard: run 'run-7b118c695e8c42928971', step 'lookup_order'"
    assert missing([refused], f"{refused}\nrun: run-7b118c695e8c42928971\n") != []


def test_dots_leave_out_lines_where_they_stand_and_nowhere_else() -> None:
    output = "{\n  \"a\": 1,\n  \"b\": 2,\n  \"c\": 3\n}\n"
    assert missing(["{", "...", '  "c": 3', "}"], output) == []
    assert missing(["...", '  "b": 2,', "..."], output) == []
    assert missing(["{", '  "a": 1,', '  "c": 3', "}"], output) != []
    assert missing(["{", "...", '  "b": 2,'], output) != []


def test_times_ids_hex_and_runs_of_spaces_may_differ() -> None:
    shown = TAIL.replace("04:16:07.004", "16:53:47.842").replace("1542fc71acd66140", "046153d74591fb1d")
    assert missing(shown.replace("  ", " ").splitlines(), TAIL) == []


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_walkthrough_runs_as_written_and_shows_what_the_page_says(page: Path, tmp_path: Path) -> None:
    require_what_the_walkthroughs_need()
    differences = [f"{step.block.where()}: the page's output differs from the run's at {lost[0]!r}; "
                   f"the run showed:\n{output}"
                   for step, output in run(walkthrough(page), tmp_path)
                   for lost in [missing(step.expected, output)] if lost]
    assert differences == [], "\n\n".join(differences)
