"""The HTTP service (docs/ARCHITECTURE.md#processes): Flask app factory, blueprints, admission. No torch."""

from api.app import create_app

__all__ = ["create_app"]
