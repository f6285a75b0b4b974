"""`qatune serve` under load: N concurrent clients on loopback, batching on vs off.

Trains the offline demo model (configs/tiny-gpt2.yaml: GPT-2 2 layers x 256 from scratch, learns the
150 questions of examples/data/faq.csv) unless --run names a run, then, round by round, starts `qatune serve`
with batching (--max-batch-size 32) and without (--max-batch-size 1), the order alternating. For 1, 8 and 32
clients, each client asks the FAQ questions in turn (POST /v1/chat/completions, temperature 0, one request
after the other) for a fixed time; the script prints requests/s, p50/p99 latency and errors, and the ratio of
requests/s with batching to without at the most clients, per round. Then 32 clients keep the batched server
busy for --memory-seconds while its RSS is sampled every 2 s (is memory flat?).

    python bench/serve_load.py                 # 2 rounds, ~9 minutes on 2 CPU cores (no shared data needed)
    python bench/serve_load.py --run runs/tiny-gpt2 --rounds 1 --duration 10 --memory-seconds 30
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_machine import ROOT, alternating, describe, headline, results_path, write_json

STEM = "serve_load"


def libraries() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "fastapi", "uvicorn", "httptools", "uvloop"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def train_demo(folder: Path) -> Path:
    run = folder / "tiny-gpt2"
    print("training configs/tiny-gpt2.yaml (about a minute on 2 cores) ...", flush=True)
    subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(ROOT / "configs" / "tiny-gpt2.yaml"),
                    "--output-dir", str(run), "--quiet", "--set", f"data.train_file={ROOT / 'examples/data/faq.csv'}"],
                   check=True, env=_env(), stdout=subprocess.DEVNULL)
    return run


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class Server:
    """`qatune serve RUN --port 0 ...` in a child process."""

    def __init__(self, run: Path, *args: str):
        self.process = subprocess.Popen([sys.executable, "-m", "qatune", "serve", str(run), "--port", "0", *args],
                                        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
        self.url = ""
        self.log: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.process.stderr:
                self.log.append(line)
                found = re.search(r"at (http://127\.0\.0\.1:\d+)/", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or not self.url:
            self.process.kill()
            raise RuntimeError("qatune serve did not start:\n" + "".join(self.log))

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> int:
        self.process.send_signal(2)
        return self.process.wait(120)


def load(url: str, model: str, questions: list[str], clients: int, seconds: float,
         on_tick: Callable[[], None] | None = None) -> dict[str, object]:
    """`clients` threads, each asking one request after another for `seconds` over its own keep-alive
    connection (the standard library's http.client: a fifth of httpx's CPU per request, which matters
    when client and server share two cores)."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.perf_counter() + seconds

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        i = index
        while time.perf_counter() < deadline:
            body = json.dumps({"model": model, "temperature": 0,
                               "messages": [{"role": "user", "content": questions[i % len(questions)]}]})
            i += clients
            start = time.perf_counter()
            try:
                connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                payload = response.read()
                if response.status != 200 or json.loads(payload)["choices"][0]["message"]["content"] is None:
                    errors.append(f"{response.status}: {payload[:200]!r}")
                    continue
            except (OSError, http.client.HTTPException, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                connection.close()
                connection = http.client.HTTPConnection(host, int(port), timeout=120)
                continue
            latencies.append(time.perf_counter() - start)  # list.append is atomic: no lock needed
        connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    while on_tick is not None and time.perf_counter() < deadline:
        time.sleep(2)
        on_tick()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")

    return {"clients": clients, "requests": len(latencies), "seconds": round(elapsed, 2),
            "requests_per_s": round(len(latencies) / elapsed, 2), "p50_ms": round(pct(0.50), 1),
            "p99_ms": round(pct(0.99), 1), "errors": len(errors), "first_errors": errors[:3]}


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models") as response:
        return json.load(response)["data"][0]["id"]


def measure(run: Path, label: str, server_args: list[str], questions: list[str], client_counts: list[int],
            seconds: float) -> list[dict[str, object]]:
    server = Server(run, *server_args)
    model = model_id(server.url)
    load(server.url, model, questions, 4, 3)  # warm-up
    rows = []
    for clients in client_counts:
        row = {"batching": label, **load(server.url, model, questions, clients, seconds)}
        print(f"  {label:<4} {clients:>3} clients: {row['requests_per_s']:>7.1f} req/s  p50 {row['p50_ms']:>7.1f} ms  "
              f"p99 {row['p99_ms']:>7.1f} ms  errors {row['errors']}", flush=True)
        rows.append(row)
    code = server.stop()
    if code != 0:
        raise RuntimeError(f"qatune serve exited {code}:\n" + "".join(server.log))
    return rows


def memory_run(run: Path, questions: list[str], seconds: float, threads: str) -> dict[str, object]:
    server = Server(run, "--max-batch-size", "32", "--threads", threads)
    model = model_id(server.url)
    samples = [(0.0, server.rss_mb())]
    started = time.perf_counter()
    result = load(server.url, model, questions, 32, seconds,
                  on_tick=lambda: samples.append((time.perf_counter() - started, server.rss_mb())))
    server.stop()
    loaded = [mb for t, mb in samples if t > 0]
    first, last = loaded[: max(1, len(loaded) // 6)], loaded[-max(1, len(loaded) // 6):]
    return {"seconds": seconds, "clients": 32, "requests": result["requests"], "errors": result["errors"],
            "rss_mb_idle": round(samples[0][1], 1), "rss_mb_first_sixth": round(statistics.mean(first), 1),
            "rss_mb_last_sixth": round(statistics.mean(last), 1), "rss_mb_max": round(max(loaded), 1),
            "rss_mb_samples": [round(mb, 1) for _, mb in samples]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=None, help="A trained run (default: train the demo model).")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (batching on and off once each)")
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds per measurement.")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--memory-seconds", type=float, default=120.0)
    parser.add_argument("--threads", default="1", help="qatune serve --threads (1: client and server share 2 cores).")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help=f"where to write the results (default: bench/results/<this machine>/{STEM}.json)")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]

    info = {**describe(), "load_average_at_start": os.getloadavg()}
    print(f"{headline(info)}; load average at start {info['load_average_at_start']} (on a machine shared with "
          "other jobs absolute numbers are noisy)", flush=True)
    with open(ROOT / "examples" / "data" / "faq.csv", encoding="utf-8", newline="") as f:
        questions = [row["question"] for row in csv.DictReader(f)]
    batch_sizes = {"on": "32", "off": "1"}
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or train_demo(Path(tmp))
        for round_, label in alternating(args.rounds, ["on", "off"]):
            print(f"round {round_ + 1}, batching {label}:", flush=True)
            measured = measure(run, label, ["--max-batch-size", batch_sizes[label], "--threads", args.threads],
                               questions, counts, args.duration)
            rows += [{"round": round_ + 1, **row} for row in measured]
        print(f"memory: 32 clients on the batched server for {args.memory_seconds:.0f} s ...", flush=True)
        memory = memory_run(run, questions, args.memory_seconds, args.threads)

    def median_of(label: str, clients: int, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["batching"] == label and r["clients"] == clients)

    top = max(counts)
    speedups = [next(r["requests_per_s"] for r in rows if r["round"] == n and r["batching"] == "on"
                     and r["clients"] == top) / max(next(r["requests_per_s"] for r in rows if r["round"] == n
                                                         and r["batching"] == "off" and r["clients"] == top), 1e-9)
                for n in range(1, args.rounds + 1)]
    print()
    print("| clients | batching | requests/s | p50 ms | p99 ms | errors |")
    print("|---:|---|---:|---:|---:|---:|")
    for clients in counts:
        for label in ("on", "off"):
            errors = sum(r["errors"] for r in rows if r["batching"] == label and r["clients"] == clients)
            print(f"| {clients} | {label} | {median_of(label, clients, 'requests_per_s'):.1f} | "
                  f"{median_of(label, clients, 'p50_ms'):.1f} | {median_of(label, clients, 'p99_ms'):.1f} | "
                  f"{errors} |")
    print(f"\n{top} clients: batching gives {', '.join(f'x{r:.2f}' for r in speedups)} the requests/s of batching "
          f"off per round (median x{statistics.median(speedups):.2f}; the table holds the medians of the rounds)")
    print(f"memory over {memory['seconds']:.0f} s at 32 clients ({memory['requests']} requests, {memory['errors']} "
          f"errors): server RSS {memory['rss_mb_idle']} MB idle, {memory['rss_mb_first_sixth']} MB in the first "
          f"sixth, {memory['rss_mb_last_sixth']} MB in the last sixth, max {memory['rss_mb_max']} MB")
    info["load_average_at_end"] = os.getloadavg()
    write_json(args.json or results_path(STEM), {
        "benchmark": "serve", "machine": info, "libraries": libraries(),
        "model": "configs/tiny-gpt2.yaml" if args.run is None else str(args.run),
        "seconds_per_measurement": args.duration, "server_threads": int(args.threads), "rounds": args.rounds,
        "results": rows, f"speedups_at_{top}_clients": speedups,
        f"speedup_at_{top}_clients": round(statistics.median(speedups), 2), "memory": memory,
        "python": platform.python_version(),
        "note": "client and server share the machine's cores; ratios between the arms are more reliable than "
                "absolute numbers"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
