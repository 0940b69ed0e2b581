"""The repository's .gitignore covers what running stepguard leaves in a working tree, as the
walkthroughs run it there: the store, the files beside it and a log file the output went to."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

from programs import logged_process, stepguard_command, until

from stepguard.contracts.sqlite_store import SQLiteStore

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "order-confirmation" / "contract.yaml"


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          timeout=30, check=True)
    return done.stdout


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    _git(repo, "add", ".gitignore")
    return repo


async def test_a_serve_run_in_the_tree_leaves_nothing_git_would_list(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    log = repo / "stepguard.log"
    command = [*stepguard_command(), "--contract", str(EXAMPLE), "--store", str(repo / "stepguard.db"),
               "--port", "0", "--admin-port", "0", "--log-format", "json"]
    async with logged_process(command, log) as proc:
        async def started() -> bool:
            text = await asyncio.to_thread(log.read_bytes)
            return b'"event":"started"' in text or proc.returncode is not None
        await until(started, 30, "stepguard serve logged no started line", log)
    assert (repo / "stepguard.db.lock").exists()

    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == "A  .gitignore\n"


def test_the_files_a_shared_store_keeps_beside_it_are_ignored(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    store = SQLiteStore(repo / "stepguard.db")
    beside = [store.lock_path, store.checkpoint_lock_path, store.turn_path,
              store.wal_path, Path(f"{store.path}-shm")]
    for path in beside:
        path.touch()

    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == "A  .gitignore\n"
