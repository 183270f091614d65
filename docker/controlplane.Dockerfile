# The control plane (public API, scheduler, tokenizer) on a slim CPU image without torch.
#   docker build -f docker/controlplane.Dockerfile -t twinplane-controlplane .
ARG PYTHON_IMAGE=python:3.12-slim

# The gRPC stubs, generated from proto/*.proto (.dockerignore keeps the committed ones out).
FROM ${PYTHON_IMAGE} AS stubs
RUN pip install --no-cache-dir grpcio-tools==1.84.0
COPY proto/ /src/proto/
RUN python /src/proto/generate.py

FROM ${PYTHON_IMAGE}
WORKDIR /opt/twinplane
COPY . .
COPY --from=stubs /src/proto/ proto/
# The core dependencies only: the build fails if torch or transformers come in anyway.
RUN pip install --no-cache-dir . \
 && python -c "import importlib.util as u, sys; bad = [m for m in ('torch', 'transformers') if u.find_spec(m)]; sys.exit(f'not for the control plane: {bad}' if bad else 0)" \
 && twinplane controlplane --help > /dev/null
# An unprivileged user owns what the service writes: the cache, the socket folder, its home (Triton's
# and torch's compile caches). Every image uses the same uid, so the planes share the socket volume.
RUN useradd --uid 10001 --user-group --create-home twinplane \
 && mkdir -p /cache /run/twinplane && chown twinplane:twinplane /cache /run/twinplane
USER 10001:10001
# The public gRPC API and Prometheus /metrics, where docker-compose and deploy/kubernetes run them.
EXPOSE 50051 9400
ENTRYPOINT ["twinplane"]
CMD ["controlplane", "--help"]
