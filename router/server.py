"""Runs the router app on uvicorn with uvloop and httptools."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from router.app import create_app
from router.config import RouterConfig


def run_server(config: RouterConfig, host: str, port: int, path: Path | None = None) -> None:
    uvicorn.run(
        create_app(config, path),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=30,
    )
