"""Does llama.cpp read what qatune writes, family by family? For each model family of the tests' matrix
(tests/families.py: a tiny random model built from the family's transformers config, with a byte-level BPE of the
family's kind and its own chat template), and for the packaged pretrained models installed here (real weights):

1. trains a run on the fixture's reading-comprehension rows (``qatune train``; a few steps for a pretrained model);
2. exports it with ``qatune export RUN --gguf`` in f16 and q8_0, each with export's default check;
3. starts llama.cpp's own server on each file (built once from the llama.cpp source that the llama-cpp-python sdist
   vendors, into ~/.cache/qatune/llama.cpp) and asks it:
   - its tokenizer, on 50 texts (numbers, accents, whitespace runs, CJK, emoji, the held-out questions): the same
     ids as the run's tokenizer (POST /tokenize);
   - its greedy answers to 50 held-out prompts (the run's prompt ids, POST /completion at temperature 0) against
     the run's own greedy answers (transformers, fp32, free decoding);
   - the chat way a user asks it (POST /v1/chat/completions with the passage as the system message and the question
     as the user message, rendered by the chat template the file carries): its prompt against qatune's, byte for
     byte (POST /apply-template), and its answers against the run's.

A family that export refuses is recorded with its one-line reason. Writes
bench/results/<this machine>/llama_cpp_families.json.

    python bench/llama_cpp_families.py                              # every family, and the packaged models installed
    python bench/llama_cpp_families.py --families llama3 qwen3 --no-real
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, results_path, write_json
from gguf_check_and_server import build_llama_server, post, start_server

sys.path.insert(0, str(ROOT))
from tests.families import CASES, answer_sentence_rows, family_folder, sheet_rows, write_config, write_sheet

STEM = "llama_cpp_families"
HELD_OUT = ROOT / "examples" / "data" / "xquad_eval.csv"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qatune" / "llama.cpp"
REAL = {  # packaged name: (epochs, learning rate, max_length) of its few steps of training
    "smollm2-135m-instruct": (1, 1.0e-4, 384),
    "gemma3-270m": (1, 1.0e-4, 384),
}
TEXTS = [
    "In 1987, 3.14159 of 1,000,000 people paid $42.50 (or €39,99) on 2024-02-29 at 23:59:59.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 10000 123456789 -7 +8 1e-5 0x1F 2^10",
    "Café crème à Zürich: naïve façade, jalapeño, Ærøskøbing, Łódź, São Paulo, déjà vu.",
    "Ελληνικά, русский язык, עברית, العربية, हिन्दी",
    "a  b   c    d\t\te\n\nf\n\n\n g     h",
    "   leading spaces and trailing ones   ",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🙂👍🏽 family 👨‍👩‍👧 flags 🇵🇱🇯🇵 and ✨ sparkles ✨",
    "URLs https://example.org/a?b=c&d=e#f and e-mail someone@example.com",
    "Code: def f(x):\n    return x ** 2  # squares\n",
    "Quotes “curly” ‘single’ «guillemets» — dashes – and … ellipses",
    "MiXeD CaSe WORDS and snake_case_names and CamelCaseNames",
    "don't can't won't I'm you're it's y'all o'clock",
    "Tabs\there\tand\tthere; carriage\r\nreturns",
    "Zero-width joiner\u200dand non-breaking\u00a0space",
]


def qatune(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "qatune", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=env)


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


def train(name: str, model: str, work: Path, train_file: Path, real: tuple[int, float, int] | None) -> Path:
    """A run of ``model`` on the training rows: a tiny model until it has learnt them, a pretrained one a few steps."""
    epochs, learning_rate, max_length = real or (60, 1.0e-2, 256)
    config = write_config(work / "config.yaml", model, train_file, work / "run", epochs=epochs,
                          learning_rate=learning_rate, data={"max_length": max_length},
                          generate={"max_new_tokens": 16, "grounded": "off"})
    started = time.perf_counter()
    done = qatune("train", "--config", config, "--quiet")
    if done.returncode != 0:
        raise RuntimeError(f"{name}: qatune train failed: {last_line(done)}")
    print(f"  trained in {time.perf_counter() - started:.0f} s", flush=True)
    return work / "run"


def export(run: Path, quant: str, held_out: Path) -> tuple[Path | None, dict]:
    file = run.parent / f"{quant}.gguf"
    started = time.perf_counter()
    done = qatune("export", run, "--gguf", file, "--quant", quant, "--data", held_out)
    said = {"quant": quant, "wall_s": round(time.perf_counter() - started, 1), "exit": done.returncode,
            "line": last_line(done)}
    if done.returncode != 0:
        return None, said
    return file, {**said, "bytes": file.stat().st_size}


def run_side(run: Path, records: list, texts: list[str]) -> dict:
    """The run's own tokenizer ids of ``texts``, prompt ids of the held-out rows and greedy answers (fp32)."""
    from qatune.config import GenerateConfig
    from qatune.data.generative import PromptEncoder
    from qatune.data.templates import PromptTemplate
    from qatune.kinds import answer_questions
    from qatune.model.folder import load_model_folder

    loaded = load_model_folder(run, device="cpu")
    template = PromptTemplate(loaded.info.prompt_template, loaded.info.answer_prefix)
    encoder = PromptEncoder(loaded.tokenizer, template)
    generate = GenerateConfig(max_new_tokens=loaded.config.generate.max_new_tokens, temperature=0.0, precision="fp32",
                              grounded="off")
    answers = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r["question"] for r in records],
                               [r["context"] for r in records], generate)
    return {"ids": [loaded.tokenizer.encode(t, add_special_tokens=False) for t in texts],
            "prompt_ids": [encoder.prompt_ids(r["question"], r["context"]) for r in records],
            "prompts": [template.render(r["question"], r["context"]) for r in records],
            "answers": answers, "max_new_tokens": generate.max_new_tokens, "bos": loaded.tokenizer.bos_token or ""}


