# The GPU worker: CUDA torch (PyPI's default Linux wheel of torch 2.13.0 bundles CUDA and pins
# Triton 3.7.1), Kiln's Triton kernels and flash-linear-attention's kernels for the Gated DeltaNet
# layers (the `gpu` extra).
FROM python:3.11-slim-bookworm
ARG KILN_TORCH_SPEC="torch==2.13.0"
ARG KILN_EXTRAS="train,gpu"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/kiln
# Wheels put into deploy/wheels/ (deploy/wheels/README.md) are offered to pip beside the index: an
# offline input, e.g. a local torch CPU wheel with KILN_TORCH_SPEC="torch==2.13.0+cpu".
# A CPU wheel left there would also satisfy torch==2.13.0: the GPU build refuses a torch without CUDA.
RUN --mount=type=bind,source=deploy/wheels,target=/tmp/kiln-wheels \
    pip install --find-links /tmp/kiln-wheels ${KILN_TORCH_SPEC} && case ",${KILN_EXTRAS}," in *,gpu,*) \
    python -c "import sys, torch; sys.exit(torch.version.cuda is None and 'the gpu extra needs a CUDA build of torch')";; esac
COPY pyproject.toml README.md constraints.txt ./
COPY kiln ./kiln
COPY kiln_cli ./kiln_cli
COPY kiln_train ./kiln_train
COPY api ./api
COPY worker ./worker
COPY migrations ./migrations
# The versions the test suite passed with (constraints.txt, see scripts/lock-environment; the
# torch build above is KILN_TORCH_SPEC's, of the same version).
# A home directory (the tokenizer cache of `kiln model init-tiny`, Triton's kernel cache) and the
# mount points owned by kiln: an empty named volume takes the ownership of its mount point, so
# the `models` volume stays writable for the CPU override's `kiln model init-tiny`.
# With the gpu extra the build fails unless Triton passes flash-linear-attention's Hopper guard and
# fla's kernels import (docs/kernels.md#where-each-path-runs): otherwise the worker would train on
# the slower torch paths without anyone asking for it.
RUN pip install -c constraints.txt ".[${KILN_EXTRAS}]" \
    && case ",${KILN_EXTRAS}," in *,gpu,*) python -m kiln_train.kernels.toolchain ;; esac \
    && useradd --create-home --uid 10001 kiln \
    && mkdir -p /var/lib/kiln /models && chown kiln /var/lib/kiln /models
USER kiln
CMD ["kiln", "worker"]
