"""structlog set-up: readable console lines on a terminal, JSON lines in production."""

from __future__ import annotations

import logging
import sys

import structlog

from runtime import envs


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    level_no = getattr(logging, (level or envs.log_level()).upper(), logging.INFO)
    fmt = fmt or envs.log_format()
    renderer = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
