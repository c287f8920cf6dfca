"""Names `runner.console` exports, imported when first used (`lazy_loader`, ADR-0024).

The runtime reads this stub for the map from name to module; type checkers read it as the
package's interface."""

from .auth import Principal, TokenBook, load_tokens
from .listening import DEFAULT_HOST, DEFAULT_PORT
from .server import create_app, serve

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "Principal",
    "TokenBook",
    "create_app",
    "load_tokens",
    "serve",
]
