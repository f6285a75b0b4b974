"""The shipped configs/smollm2-qa.yaml run exported as GGUF (F16): how long `qatune export` takes with its
default check, and the file asked through llama.cpp's own server with the chat template it carries.

1. Trains configs/smollm2-qa.yaml as shipped (or takes --run, a finished run of it).
2. Times `qatune export RUN --gguf F16.gguf` as a whole process, with its default check (its line and JSON are
   kept), once the machine is quiet: it waits until the 1-minute load average is at most --max-load (up to
   --wait-min minutes) and records the load averages at start and end of each timing.
3. Builds `llama-server` from the llama.cpp source the llama-cpp-python sdist vendors (pip download, cmake,
   only that target, CPU only, no curl) into --build-dir, outside the repository, unless --llama-server names a
   built one; starts it on the F16 file with --jinja, so that it renders prompts with the file's chat template.
4. On --rows held-out rows of examples/data/xquad_eval.csv: the prompt llama-server renders from the chat (the
   passage as the system message, the question as the user message; POST /apply-template) against qatune's
   prompt, byte for byte; and its answer at temperature 0 (POST /v1/chat/completions) against the run's own
   greedy answer (transformers, fp32): the share identical.

Writes bench/results/<this machine>/gguf_check_and_server.json.

    python bench/gguf_check_and_server.py                          # train (~10 min on 2 cores), build (~10 min), ask
    python bench/gguf_check_and_server.py --run runs/smollm2-qa --llama-server /work/llama-build/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, results_path, write_json

STEM = "gguf_check_and_server"
EVAL_FILE = ROOT / "examples" / "data" / "xquad_eval.csv"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_for_quiet(max_load: float, minutes: float) -> list[float]:
    """Wait until the 1-minute load average is at most ``max_load`` (at most ``minutes``); the load found."""
    deadline = time.monotonic() + 60 * minutes
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(15)
    return load()


def qatune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qatune", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **CHILD_ENV})


def as_shipped(run: Path) -> bool:
    """Whether the run's config is configs/smollm2-qa.yaml's, but for where the run went."""
    from qatune.config import load_config
    from qatune.model.folder import read_model_folder

    shipped = load_config(ROOT / "configs" / "smollm2-qa.yaml").model_dump()
    used = read_model_folder(run / "final")[0].model_dump()
    return {**used, "output_dir": None} == {**shipped, "output_dir": None}


def timed_export(run: Path, path: Path) -> dict[str, object]:
    """`qatune export RUN --gguf PATH` (f16, the default check) as a whole process: wall time, load averages,
    the check's line and JSON."""
    for stale in (path, path.with_suffix(".Modelfile")):
        stale.unlink(missing_ok=True)
    at_start = load()
    start = time.perf_counter()
    done = qatune("export", str(run), "--gguf", str(path))
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"qatune export failed:\n{done.stderr[-3000:]}")
    line = next(x for x in done.stderr.splitlines() if x.startswith("check on "))
    check = json.loads((run / f"export-{path.stem}.json").read_text(encoding="utf-8"))
    return {"wall_s": round(wall, 1), "load_average_at_start": at_start, "load_average_at_end": load(),
            "line": line, "check": check}


