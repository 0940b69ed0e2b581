"""Argument run keys (`run.key: [arg:NAME]`) as the store keeps them: never the value, only a
keyed digest of it (HMAC-SHA256 with the store's own secret), so a value in a `redact` field
(or any other) is neither stored nor shown, and a run's id derived from a value cannot be
computed by anyone who guesses the value.

The secret is made once, when the store is created (or migrated to keyed digests), and kept in
the store (`meta` row `key_secret`): every process sharing the store reads the same one, so a
value's key is the same on every replica and worker. Keys:

- `argkey:<workflow>:<NAME>=<digest>`: the run the value names;
- `argkeyof:<workflow>:<run>:<NAME>=<digest>`: the value a run was given;
- `argheaded:<workflow>:<run>`: the run was named by a header (`header:NAME` key source) when
  its argument keys were stored; a call that names it by an argument alone is refused.

Stores written before keyed digests hold `arg:<workflow>:<NAME>=<value>` and
`argof:<workflow>:<run>:<NAME>=<value>` in clear: `legacy_rewrite` turns them into digests
when the store is opened (SQLite) or migrated (PostgreSQL), and the clear rows are deleted.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

__all__ = ["forward_key", "headed_key", "own_prefix", "value_digest"]

SECRET_NAME = "key_secret"
SECRET_BYTES = 32
DIGEST_CHARS = 32       # hex characters of the HMAC kept (128 bits)

# the clear-text keys of stores written before keyed digests, as key ranges [low, high)
LEGACY_FORWARD = ("arg:", "arg;")
LEGACY_OWN = ("argof:", "argof;")


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def value_digest(secret: bytes, workflow: str, name: str, value: str) -> str:
    """The keyed digest of argument `name`'s value in `workflow` (the workflow and name are in
    the message: one value of two arguments gives two digests)."""
    message = "\0".join((workflow, name, value)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:DIGEST_CHARS]


def forward_key(workflow: str, name: str, digest: str) -> str:
    return f"argkey:{workflow}:{name}={digest}"


def own_prefix(workflow: str, run_id: str, name: str) -> str:
    return f"argkeyof:{workflow}:{run_id}:{name}="


def headed_key(workflow: str, run_id: str) -> str:
    return f"argheaded:{workflow}:{run_id}"


def legacy_rewrite(secret: bytes, rows: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The digest keys for legacy clear-text forward keys (`arg:<workflow>:<NAME>=<value>`,
    run): each gives its forward key and its run's own key, as `RunKeys` stores them. A row of
    another form is dropped (it could not be read as a key anyway)."""
    out: list[tuple[str, str]] = []
    for key, run_id in rows:
        workflow, colon, rest = key.removeprefix("arg:").partition(":")
        name, equals, value = rest.partition("=")
        if not (key.startswith("arg:") and colon and equals and workflow and name):
            continue
        digest = value_digest(secret, workflow, name, value)
        out += [(forward_key(workflow, name, digest), run_id),
                (own_prefix(workflow, run_id, name) + digest, run_id)]
    return out
