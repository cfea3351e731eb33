"""One blueprint per resource; `BLUEPRINTS` is what the app factory registers."""

from api.routes.adapters import bp as adapters
from api.routes.checkpoints import bp as checkpoints
from api.routes.config import bp as config
from api.routes.datasets import bp as datasets
from api.routes.health import bp as health
from api.routes.hf import bp as hf
from api.routes.jobs import bp as jobs
from api.routes.metrics import bp as metrics
from api.routes.openapi import bp as openapi
from api.routes.preflight import bp as preflight
from api.routes.queue import bp as queue
from api.routes.training import bp as training
from api.routes.ui import bp as ui

BLUEPRINTS = (training, jobs, queue, config, health, adapters, metrics, openapi)
# The browser UI and the routes it brought (usable by every client).
BLUEPRINTS += (preflight, datasets, checkpoints, ui)
# HF/TRL interop: SFT export bundles and PEFT imports (api.hf).
BLUEPRINTS += (hf,)
