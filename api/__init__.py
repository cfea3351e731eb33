"""The HTTP front door (DESIGN.md §1): Flask app factory, blueprints, admission. No torch."""

from api.app import create_app

__all__ = ["create_app"]
