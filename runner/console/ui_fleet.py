"""placeholder"""

from aiohttp import web


def add_routes(router: web.UrlDispatcher) -> None:
    pass
