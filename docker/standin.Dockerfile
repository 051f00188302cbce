# A CPU stand-in for the official CUDA PyTorch runtime image, built by docker/test.sh where no registry or
# GPU is at hand. Like the official image it has a system Python marked externally managed (PEP 668), torch
# installed into it, and a user 1000 that docker/Dockerfile must take over (Ubuntu 24.04's "ubuntu").
# OS: Debian bookworm (minbase, python3, pip, CA certificates) imported from debootstrap. Build context: a
# folder with the torch wheel and its dependencies, so this step needs no network.
ARG OS=finetune-standin-os:bookworm
FROM ${OS}
# .ci/lock.py TORCH, as every torch version written in the repository (tests/test_lock.py)
ARG TORCH=2.13.0
RUN --mount=type=bind,target=/tmp/wheels \
    useradd --uid 1000 --create-home --shell /bin/bash ubuntu \
    && python3 -m pip install --no-cache-dir --break-system-packages --no-index --find-links /tmp/wheels "torch==${TORCH}"
