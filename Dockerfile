# dedup's image: the `dedup` command (serve, migrate, check, demo, bench).
# Two targets: `gateway` (the service) and `locust` (the same, plus locust, for load tests).
#   docker build --target gateway -t dedup .
FROM python:3.11-slim AS gateway

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# The package first, so that editing config/ does not reinstall it.
COPY pyproject.toml README.md ./
COPY dedup ./dedup
RUN pip install .
# config/dedup.toml is the default --config (relative to WORKDIR); DEDUP_* override it.
COPY config ./config

# Never as root; .dedup (the embedded default's folder) must be writable by that user.
RUN useradd --system --uid 10001 --home-dir /app dedup && mkdir -p /app/.dedup \
    && chown dedup /app/.dedup
USER dedup

EXPOSE 8080
# SIGTERM drains: in-flight requests finish, no lease stays held (drain_timeout_s).
STOPSIGNAL SIGTERM
# Inside a container the service must listen beyond loopback; publish the port with care.
CMD ["dedup", "serve", "--host", "0.0.0.0", "--port", "8080"]


FROM gateway AS locust
USER root
RUN pip install "locust>=2.20"
USER dedup
CMD ["locust", "--help"]
