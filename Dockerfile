# Two targets: the default, `runtime`, holds what `kvroute serve` and `kvroute epp` need (kvroute without its
# extras); `dev-tools` adds kvroute[fleet], the simulated fleet and the demo (`--target dev-tools`).
# The base: the public Python image on a normal machine; scripts/build_image.sh builds on a Debian bookworm
# base of its own (debootstrap, Debian's python3.11) where no container registry can be reached.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS base

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVROUTE_HOME=/home/kvroute/.cache/kvroute PATH=/opt/kvroute/bin:$PATH

# A base without Python (a bare Debian) gets Debian's; the public image has its own.
RUN if ! command -v python3 > /dev/null || ! python3 -c 'import venv, ensurepip' 2> /dev/null; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python3-pip ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
    && groupadd --gid 10001 kvroute && useradd --create-home --uid 10001 --gid 10001 kvroute \
    && mkdir -p /etc/kvroute

# The dependencies and the fleet extra, out of pyproject.toml: the layers that install them are rebuilt only
# when they change.
FROM base AS requirements
COPY pyproject.toml /tmp/
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]["optional-dependencies"]["fleet"]))' \
        > /tmp/requirements-fleet.txt

# The venv, /opt/kvroute, built here with pip; the targets copy it without pip.
FROM base AS build
# Where pip finds packages: unset means PyPI (scripts/build_image.sh passes the build machine's index).
ARG PIP_INDEX_URL=
WORKDIR /app
# The build machine's CA bundle (a secret, in no layer) lets pip through a TLS-inspecting proxy.
COPY --from=requirements /tmp/requirements.txt /tmp/
COPY scripts/own_otel_proto.sh scripts/install_build_deps.sh /tmp/
# The compiled core's build needs a compiler and headers here; the targets copy the venv without them.
RUN /tmp/install_build_deps.sh python3 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=pip_cert,required=false \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    if [ -n "$PIP_INDEX_URL" ]; then export PIP_INDEX_URL; else unset PIP_INDEX_URL; fi; \
    python3 -m venv /opt/kvroute \
    && pip install --quiet --upgrade pip setuptools wheel Cython && pip install --quiet -r /tmp/requirements.txt \
    && /tmp/own_otel_proto.sh python3

COPY pyproject.toml README.md ./
COPY router ./router
COPY scorers ./scorers
COPY tinymodel ./tinymodel
COPY fleet ./fleet
COPY kvroute ./kvroute
COPY kvconnectors ./kvconnectors
RUN pip install --quiet --no-deps --no-build-isolation .

FROM build AS build-tools
ARG PIP_INDEX_URL=
COPY --from=requirements /tmp/requirements-fleet.txt /tmp/
RUN --mount=type=secret,id=pip_cert,required=false \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    if [ -n "$PIP_INDEX_URL" ]; then export PIP_INDEX_URL; else unset PIP_INDEX_URL; fi; \
    pip install --quiet -r /tmp/requirements-fleet.txt && pip uninstall --quiet -y pip setuptools wheel Cython

FROM build AS venv
RUN pip uninstall --quiet -y pip setuptools wheel Cython

FROM base AS dev-tools
COPY --from=build-tools /opt/kvroute /opt/kvroute
USER kvroute
RUN kvroute build-model
EXPOSE 8101-8103 5601-5603 5701-5703
ENTRYPOINT ["kvroute"]
CMD ["fleet", "--host", "0.0.0.0"]

FROM base AS runtime
COPY --from=venv /opt/kvroute /opt/kvroute
USER kvroute
# The tiny model is built at image build time so a config using builtin:tiny-llama starts offline.
RUN kvroute build-model

EXPOSE 8000 9002 9090
ENTRYPOINT ["kvroute"]
CMD ["serve", "--config", "/etc/kvroute/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
