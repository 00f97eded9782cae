# syntax=docker/dockerfile:1
# shortconv-serve image for the Helm chart (k8s/shortconv): Ray 2.60.0 on Python 3.11, with the
# project installed. One Dockerfile, two variants:
#   docker build -t shortconv-serve:0.1.0 .                                # CPU
#   docker build --build-arg VARIANT=gpu -t shortconv-serve:0.1.0-gpu .    # CUDA
# Ray, the Serve app and the TP workers all import the installed package, so the image carries no
# source tree on the import path that could shadow it.
ARG RAY_VERSION=2.60.0
ARG VARIANT=cpu
FROM rayproject/ray:${RAY_VERSION}-py311-${VARIANT}

ARG VARIANT
# The same torch and torchvision as `make setup` (torchvision: LFM2-VL's image processor). The
# GPU variant takes PyPI's CUDA build with torch's own Triton (3.8), the one the tests compile
# against. Empty index: PyTorch's CPU-only index for the CPU variant: the same release without
# the ~4 GB of CUDA libraries a CPU pod never loads.
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
ARG TORCH_INDEX_URL=

# torch first, alone and pinned, so that installing the project never resolves a different build.
RUN if [ -z "${TORCH_INDEX_URL}" ] && [ "${VARIANT}" = "cpu" ]; then \
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu; \
    fi; \
    pip install --no-cache-dir "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
        ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"}

COPY --chown=ray:users pyproject.toml README.md /tmp/shortconv-src/
COPY --chown=ray:users shortconv /tmp/shortconv-src/shortconv
COPY --chown=ray:users workers /tmp/shortconv-src/workers
COPY --chown=ray:users deployments /tmp/shortconv-src/deployments
RUN pip install --no-cache-dir "/tmp/shortconv-src[serve]" \
    && rm -rf /tmp/shortconv-src \
    && cd /home/ray \
    && python -c "import shortconv, workers, deployments.serve.app"

# CPU variant: the AVX2 linears (shortconv/kernels/cpu_gemm.cpp) compile once with a C++
# compiler into ~/.cache/shortconv/kernels; compiled here, the build ships in the image and a pod
# starts without compiling (the cache key is the source, flags, torch and Python: all fixed
# here). Never fatal: without a compiler or AVX2 on the build machine it prints why, and pods
# compile at first start (or, with no compiler, serve fp32 on oneDNN and refuse int8).
RUN if [ "${VARIANT}" = "cpu" ]; then \
        (command -v c++ >/dev/null \
            || (sudo apt-get update \
                && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
                && sudo rm -rf /var/lib/apt/lists/*) \
            || echo "no C++ compiler in the image"); \
        cd /home/ray && python -c "from shortconv.kernels import cpu_gemm; \
print('CPU kernels:', cpu_gemm.load() or 'built into ' + str(cpu_gemm.library_path()))"; \
    fi

WORKDIR /home/ray
