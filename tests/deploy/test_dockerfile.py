"""The sidecar image. No Docker engine runs here, so the Dockerfile is read for its invariants and
its build is mirrored: the .dockerignore'd context is built into a wheel, the wheel installed with
its dependencies and the Dockerfile's extras into a fresh venv, and that venv's ENTRYPOINT/CMD and
HEALTHCHECK run with the Dockerfile's ENV (absolute paths re-rooted under a temporary directory,
free ports)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from stepguard.proxy.core.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
EXAMPLE_CONTRACT = ROOT / "examples" / "order-confirmation" / "contract.yaml"
SETTINGS = Settings()


# --- reading the Dockerfile

def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of the Dockerfile, continuation lines joined."""
    logical: list[str] = []
    current = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not current):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    pairs = []
    for text in logical:
        keyword, _, args = text.strip().partition(" ")
        pairs.append((keyword.upper(), args.strip()))
    return pairs


def _args(keyword: str) -> list[str]:
    return [args for kw, args in _instructions() if kw == keyword]


def _env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _args("ENV"):
        for token in shlex.split(args):
            name, sep, value = token.partition("=")
            assert sep and "$" not in value, f"ENV {token!r}: use the KEY=VALUE form, no expansion"
            env[name] = value
    return env


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)  # Docker silently falls back to the shell form when this fails
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def _healthcheck() -> tuple[dict[str, str], list[str]]:
    (args,) = _args("HEALTHCHECK")
    match = re.fullmatch(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(.*)", args)
    assert match, f"HEALTHCHECK {args!r}"
    options = dict(opt[2:].split("=", 1) for opt in match.group(1).split())
    return options, _exec_form(match.group(2))


def _user() -> str:
    return _args("USER")[-1]


# --- the build context, as Docker's .dockerignore makes it

def _ignore_regex(pattern: str) -> re.Pattern[str]:
    pattern = os.path.normpath(pattern).lstrip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _ignore_rules() -> list[tuple[bool, re.Pattern[str], str]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            rules.append((keep, _ignore_regex(line.lstrip("!")), line.lstrip("!")))
    return rules


def _excluded(path: str, rules: list[tuple[bool, re.Pattern[str], str]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for keep, regex, _ in rules:
        if any(regex.match(c) for c in candidates):
            excluded = not keep
    return excluded


def _context_files() -> list[str]:
    rules = _ignore_rules()
    kept_prefixes = [text for keep, _, text in rules if keep]
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        # skip excluded directories no `!pattern` reaches into (.git, .venv, build, ...)
        dirnames[:] = [d for d in dirnames if not _excluded(rel_dir + d, rules)
                       or any(p.startswith(rel_dir + d + "/") for p in kept_prefixes)]
        files += [rel_dir + f for f in filenames if not _excluded(rel_dir + f, rules)]
    return sorted(files)


# --- static invariants

def test_image_is_built_on_python_3_11_slim() -> None:
    assert _args("FROM") == ["python:3.11-slim"]


def test_image_runs_as_a_non_root_user_it_creates() -> None:
    uid, _, gid = _user().partition(":")
    assert uid.isdigit() and int(uid) != 0, "USER must be numeric so runAsNonRoot can verify it"
    assert gid.isdigit() and int(gid) != 0
    assert any("useradd" in run and f"--uid {uid}" in run for run in _args("RUN"))


def test_exposed_ports_are_the_default_proxy_and_admin_ports() -> None:
    exposed = {int(port.split("/")[0]) for args in _args("EXPOSE") for port in args.split()}
    env = _env()
    assert exposed == {SETTINGS.port, SETTINGS.admin_port}
    assert int(env["STEPGUARD_PORT"]) == SETTINGS.port
    assert int(env["STEPGUARD_ADMIN_PORT"]) == SETTINGS.admin_port


def test_the_proxy_binds_loopback_unless_told_otherwise_and_admin_all_interfaces() -> None:
    env = _env()
    assert env["STEPGUARD_HOST"] == "127.0.0.1"
    assert env["STEPGUARD_ADMIN_HOST"] == "0.0.0.0"     # probes and scrapers; no tool traffic


def test_every_stepguard_variable_in_env_is_a_setting() -> None:
    names = {f.name for f in fields(Settings)}
    unknown = [k for k in _env() if k.startswith("STEPGUARD_")
               and k.removeprefix("STEPGUARD_").lower() not in names]
    assert unknown == []


def test_store_lives_on_the_declared_volume() -> None:
    volumes = [v for args in _args("VOLUME") for v in _exec_form(args)]
    assert volumes == ["/var/lib/stepguard"]
    assert str(PurePosixPath(_env()["STEPGUARD_STORE"]).parent) == volumes[0]


def test_contract_is_read_from_one_mounted_file() -> None:
    assert _env()["STEPGUARD_CONTRACTS"] == "/etc/stepguard/contract.yaml"


def test_logs_are_json_lines() -> None:
    assert _env()["STEPGUARD_LOG_FORMAT"] == "json"


def test_healthcheck_asks_healthz_on_the_admin_port_with_python() -> None:
    options, command = _healthcheck()
    assert command[:2] == ["python", "-c"]
    assert "/healthz" in command[2]
    assert f"os.environ.get('STEPGUARD_ADMIN_PORT', '{SETTINGS.admin_port}')" in command[2]
    assert {"interval", "timeout", "retries"} <= options.keys()


def test_entrypoint_is_stepguard_and_command_is_serve() -> None:
    assert [_exec_form(a) for a in _args("ENTRYPOINT")] == [["stepguard"]]
    assert [_exec_form(a) for a in _args("CMD")] == [["serve"]]


def _install_target() -> tuple[str, list[str], list[str]]:
    """(path, extras, words) of the one `pip install PATH[EXTRAS]` RUN."""
    installs = [shlex.split(run) for run in _args("RUN") if "pip install" in run]
    assert len(installs) == 1
    words = installs[0]
    match = re.fullmatch(r"([^\[\]]+)(?:\[([a-z0-9_,-]*)\])?", words[words.index("install") + 1])
    assert match, words
    extras = [e for e in (match.group(2) or "").split(",") if e]
    return match.group(1), extras, words


def test_package_is_pip_installed_from_the_copied_context_not_editable() -> None:
    (copy,) = [shlex.split(a) for a in _args("COPY") if shlex.split(a)[0] == "."]
    target, _, words = _install_target()
    assert target == copy[1]
    assert "-e" not in words and "--editable" not in words


def test_image_installs_the_otel_and_postgres_extras() -> None:
    """A replica exports traces (OTEL_*) and shares a PostgreSQL store: both from one image."""
    assert set(_install_target()[1]) == {"otel", "postgres"}


def test_every_extra_the_image_installs_is_declared_in_pyproject() -> None:
    """pip only warns about an undeclared extra and builds an image without it."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [e for e in _install_target()[1] if e not in declared] == []


def test_build_context_holds_pyproject_and_every_package_directory() -> None:
    context = _context_files()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = project["tool"]["setuptools"]["package-dir"].values()
    assert "pyproject.toml" in context
    for package_dir in package_dirs:
        sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / package_dir).iterdir()
                         if p.is_file() and p.suffix in (".py", ".json", ".yaml", ".typed"))
        assert sources and set(sources) <= set(context), package_dir


def test_build_context_leaves_out_vcs_venvs_build_output_caches_and_stores() -> None:
    leaked = [f for f in _context_files()
              if re.search(r"(^|/)(\.git|\.venv|build|__pycache__|[^/]*\.egg-info|tests)/", f)
              or f.endswith((".pyc", ".db", ".db-wal", ".db-shm"))]
    assert leaked == []


# --- the mirrored build and run

@dataclass
class Image:
    rootfs: Path
    venv: Path
    env: dict[str, str] = field(default_factory=dict)

    def path(self, absolute: str) -> Path:
        """Where an absolute path inside the image lies in this mirror."""
        return self.rootfs / absolute.lstrip("/")


def _run(args: list[Any], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, check=False,
                          **kwargs)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """COPY the context, `pip install` it: a wheel of the context, installed with its
    dependencies (one pip call) into a venv that does not see this interpreter's packages."""
    base = tmp_path_factory.mktemp("image")
    context, dist = base / "context", base / "dist"
    for rel in _context_files():
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", dist, context])
    assert built.returncode == 0, built.stdout + built.stderr
    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", venv])
    assert made.returncode == 0, made.stderr
    (wheel,) = dist.glob("stepguard-*.whl")
    extras = _install_target()[1]
    requirement = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    installed = _run([venv / "bin" / "python", "-m", "pip", "install", requirement])
    assert installed.returncode == 0, installed.stdout + installed.stderr

    image = Image(base / "rootfs", venv)
    image.env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", **_env()}
    for name in ("STEPGUARD_STORE", "STEPGUARD_CONTRACTS"):
        image.env[name] = str(image.path(image.env[name]))
    for args in _args("VOLUME"):
        for volume in _exec_form(args):
            image.path(volume).mkdir(parents=True)
    contract = Path(image.env["STEPGUARD_CONTRACTS"])  # the mounted ConfigMap or bind mount
    contract.parent.mkdir(parents=True)
    shutil.copy(EXAMPLE_CONTRACT, contract)
    image.env["HOME"] = str(image.path(_args("WORKDIR")[-1]))
    return image


def _command(image: Image, argv: list[str]) -> list[str]:
    """argv as the image's PATH resolves it: its first word must come from the venv."""
    program = shutil.which(argv[0], path=image.env["PATH"])
    assert program and Path(program).parent == image.venv / "bin", f"{argv[0]} -> {program}"
    return [program, *argv[1:]]


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    admin: str
    env: dict[str, str]
    log: Path


@pytest.fixture
def serve(image: Image, free_port: Callable[[], int], tmp_path: Path) -> Iterator[Callable[[], Served]]:
    """serve() -> the image's ENTRYPOINT + CMD running with its ENV, on free ports, once ready."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> Served:
        env = {**image.env, "STEPGUARD_PORT": str(free_port()),
               "STEPGUARD_ADMIN_PORT": str(free_port())}
        argv = _command(image, [a for kw in ("ENTRYPOINT", "CMD") for a in _exec_form(_args(kw)[-1])])
        log = tmp_path / "stepguard.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, env=env, cwd=env["HOME"], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)
        started.append(proc)
        admin = f"http://127.0.0.1:{env['STEPGUARD_ADMIN_PORT']}"
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"stepguard serve exited {proc.returncode}:\n{log.read_text()}"
            try:
                if _get(admin + "/readyz")[0] == 200:
                    return Served(proc, admin, env, log)
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, f"not ready in 20s:\n{log.read_text()}"
            time.sleep(0.1)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(180)
def test_wheel_installs_into_an_isolated_venv_as_a_regular_install(image: Image) -> None:
    where = _run([image.venv / "bin" / "python", "-c",
                  "import stepguard.proxy.ops.app as m; print(m.__file__)"], cwd=image.rootfs)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(image.venv / "lib")
    assert "include-system-site-packages = false" in (image.venv / "pyvenv.cfg").read_text()


@pytest.mark.timeout(180)
def test_installed_stepguard_checks_the_example_contract(image: Image) -> None:
    checked = _run(_command(image, ["stepguard", "check", "examples/order-confirmation/contract.yaml"]),
                   env=image.env, cwd=ROOT)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok: workflow 'order-confirmation'" in checked.stdout


@pytest.mark.timeout(180)
def test_served_image_answers_healthz_on_the_admin_port(serve: Callable[[], Served]) -> None:
    assert _get(serve().admin + "/healthz") == (200, {"status": "ok"})


@pytest.mark.timeout(180)
def test_served_image_is_ready_with_the_mounted_contract(serve: Callable[[], Served]) -> None:
    status, body = _get(serve().admin + "/readyz")
    assert status == 200 and body["ready"] is True
    assert [c["workflow"] for c in body["contracts"]] == ["order-confirmation"]


@pytest.mark.timeout(180)
def test_served_image_shows_no_run_without_a_token(serve: Callable[[], Served]) -> None:
    """The image binds its admin listener to all interfaces, so its runs API reads for a
    token only; the image configures none, so reading runs is off."""
    admin = serve().admin
    for path in ("/runs", "/runs/any-run"):
        status, body = _get(admin + path)
        assert status == 403 and "not bound to loopback" in body["error"], (path, body)
    assert _get(admin + "/readyz")[0] == 200


@pytest.mark.timeout(180)
def test_healthcheck_command_passes_against_the_served_image(
        image: Image, serve: Callable[[], Served]) -> None:
    served = serve()
    checked = _run(_command(image, _healthcheck()[1]), env=served.env)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.timeout(180)
def test_healthcheck_command_fails_when_nothing_listens_on_the_admin_port(
        image: Image, free_port: Callable[[], int]) -> None:
    env = {**image.env, "STEPGUARD_ADMIN_PORT": str(free_port())}
    checked = _run(_command(image, _healthcheck()[1]), env=env)
    assert checked.returncode == 1


@pytest.mark.timeout(180)
def test_served_image_creates_its_store_on_the_volume(image: Image, serve: Callable[[], Served]) -> None:
    store = Path(serve().env["STEPGUARD_STORE"])
    assert store.is_file()
    assert store.parent == image.path("/var/lib/stepguard")


@pytest.mark.timeout(180)
def test_served_image_logs_json_lines(serve: Callable[[], Served]) -> None:
    served = serve()
    served.proc.send_signal(signal.SIGTERM)
    served.proc.wait(timeout=10)
    events = [json.loads(line) for line in served.log.read_text().splitlines() if line.strip()]
    assert [e["event"] for e in events] == ["started", "stopping", "stopped"]


@pytest.mark.timeout(180)
def test_sigterm_stops_the_served_image_with_exit_0(serve: Callable[[], Served]) -> None:
    served = serve()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=10) == 0
