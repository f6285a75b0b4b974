"""``qatune ui``: one local page that takes a sheet to a tried, compared and exported model.

Each step of the page is a qatune command: the page shows the command and the config it wrote, and what it makes is
a normal run directory. workspace.py holds the folder every file lies in, sheet.py the Sheet step (``init``'s
guesses, the config), offers.py the tasks and models it offers, jobs.py the commands run as processes (check, train,
eval --compare, generate --file, export), progress.py what a training has logged, steps.py each step's command line
and what it left, trying.py the tuned model behind ``serve``'s page and API, preconditions.py what a job must meet
before the page starts it, app.py the routes, server.py the uvicorn process, static/ the page.
FastAPI and uvicorn come with the ``serve`` extra (qatune.serve.check_installed says how to get them).
"""

from qatune.errors import QatuneError


class PageError(QatuneError):
    """A request the page cannot do, with the HTTP status it answers with (400 unless said)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_installed() -> None:
    """``qatune ui`` runs on FastAPI and uvicorn, the ``serve`` extra."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise QatuneError(f"qatune ui needs FastAPI and uvicorn ({exc.name} is not installed): "
                          "pip install 'qatune[serve]'") from None
