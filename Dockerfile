# The ratchet worker image: `celery -A worker worker|beat`, the `ratchet` CLI and Flower.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    RATCHET_DATA_DIR=/home/ratchet/.ratchet

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY worker ./worker
COPY tasks ./tasks
COPY runtime ./runtime
COPY runtime_io ./runtime_io
COPY store ./store
COPY examples ./examples
# The base install brings both brokers' transports (kombu[redis]; amqp comes with kombu);
# the extra adds the S3 snapshot store. /app is root's, so the data dir (embedded
# default, beat's schedule) lives in the ratchet user's home.
RUN pip install ".[s3]" "flower>=2.0" \
    && useradd --create-home --uid 10001 ratchet
USER ratchet

# Celery refuses pickle here: the app accepts JSON only (worker/app.py).
CMD ["celery", "-A", "worker", "worker", "--loglevel=INFO"]
