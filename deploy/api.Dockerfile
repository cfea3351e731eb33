# The front door, the migration job and Flower: no torch in this image (the api never imports it).
FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/kiln
COPY pyproject.toml README.md constraints.txt ./
COPY kiln ./kiln
COPY kiln_cli ./kiln_cli
COPY kiln_train ./kiln_train
COPY api ./api
COPY worker ./worker
COPY migrations ./migrations
# The versions the test suite passed with (constraints.txt, see scripts/lock-environment).
# /models belongs to kiln here too: whichever container mounts the empty `models` volume first
# gives it its mount point's owner, and the CPU worker writes its tiny model there.
RUN pip install -c constraints.txt . && useradd --system --create-home --uid 10001 kiln \
    && mkdir -p /var/lib/kiln /var/lib/flower /models && chown kiln /var/lib/kiln /var/lib/flower /models
USER kiln
EXPOSE 8420 5555
CMD ["kiln", "serve"]
