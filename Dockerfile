# The template as an image: `docker run IMAGE [overrides]` runs `python -m src.train [overrides]`.
#
# BASE_IMAGE picks the base: a CPU Python image by default; for GPUs a CUDA runtime image, e.g.
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# A base without Python (CUDA images, a bare Debian) gets it from its package manager.
# wheelhouse/ may hold wheels to prefer over PyPI (e.g. a CPU build of torch); it can be empty.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null || ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
WORKDIR /app
# The build context (.dockerignore): the project, its wheels, and in the template repository the
# library's source (lib/), installed from there; a project's pin installs it from git.
COPY . /context
# hadolint ignore=DL3008
RUN if [ ! -d /context/lib ] && ! command -v git >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends git \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN cp -r /context/pyproject.toml /context/constraints.txt /context/README.md /context/src . \
    && mkdir /wheelhouse && cp -r /context/wheelhouse/. /wheelhouse/
# The README's install, without the dev extra: the same pinned versions (constraints.txt).
RUN python3 -m venv /opt/venv \
    && LIBRARY=$(if [ -d /context/lib ]; then echo /context/lib; fi) \
    && /opt/venv/bin/pip install --find-links /wheelhouse -c constraints.txt ${LIBRARY:+"$LIBRARY"} -e . \
    && /opt/venv/bin/pip install --no-deps -c constraints.txt litdata

FROM base
RUN useradd --create-home --uid 1000 app
WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY conf/ conf/
# Data, outputs and the MLflow store live in /work: mount a volume there to keep them.
RUN mkdir /work && chown app:app /work
USER 1000:1000
WORKDIR /work
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app
ENTRYPOINT ["python", "-m", "src.train"]
CMD []
