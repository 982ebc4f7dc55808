# The kafka_idem application image: the library (its wheel, installed with pip) plus the
# example consumers and their Avro schemas. Used by docker-compose.yml for the one-shot
# `migrate` step and for the `payments` consumer group.
#
#   docker build -t kafka-idem:local .
#   docker run --rm kafka-idem:local kafka-idem --help

# Stage 1: build the wheel from the source (the same `python -m build` as a release).
# (README.m[d] copies README.md when there is one and is no error when there is not.)
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml MANIFEST.in README.m[d] CHANGELOG.m[d] ./
COPY kafka_idem/ kafka_idem/
RUN pip install "build>=1.2" && python -m build --wheel --outdir /dist

# Stage 2: the runtime, with the wheel installed (no source tree, no build tools).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The library first: this layer is reused while only the consumers change.
COPY --from=build /dist/ /tmp/dist/
RUN pip install /tmp/dist/kafka_idem-*-py3-none-any.whl && rm -rf /tmp/dist

# The application: `kafka-idem run consumers.payments:app` imports `consumers`
# from the working directory; consumers/payments.py reads ../schemas.
WORKDIR /app
COPY consumers/ consumers/
COPY schemas/ schemas/

RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kafka_idem
USER kafka_idem

# /metrics of `kafka-idem run --metrics-port 9108` (bind 0.0.0.0 with KAFKA_IDEM_METRICS_ADDR).
EXPOSE 9108
# SIGTERM stops a member gracefully: it finishes the batch in flight, commits its
# offsets and leaves the group, so its partitions move at once.
STOPSIGNAL SIGTERM
CMD ["kafka-idem", "--help"]
