"""``qatune serve`` and ``qatune ui``: the commands that start a server (a trained run's page and API, and the
page from a sheet to an exported model). Registered on the group in cli/__init__.py."""

from __future__ import annotations

import click

from qatune.cli.options import verbose_option
from qatune.errors import QatuneError


@click.command()
@click.argument("run_dir")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback makes the model reachable from the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
@click.option("--api-key", envvar="QATUNE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every request (or set QATUNE_API_KEY).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A name the server answers to besides 127.0.0.1, localhost, [::1] and --host (a reverse proxy's); "
                   "repeat for several.")
@click.option("--model", "which", type=click.Choice(["final", "best"]), default="final", show_default=True)
@click.option("--max-batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              envvar="QATUNE_SERVE_MAX_BATCH_SIZE", help="Requests answered together; 1 turns batching off.")
@click.option("--batch-wait-ms", type=click.FloatRange(0, 1000), default=5.0, show_default=True,
              help="How long the first request of a batch waits for others.")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests in flight; more are refused with 429.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Largest max_tokens a request may ask for.")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Longest question (+ context) in tokens.")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1_000_000, show_default=True,
              help="Largest request body.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the model (default: torch's choice). 1 is best for small models on busy CPUs.")
@verbose_option
def serve(run_dir: str, host: str, port: int, api_key: str | None, allowed_hosts: tuple[str, ...], which: str,
          max_batch_size: int,
          batch_wait_ms: float, max_concurrent: int, max_tokens: int, max_prompt_tokens: int,
          max_body_bytes: int, threads: int | None) -> None:
    """Serve a trained run: a page to try it at / and an OpenAI-compatible API under /v1.

    Listens on 127.0.0.1 unless --host says otherwise. Ctrl-C lets the requests in flight finish, then exits.
    """
    from qatune.serve import check_installed

    check_installed()
    from qatune.serve.app import Limits, Settings
    from qatune.serve.server import serve as run_server

    if api_key is not None and not api_key.strip():
        raise QatuneError("--api-key is empty; pass a key, or leave the option out")
    limits = Limits(max_body_bytes=max_body_bytes, max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens,
                    max_concurrent=max_concurrent)
    settings = Settings(api_key=api_key, limits=limits, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
                        allowed_hosts=allowed_hosts)
    run_server(run_dir, which, host, port, settings, threads)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0 picks a free port.")
@click.option("--workspace", default=".", show_default=True,
              help="The folder the page works in: its sheets, configs, runs and exports; nothing outside it is read.")
@click.option("--api-key", envvar="QATUNE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (the page asks for it); needed beyond loopback.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A name the page answers to besides 127.0.0.1, localhost, [::1] and --host (a reverse proxy's); "
                   "repeat for several.")
@click.option("--no-token", is_flag=True,
              help="No secret in the printed link: the page answers any program on this machine (web pages of other "
                   "sites stay refused).")
@click.option("--max-upload-mb", type=click.IntRange(min=1), default=100, show_default=True,
              help="Largest sheet the page takes.")
@verbose_option
def ui(host: str, port: int, workspace: str, api_key: str | None, allowed_hosts: tuple[str, ...], no_token: bool,
       max_upload_mb: int) -> None:
    """A local page from a sheet to a tried, compared and exported model; each step shows the command it runs.

    Open the link it prints: it carries a secret made at each start, which the page keeps in a cookie.
    """
    from qatune.ui import check_installed

    check_installed()
    from qatune.ui.app import UiSettings
    from qatune.ui.server import serve_ui

    serve_ui(workspace, host, port, UiSettings(api_key=api_key, max_upload_bytes=max_upload_mb * 2**20,
                                               allowed_hosts=allowed_hosts), token=not no_token)
