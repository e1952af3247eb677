# One image for every rlnode service; compose.yaml picks the service by its command.

# The dashboard's chart library, from its lock file (tools/dashboard-vendor).
FROM node:22-slim AS dashboard
WORKDIR /build
COPY tools/dashboard-vendor ./
COPY services/rlnode_services/checkpoint_server/dashboard/package*.json ./dashboard/
RUN ./dashboard-vendor dashboard scratch

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 RLNODE_DATA_DIR=/var/lib/rlnode
WORKDIR /opt/rlnode

COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY --from=dashboard /build/dashboard/vendor ./services/rlnode_services/checkpoint_server/dashboard/vendor
RUN pip install --no-cache-dir .

RUN useradd --system --uid 10001 rlnode && mkdir -p /var/lib/rlnode && chown rlnode /var/lib/rlnode
USER rlnode