def share(same: int, of: int) -> dict:
    return {"identical": same, "of": of, "share": round(same / of, 4) if of else None}


def server_context(run: Path) -> int:
    """llama-server's context for a run: 4096, or a longrope model's original context where that is shorter (llama.cpp
    takes the long rope factors whenever its context exceeds it; transformers by the sequence's length)."""
    config = json.loads((run / "final" / "config.json").read_text(encoding="utf-8"))
    original = (config.get("rope_scaling") or {}).get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings")
    return min(4096, original) if original else 4096


def ask_llama(binary: Path, file: Path, side: dict, records: list, texts: list[str], chat: bool,
              context: int = 4096) -> dict:
    server, url = start_server(binary, file, file.with_suffix(".log"), context)
    try:
        found: dict = {}
        if texts:
            ids = [post(f"{url}/tokenize", {"content": t, "add_special": False})["tokens"] for t in texts]
            found["tokenizer"] = {**share(sum(a == b for a, b in zip(ids, side["ids"])), len(texts)),
                                  "first_differences": [{"text": t, "qatune": b, "llama_cpp": a} for t, a, b in
                                                        zip(texts, ids, side["ids"]) if a != b][:3]}
        answers = [post(f"{url}/completion", {"prompt": ids, "n_predict": side["max_new_tokens"], "temperature": 0.0,
                                              "top_k": 1, "cache_prompt": False})["content"].strip()
                   for ids in side["prompt_ids"]]
        found["answers_from_prompt_ids"] = {
            **share(sum(a == b for a, b in zip(answers, side["answers"])), len(records)),
            "first_differences": [{"question": r["question"], "run": b, "llama_cpp": a} for r, a, b in
                                  zip(records, answers, side["answers"]) if a != b][:3]}
        if chat:
            rendered, replies = [], []
            for r in records:
                messages = [{"role": "system", "content": r["context"]}, {"role": "user", "content": r["question"]}]
                rendered.append(post(f"{url}/apply-template", {"messages": messages})["prompt"])
                reply = post(f"{url}/v1/chat/completions", {"messages": messages, "temperature": 0.0, "seed": 0,
                                                             "max_tokens": side["max_new_tokens"]})
                replies.append((reply["choices"][0]["message"]["content"] or "").strip())
            # llama.cpp leaves out of the rendered text the BOS its tokenizer adds as a token (a template that
            # writes {{ bos_token }}, as Gemma's does): the same prompt once tokenized.
            bos = side["bos"]
            same = [a == b or (bool(bos) and b.startswith(bos) and a == b[len(bos):])
                    for a, b in zip(rendered, side["prompts"])]
            found["chat_prompt_as_qatune"] = {
                **share(sum(same), len(records)),
                "without_the_bos_text": sum(a != b for a, b, ok in zip(rendered, side["prompts"], same) if ok),
                "first_differences": [{"qatune": b, "llama_cpp": a} for a, b, ok in
                                      zip(rendered, side["prompts"], same) if not ok][:2]}
            found["chat_answers"] = {
                **share(sum(a == b for a, b in zip(replies, side["answers"])), len(records)),
                "first_differences": [{"question": r["question"], "run": b, "llama_cpp": a} for r, a, b in
                                      zip(records, replies, side["answers"]) if a != b][:3]}
        return found
    finally:
        server.terminate()
        server.wait(timeout=60)