def build_llama_server(folder: Path) -> tuple[Path, dict[str, object]]:
    """llama-server built from the llama.cpp source of the llama-cpp-python sdist, in ``folder``."""
    binary = folder / "build" / "bin" / "llama-server"
    sdists = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
    info: dict[str, object] = {}
    if not binary.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        if not sdists:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "llama-cpp-python", "-d", str(folder)], check=True)
            sdists = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
        subprocess.run(["tar", "xzf", str(sdists[-1])], cwd=folder, check=True)
        source = folder / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
        start = time.perf_counter()
        subprocess.run(["cmake", "-S", str(source), "-B", str(folder / "build"), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True, capture_output=True)
        subprocess.run(["cmake", "--build", str(folder / "build"), "--target", "llama-server", "-j",
                        str(os.cpu_count())], check=True, capture_output=True)
        info["build_wall_s"] = round(time.perf_counter() - start)
    info["from"] = sdists[-1].name if sdists else "a llama-server built elsewhere"
    return binary, info


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def start_server(binary: Path, file: Path, log: Path, context: int = 4096) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([str(binary), "-m", str(file), "--jinja", "--host", "127.0.0.1", "--port", str(port),
                               "-c", str(context), "-np", "1", "-t", str(os.cpu_count()), "--no-webui"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"llama-server stopped (exit {server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if json.loads(reply.read()).get("status") == "ok":
                    return server, url
        except OSError:
            pass
        time.sleep(1)
    server.terminate()
    raise SystemExit(f"llama-server did not come up:\n{log.read_text()[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None, help="A finished run of configs/smollm2-qa.yaml (default: train one).")
    parser.add_argument("--rows", type=int, default=50, help="Held-out rows asked through llama-server.")
    parser.add_argument("--timings", type=int, default=1, help="How many times the export is timed.")
    parser.add_argument("--max-load", type=float, default=1.5, help="Time the export once the 1-minute load "
                        "average is at most this.")
    parser.add_argument("--wait-min", type=float, default=30.0, help="The longest wait for that, in minutes.")
    parser.add_argument("--llama-server", type=Path, default=None, help="A built llama-server (default: build it).")
    parser.add_argument("--build-dir", type=Path, default=Path.home() / ".cache" / "qatune-bench" / "llama.cpp",
                        help="Where llama-server is built (outside the repository).")
    parser.add_argument("--work-dir", default=None, help="Where the run and the file go (default: a temporary "
                        "folder).")
    json_option(parser, STEM)
    args = parser.parse_args()

    import torch

    from qatune.config import GenerateConfig
    from qatune.data.spreadsheet import load_from_config
    from qatune.data.templates import PromptTemplate
    from qatune.kinds import answer_questions
    from qatune.model.folder import load_model_folder

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gguf-server-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"cpu": {**describe(), "torch_threads": torch.get_num_threads(),
                                         "torch": torch.__version__}}
    print(headline(result["cpu"]), flush=True)

    if args.run:
        run = Path(args.run).resolve()
        result["run"] = {"dir": run.name, "trained_here": False, "config_as_shipped": as_shipped(run)}
    else:
        run = work / "smollm2-qa"
        start = time.perf_counter()
        done = qatune("train", "--config", "configs/smollm2-qa.yaml", "--output-dir", str(run), "--overwrite",
                      "--quiet")
        if done.returncode != 0:
            raise SystemExit(f"qatune train failed:\n{done.stderr[-3000:]}")
        result["run"] = {"config": "configs/smollm2-qa.yaml as shipped (output_dir overridden)", "trained_here": True,
                         "train_wall_s": round(time.perf_counter() - start)}

    f16 = work / "smollm2-qa-f16.gguf"
    timings = []
    for number in range(args.timings):
        quiet = wait_for_quiet(args.max_load, args.wait_min)
        print(f"export {number + 1}/{args.timings}: load average {quiet}", flush=True)
        timings.append(timed_export(run, f16))
        print(f"  {timings[-1]['wall_s']} s; {timings[-1]['line']}", flush=True)
    result["export"] = {"command": "qatune export RUN --gguf smollm2-qa-f16.gguf (f16, the default check)",
                        "bytes": f16.stat().st_size, "timings": timings,
                        "wall_s": [t["wall_s"] for t in timings]}

    loaded = load_model_folder(run, device="cpu")
    records, _ = load_from_config(loaded.config.data, EVAL_FILE, with_context=True)
    records = records[: args.rows]
    template = PromptTemplate(loaded.info.prompt_template, loaded.info.answer_prefix)
    generate = GenerateConfig(max_new_tokens=loaded.config.generate.max_new_tokens, temperature=0.0,
                              precision="fp32")
    run_answers = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r.question for r in records],
                                   [r.context for r in records], generate)
    del loaded

    if args.llama_server:
        binary = args.llama_server
        sdists = sorted(binary.resolve().parent.parent.parent.glob("llama_cpp_python-*.tar.gz"))  # DIR/build/bin
        server_info: dict[str, object] = {"from": sdists[-1].name if sdists else "a llama-server built elsewhere"}
    else:
        binary, server_info = build_llama_server(args.build_dir)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    server_info["version"] = (version.stdout + version.stderr).strip().splitlines()[0]
    server, url = start_server(binary, f16, work / "llama-server.log")
    try:
        same_prompt, answers, seconds = 0, [], []
        for record in records:
            messages = [{"role": "system", "content": record.context}, {"role": "user", "content": record.question}]
            rendered = post(f"{url}/apply-template", {"messages": messages})["prompt"]
            same_prompt += int(rendered == template.render(record.question, record.context))
            start = time.perf_counter()
            reply = post(f"{url}/v1/chat/completions", {"messages": messages, "temperature": 0.0, "seed": 0,
                                                           "max_tokens": generate.max_new_tokens})
            seconds.append(time.perf_counter() - start)
            answers.append((reply["choices"][0]["message"]["content"] or "").strip())
    finally:
        server.terminate()
        server.wait(timeout=60)
    same = sum(a == b for a, b in zip(answers, run_answers, strict=True))
    result["llama_server"] = {
        **server_info, "flags": "--jinja -c 4096 -np 1", "rows": len(records), "file": str(EVAL_FILE.relative_to(ROOT)),
        "request": "POST /v1/chat/completions: the passage as the system message, the question as the user message, "
                   f"temperature 0, max_tokens {generate.max_new_tokens}",
        "prompts_identical": {"identical": same_prompt, "of": len(records)},
        "same_as_run": {"identical": same, "of": len(records), "share": round(same / len(records), 4)},
        "seconds_per_answer": round(sum(seconds) / len(seconds), 2),
        "first_differences_from_run": [{"question": r.question, "run": a, "llama_server": b}
                                       for r, a, b in zip(records, run_answers, answers, strict=True) if a != b][:5]}
    print(f"llama-server --jinja: prompts identical {same_prompt}/{len(records)}, answers as the run's "
          f"{same}/{len(records)}", flush=True)
    result["note"] = ("answers are stripped of surrounding whitespace on both sides; the run answers through "
                      "transformers in fp32, llama-server from the F16 file; wall times move with what else runs "
                      "on the machine (see the load averages)")
    write_json(Path(args.json) if args.json else results_path(STEM), result)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
