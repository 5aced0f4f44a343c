FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 KVROUTE_HOME=/home/kvroute/.cache/kvroute

RUN useradd --create-home --uid 10001 kvroute
WORKDIR /app
COPY pyproject.toml README.md ./
COPY router ./router
COPY tinymodel ./tinymodel
COPY fleet ./fleet
COPY kvroute ./kvroute
RUN pip install . && mkdir -p /etc/kvroute

USER kvroute
# The tiny model is built at image build time so a config using builtin:tiny-llama starts offline.
RUN kvroute build-model

EXPOSE 8000
ENTRYPOINT ["kvroute", "serve", "--config", "/etc/kvroute/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
