"""Prefect's settings and logging as this process's environment gives them, even when Prefect was imported before
the environment was what it is now.

Prefect reads its settings when it is first imported: the root settings context (API URL, home, profile; the home
directory is created then) and its logging configuration (levels, handlers, PREFECT_LOGGING_EXTRA_LOGGERS). A CLI
process can have imported Prefect before its environment was what it is: the tests' pre-imported parent of CLI
processes (tests/zygote.py) imports Prefect once under its own environment and forks a child per CLI run with
another (the `rollout` process calls this first: `rollout_cli.main.run`), and the CLI sets PREFECT_API_URL and
PREFECT_HOME itself (rollout_cli/local_server.py, `rollout stack`: they call this after), which a caller of
`rollout_cli.main.main` in process may have imported Prefect before. `follow_environment` rebuilds both from the
environment as Prefect's import builds them; where Prefect is not imported yet it does nothing: its import will.
What Prefect's import does once and this does not redo: its plugins' start-up hooks (PREFECT_PLUGINS_ENABLED, off by
default) and its first-run telemetry notice (interactive terminals only). One thing it does early: a forked CLI
whose environment has no PREFECT_HOME creates Prefect's default home (~/.prefect, empty) at its start, where a fresh
`rollout train` without PREFECT_API_URL or `rollout stack` sets PREFECT_HOME before it first imports Prefect.
"""

from __future__ import annotations

import logging
import sys


def follow_environment() -> None:
    """Make Prefect's settings and logging those a fresh import in this environment and directory would give."""
    if "prefect.context" not in sys.modules:
        return  # not imported yet: its import reads the environment as it is then
    from prefect.context import refresh_global_settings_context
    from prefect.logging import configuration

    refresh_global_settings_context()  # Settings() from the environment, the active profile, the home created
    if configuration.PROCESS_LOGGING_CONFIG:  # configured by `import prefect.main` under the old settings
        _undo_logging_setup(configuration.PROCESS_LOGGING_CONFIG)
        configuration.PROCESS_LOGGING_CONFIG.clear()
        configuration.setup_logging()  # as at import: a full (not incremental) configuration


def _undo_logging_setup(config: dict) -> None:
    """Return the loggers Prefect's last `setup_logging` configured to how a process that never ran it has them:
    its handlers (dictConfig names each one; the extra loggers got prefect.extra's) off every logger, and the
    levels and propagation of the loggers it named reset."""
    installed = set(logging._handlers.values())  # noqa: SLF001 - dictConfig's named handlers: exactly Prefect's
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in [handler for handler in logger.handlers if handler in installed]:
            logger.removeHandler(handler)
    for name in config.get("loggers", {}):
        logger = logging.getLogger(name)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    if "root" in config:
        logging.getLogger().setLevel(logging.WARNING)  # the logging module's own default
