"""Runs the router app on uvicorn with uvloop and httptools."""

from __future__ import annotations

import uvicorn

from router.app import create_app
from router.config import RouterConfig


def run_server(config: RouterConfig, host: str, port: int) -> None:
    uvicorn.run(
        create_app(config),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=30,
    )
