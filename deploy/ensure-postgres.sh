#!/usr/bin/env bash
# Makes sure PostgreSQL answers on 127.0.0.1:5432 for the tests (the store suite runs against it,
# tests/pgtest.py): user postgres, trust authentication from loopback. Idempotent:
#   - already accepting connections: nothing to do;
#   - installed but stopped: start its clusters (pg_ctlcluster, else `service postgresql`);
#   - not installed: Debian's `postgresql` from apt, trust auth for 127.0.0.1 and ::1, started.
# Only a cluster this script created gets its authentication changed.
set -euo pipefail

export PATH="$PATH:/usr/sbin"
HOST=127.0.0.1
PORT=5432

as_root=()
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo)
fi

ready() {
    command -v pg_isready >/dev/null 2>&1 && pg_isready -q -h "$HOST" -p "$PORT" -t 2
}

wait_ready() {
    for _ in $(seq 1 60); do
        ready && return 0
        sleep 0.5
    done
    return 1
}

start_clusters() {
    if command -v pg_lsclusters >/dev/null 2>&1; then
        # every cluster that is down: "VERSION NAME PORT STATUS ..."
        pg_lsclusters --no-header | while read -r version name _port status _rest; do
            if [ "$status" != "online" ]; then
                "${as_root[@]}" pg_ctlcluster "$version" "$name" start || true
            fi
        done
    fi
    ready || "${as_root[@]}" service postgresql start >/dev/null 2>&1 || true
}

if ready; then
    echo "ensure-postgres: PostgreSQL is accepting connections on $HOST:$PORT"
    exit 0
fi

installed_now=0
if ! command -v pg_lsclusters >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "ensure-postgres: no PostgreSQL and no apt-get: start PostgreSQL on $HOST:$PORT yourself" >&2
        exit 1
    fi
    # policy-rc.d exit 101: the package does not start the server itself; this script does
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
        "${as_root[@]}" chmod 755 "$policy"
        created_policy=1
    fi
    "${as_root[@]}" apt-get update -qq
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends postgresql postgresql-client
    if [ "$created_policy" = 1 ]; then "${as_root[@]}" rm -f "$policy"; fi
    installed_now=1
fi

if [ "$installed_now" = 1 ]; then
    # the tests connect as postgres from loopback without a password
    for hba in /etc/postgresql/*/main/pg_hba.conf; do
        [ -e "$hba" ] || continue
        "${as_root[@]}" sed -i -E \
            -e 's/^(host[[:space:]]+all[[:space:]]+all[[:space:]]+127\.0\.0\.1\/32[[:space:]]+).*/\1trust/' \
            -e 's/^(host[[:space:]]+all[[:space:]]+all[[:space:]]+::1\/128[[:space:]]+).*/\1trust/' \
            -e 's/^(local[[:space:]]+all[[:space:]]+postgres[[:space:]]+).*/\1trust/' "$hba"
    done
fi

start_clusters
if ! wait_ready; then
    echo "ensure-postgres: PostgreSQL did not come up on $HOST:$PORT" >&2
    command -v pg_lsclusters >/dev/null 2>&1 && pg_lsclusters >&2
    exit 1
fi
echo "ensure-postgres: PostgreSQL is accepting connections on $HOST:$PORT"
