# stepguard, one image for the sidecar and for replicas: the proxy on :8080, the admin listener
# (/healthz, /readyz, /metrics) on :9090, the contract mounted as a file, the SQLite store on a
# volume (replicas set a postgresql:// STEPGUARD_STORE instead; docs/deploy.md).
#
# The proxy listens on 127.0.0.1 unless told otherwise: it forwards to the contract's tools, so
# it is opened to other hosts only on purpose. The admin listener (health, readiness, metrics;
# no tool traffic) listens on all interfaces for probes and scrapers; off loopback, its runs API
# needs a token even to read (STEPGUARD_ADMIN_VIEWER_TOKEN, or STEPGUARD_ADMIN_TOKEN to act too):
# without one, reading runs is off (403). To reach the proxy from
# outside the container (another container, or a published port), bind it explicitly and
# publish it on loopback:
#
#   docker build -t stepguard:0.1.0 .
#   docker run --rm -e STEPGUARD_HOST=0.0.0.0 -p 127.0.0.1:8080:8080 -p 127.0.0.1:9090:9090 \
#     -v "$PWD/examples/order-confirmation/contract.yaml:/etc/stepguard/contract.yaml:ro" \
#     -v stepguard-store:/var/lib/stepguard stepguard:0.1.0
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 stepguard \
 && useradd --system --uid 10001 --gid stepguard --no-create-home \
        --home-dir /var/lib/stepguard --shell /usr/sbin/nologin stepguard \
 && install -d -o stepguard -g stepguard -m 0750 /var/lib/stepguard \
 && install -d -m 0755 /etc/stepguard

# a regular (not editable) install of the build context, with the extras a replica needs: `otel`
# (OTLP trace export, off until OTEL_EXPORTER_OTLP_ENDPOINT is set) and `postgres` (the shared
# store, chosen by a postgresql:// STEPGUARD_STORE); the source does not stay in the image
COPY . /tmp/stepguard-src
RUN pip install "/tmp/stepguard-src[otel,postgres]" \
 && rm -rf /tmp/stepguard-src

ENV STEPGUARD_HOST=127.0.0.1 \
    STEPGUARD_PORT=8080 \
    STEPGUARD_ADMIN_HOST=0.0.0.0 \
    STEPGUARD_ADMIN_PORT=9090 \
    STEPGUARD_CONTRACTS=/etc/stepguard/contract.yaml \
    STEPGUARD_STORE=/var/lib/stepguard/stepguard.db \
    STEPGUARD_LOG_FORMAT=json

VOLUME ["/var/lib/stepguard"]
WORKDIR /var/lib/stepguard
USER 10001:10001
EXPOSE 8080 9090

# slim has no curl: python asks the admin listener; any error or non-2xx status exits 1
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('STEPGUARD_ADMIN_PORT', '9090') + '/healthz', timeout=2)"]

ENTRYPOINT ["stepguard"]
CMD ["serve"]
