"""``qatune serve``: a page to try a trained run and an OpenAI-compatible API, with batched decoding.

app.py holds the routes, service.py what a request becomes (a job for the batcher, then a reply), replies.py the
OpenAI-shaped answers, request_checks.py the API key, body size, requests in flight and error answers, schemas.py
the request bodies and errors, batching.py the queue and its worker, decoding.py the token-by-token decode loop,
server.py the uvicorn process, static/index.html the page. FastAPI and uvicorn are an optional extra:
check_installed() says how to get them.
"""

from qatune.errors import QatuneError


def check_installed() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise QatuneError(f"qatune serve needs FastAPI and uvicorn ({exc.name} is not installed): "
                          "pip install 'qatune[serve]'") from None