def one(name: str, model: str, work: Path, binary: Path, train_file: Path, held_out: Path, records: list,
        texts: list[str], real: tuple[int, float, int] | None) -> dict:
    print(f"{name}:", flush=True)
    result: dict = {"family": name, "model": "packaged " + model if real else "tiny random (tests/families.py)"}
    try:
        run = train(name, model, work, train_file, real)
    except RuntimeError as error:
        return {**result, "error": str(error)}
    side = run_side(run, records, texts)
    context = server_context(run)
    if context != 4096:
        result["llama_server_context"] = context
    for quant in ("f16", "q8_0"):
        file, said = export(run, quant, held_out)
        result[quant] = {"export": said}
        if file is None:
            print(f"  {quant}: not written: {said['line']}", flush=True)
            continue
        result[quant].update(ask_llama(binary, file, side, records, texts if quant == "f16" else [],
                                       chat=quant == "f16", context=context))
        shown = {key: f"{value['identical']}/{value['of']}" for key, value in result[quant].items()
                 if isinstance(value, dict) and "of" in value}
        print(f"  {quant}: {shown}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=[c.id for c in CASES], choices=[c.id for c in CASES])
    parser.add_argument("--no-real", action="store_true", help="Leave out the packaged pretrained models.")
    parser.add_argument("--rows", type=int, default=50, help="Held-out prompts asked.")
    parser.add_argument("--llama-server", type=Path, default=None, help="A built llama-server (default: build it "
                        f"once into {CACHE}).")
    json_option(parser, STEM)
    args = parser.parse_args()

    from qatune.model.packaged import installed_packaged_models

    info = describe()
    print(headline(info), flush=True)
    if args.llama_server:
        binary, built = args.llama_server, {"from": "a llama-server built elsewhere"}
    else:
        downloaded = Path.home() / ".cache" / "qatune" / "sdist"
        CACHE.mkdir(parents=True, exist_ok=True)
        for sdist in downloaded.glob("llama_cpp_python-*.tar.gz"):   # a copy already downloaded: no second download
            if not (CACHE / sdist.name).exists():
                shutil.copy(sdist, CACHE / sdist.name)
        binary, built = build_llama_server(CACHE)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    built["version"] = (version.stdout + version.stderr).strip().splitlines()[0]
    records = answer_sentence_rows(HELD_OUT, args.rows)
    texts = (TEXTS + [r["question"] for r in records])[:50]
    results = []
    with tempfile.TemporaryDirectory(prefix="qatune-llama-cpp-") as folder:
        work = Path(folder)
        train_file = write_sheet(work / "train.csv", sheet_rows(1000))
        held_out = write_sheet(work / "held-out.csv", records)
        for case in [c for c in CASES if c.id in args.families]:
            (work / case.id).mkdir()
            model = family_folder(case, work / case.id / "model")
            results.append(one(case.id, str(model), work / case.id, binary, train_file, held_out, records, texts,
                               None))
        installed = installed_packaged_models()
        for name, steps in ([] if args.no_real else [(n, s) for n, s in REAL.items() if n in installed]):
            (work / name).mkdir()
            results.append(one(name, name, work / name, binary, train_file, held_out, records, texts, steps))
    write_json(args.json or results_path(STEM), {
        "machine": info, "llama_cpp": built, "held_out": {"file": str(HELD_OUT.relative_to(ROOT)), "rows": len(records),
                                                          "cut": "the passage cut to the sentence holding the answer"},
        "texts": len(texts), "training_rows": len(sheet_rows(1000)),
        "note": "answers are stripped of surrounding whitespace on both sides; the run answers through transformers "
                "in fp32 with free decoding, llama.cpp from the file at temperature 0",
        "results": results})


if __name__ == "__main__":
    main()
