"""Errors a user can cause. The CLI turns each into one clear message and a non-zero exit.

Library code raises these, never ``sys.exit`` or click exceptions. Each message says what failed,
where, what was found, and how to fix it.
"""


class QatuneError(Exception):
    """Base of every error qatune reports to a user (exit code 1 at the CLI)."""

    exit_code = 1


class ConfigError(QatuneError):
    """The YAML config or a ``--set`` override is invalid."""


class DataError(QatuneError):
    """A data file cannot be read or does not hold usable QA rows."""


class ModelError(QatuneError):
    """A model or tokenizer cannot be built, found or loaded."""


class RunDirError(QatuneError):
    """A run directory is missing, incomplete, or would be overwritten."""


class TrainingError(QatuneError):
    """Training stopped because it cannot go on (non-finite loss, interruption)."""


def row_list(rows: list[int], limit: int = 10) -> str:
    """Spreadsheet row numbers for a message: the first ``limit``, then how many more."""
    shown = ", ".join(map(str, rows[:limit]))
    return shown + (f" and {len(rows) - limit} more" if len(rows) > limit else "")
