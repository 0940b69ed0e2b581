#!/usr/bin/env bash
# Installs the binaries the tests run: `prometheus` and `promtool` (tests/deploy; Debian's
# `prometheus` package ships both), `haproxy` (the replicas' load balancer, tests/deploy), and
# `wrk` and `nginx` (the proxy benchmark, tests/bench; packages `wrk` and `nginx-light`), and
# `chromium` (the console's browser tests, tests/proxy/test_console_browser.py, which point the
# `playwright` package at /usr/bin/chromium: no browser is downloaded).
# Idempotent: it does nothing when all are on PATH.
#
# The packages' init scripts would start a Prometheus server on :9090 (stepguard's default
# admin port), nginx on :80 and HAProxy; this script keeps them from starting and stops any
# that did.
set -euo pipefail

export PATH="$PATH:/usr/sbin"
have_all() {
    command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
        && command -v wrk >/dev/null 2>&1 && command -v nginx >/dev/null 2>&1 \
        && command -v haproxy >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1
}

if have_all; then
    echo "install-test-deps: prometheus, promtool, haproxy, wrk, nginx and chromium already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: no apt-get here; install prometheus, promtool, haproxy, wrk, nginx and chromium yourself" >&2
    exit 1
fi

as_root=()
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo)
fi

# policy-rc.d exit 101: "do not start services" (honoured by invoke-rc.d and deb-systemd-invoke)
policy=/usr/sbin/policy-rc.d
created_policy=0
remove_policy() {
    if [ "$created_policy" = 1 ]; then "${as_root[@]}" rm -f "$policy"; fi
}
trap remove_policy EXIT
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
    "${as_root[@]}" chmod 755 "$policy"
    created_policy=1
fi

"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends prometheus haproxy wrk nginx-light chromium

# belt and braces: no packaged Prometheus server may keep :9090
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    "${as_root[@]}" systemctl disable --now prometheus
elif [ -x /etc/init.d/prometheus ] && "${as_root[@]}" /etc/init.d/prometheus status >/dev/null 2>&1; then
    "${as_root[@]}" /etc/init.d/prometheus stop
fi
for unit in nginx haproxy; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$unit" 2>/dev/null; then
        "${as_root[@]}" systemctl disable --now "$unit"
    fi
done

have_all || { echo "install-test-deps: prometheus/promtool/haproxy/wrk/nginx/chromium still missing" >&2; exit 1; }
prometheus --version 2>&1 | head -n 1
promtool --version 2>&1 | head -n 1
