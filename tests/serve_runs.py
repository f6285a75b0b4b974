"""Tiny runs of every kind for the qatune serve tests, trained in a few seconds, and a real server process."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import FIXTURES, ROOT, cli_ok

SCRATCH = {
    "causal": "{n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 500, n_positions: 128}",
    "lora": "{n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 500, n_positions: 128}",
    "seq2seq": "{architecture: t5, n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 500}",
    "extractive": "{n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 1500, n_positions: 256}",
}
TRAIN = {
    "causal": "{epochs: 40, batch_size: 8, learning_rate: 3.0e-3, weight_decay: 0.0, warmup_steps: 10}",
    "lora": "{epochs: 3, batch_size: 8, learning_rate: 3.0e-3}",
    "seq2seq": "{epochs: 30, batch_size: 8, learning_rate: 3.0e-3, warmup_steps: 10}",
    "extractive": "{epochs: 3, batch_size: 16, learning_rate: 1.0e-3}",
}


def faq_rows(n: int = 40) -> list[dict[str, str]]:
    with open(FIXTURES / "faq100.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))[:n]


def xquad_rows() -> list[dict[str, str]]:
    with open(FIXTURES / "xquad_slice.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def train_run(kind: str, folder: Path, epochs: int | None = None) -> Path:
    """Train a tiny run of ``kind`` (causal, seq2seq, lora, extractive) into folder/kind; returns the run dir.
    ``epochs``: fewer than TRAIN says, for tests that need the run's shape (tokenizer, positions) but not what it
    learns."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "extractive":
        data = FIXTURES / "xquad_slice.csv"
        task = "task: extractive\ndata: {train_file: %s, context_column: context, max_length: 128, doc_stride: 32}\n"
    else:
        data = folder / "faq40.csv"
        with open(data, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["question", "answer"])
            writer.writeheader()
            writer.writerows(faq_rows())
        task = "task: generative\ndata: {train_file: %s}\n"
    lora = "  lora: {r: 8, alpha: 16, dropout: 0.0}\n" if kind == "lora" else ""
    train = TRAIN[kind] if epochs is None else re.sub(r"epochs: \d+", f"epochs: {epochs}", TRAIN[kind])
    config = folder / f"{kind}.yaml"
    config.write_text(f"seed: 1\n{task % data}model:\n  scratch: {SCRATCH[kind]}\n{lora}train: {train}\n",
                      encoding="utf-8")
    cli_ok("train", "--config", config, "--output-dir", folder / kind, "--quiet")
    return folder / kind


class QatuneProcess:
    """``qatune ARGS...`` (serve or ui, given ``--port 0``) in a child process; ``url`` once it listens and answers
    GET /health, ``link`` the whole link it printed (qatune ui's carries its token), ``log`` its stderr lines."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.process = subprocess.Popen([sys.executable, "-m", "qatune", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        self.url = self.link = ""
        listening = threading.Event()

        def read() -> None:
            for line in self.process.stderr:
                self.log.append(line)
                found = re.search(r"at (http://127\.0\.0\.1:\d+)/(\?token=[\w-]+)?", line)
                if found:
                    self.url, self.link = found.group(1), found.group(0).removeprefix("at ")
                    listening.set()
            listening.set()

        threading.Thread(target=read, daemon=True).start()
        if not listening.wait(120) or not self.url or not self._answers(60):
            self.process.kill()
            raise AssertionError(f"qatune {args[0]} did not start:\n" + "".join(self.log))

    def _answers(self, timeout: float) -> bool:
        """Wait for an answer to GET /health: the start line comes before the event loop runs, and a Ctrl-C in between
        (a test that stops at once, e.g. skipped) would be an interrupted start-up, not a shutdown."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return True
            except urllib.error.HTTPError:  # answered, with an error (an --api-key server wants the key)
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C, then the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


class ServerProcess(QatuneProcess):
    """``qatune serve RUN --port 0 ...`` in a child process, once it answers."""

    def __init__(self, run: Path, *args: str):
        super().__init__("serve", str(run), "--port", "0", *args)
