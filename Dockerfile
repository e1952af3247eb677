# One image for every rlnode service; compose.yaml picks the service by its command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 RLNODE_DATA_DIR=/var/lib/rlnode
WORKDIR /opt/rlnode

COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install --no-cache-dir .

RUN useradd --system --uid 10001 rlnode && mkdir -p /var/lib/rlnode && chown rlnode /var/lib/rlnode
USER rlnode
