"""The shipped configs/smollm2-qa.yaml run, exported as GGUF (F16 and Q8_0), scored as the run is.

1. Trains configs/smollm2-qa.yaml as shipped (or takes --run, a finished run of it).
2. qatune export RUN --gguf at each --quant, with the export's own check on the run's held-out rows (its
   line and JSON are kept).
3. Greedy answers on the held-out XQuAD rows (examples/data/xquad_eval.csv) from the run, from each file read
   by transformers' GGUF loader, and from each file run by llama.cpp (llama-cpp-python) on the prompt text
   qatune renders: EM/F1 of each, and the share of answers identical to the run's (and, for llama.cpp, to
   transformers' reading of the same file). Everything in fp32 on the qatune side (generate.precision fp32),
   as the export's check compares.

llama.cpp: llama-cpp-python compiles llama.cpp when installed (minutes on 2 cores). It is used when it can
be imported; --install-llama-cpp installs it first (pip install llama-cpp-python). When it cannot be had,
the JSON says why and the rest is still measured.

Writes bench/results/<this machine>/gguf_export.json.

    python bench/quality/gguf_export.py                                   # train, export, score (~25 min on 2 cores)
    python bench/quality/gguf_export.py --run runs/smollm2-qa --eval-rows 50 --json /tmp/gguf.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import ROOT, describe, headline, json_option, results_path, write_json

STEM = "gguf_export"
EVAL_FILE = ROOT / "examples" / "data" / "xquad_eval.csv"


def llama_cpp_module(install: bool) -> tuple[object | None, str | None]:
    """llama_cpp, or None and why not."""
    try:
        import llama_cpp

        return llama_cpp, None
    except ImportError:
        if not install:
            return None, "llama-cpp-python is not installed (pass --install-llama-cpp to build it)"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python>=0.3"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        return None, "pip install llama-cpp-python failed: " + " | ".join(tail)
    print(f"llama-cpp-python built and installed in {time.perf_counter() - start:.0f} s", flush=True)
    import llama_cpp

    return llama_cpp, None


def llama_cpp_answers(llama_cpp: object, file: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of llama.cpp to prompt texts (special tokens in the text are parsed as special)."""
    llm = llama_cpp.Llama(model_path=str(file), n_ctx=4096, n_threads=os.cpu_count(), verbose=False)
    try:
        answers = []
        for prompt in prompts:
            out = llm.create_completion(prompt, max_tokens=max_new_tokens, temperature=0.0, top_k=1, seed=0)
            answers.append(out["choices"][0]["text"].strip())
        return answers
    finally:
        llm.close()


def shares(answers: list[str], reference: list[str]) -> dict[str, object]:
    same = sum(a == b for a, b in zip(answers, reference, strict=True))
    return {"identical": same, "of": len(reference), "share": round(same / len(reference), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None, help="A finished run of configs/smollm2-qa.yaml (default: train one).")
    parser.add_argument("--quant", nargs="+", default=["f16", "q8_0"], choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--eval-rows", type=int, default=200, help="Held-out rows scored (xquad_eval.csv has 200).")
    parser.add_argument("--check-rows", type=int, default=200, help="Rows of the export's own check.")
    parser.add_argument("--install-llama-cpp", action="store_true", help="pip install llama-cpp-python if missing.")
    parser.add_argument("--work-dir", default=None, help="Where the run and the files go (default: a temporary "
                        "folder).")
    json_option(parser, STEM)
    args = parser.parse_args()

    import logging

    import torch

    from qatune.config import GenerateConfig, load_config
    from qatune.data.spreadsheet import load_from_config
    from qatune.data.templates import PromptTemplate
    from qatune.export.gguf import export_gguf
    from qatune.inference.metrics import corpus_scores
    from qatune.kinds import answer_questions
    from qatune.model.folder import load_model_folder
    from qatune.model.gguf_file import load_gguf_run
    from qatune.train import train

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gguf-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"cpu": {**describe(), "torch_threads": torch.get_num_threads(),
                                         "torch": torch.__version__,
                                         "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}}
    print(headline(result["cpu"]), flush=True)

    if args.run:
        run = Path(args.run)
        result["run"] = {"dir": str(run), "trained_here": False}
    else:
        config = load_config(ROOT / "configs" / "smollm2-qa.yaml", [f"output_dir={work / 'smollm2-qa'}"])
        start = time.perf_counter()
        run = train(config, overwrite=True, progress=False)
        result["run"] = {"config": "configs/smollm2-qa.yaml as shipped (output_dir overridden)", "trained_here": True,
                         "train_wall_s": round(time.perf_counter() - start)}

    loaded = load_model_folder(run, device="cpu")
    data = loaded.config.data
    records, _ = load_from_config(data, EVAL_FILE, with_context=True)
    records = records[: args.eval_rows]
    golds = [r.answers for r in records]
    questions, contexts = [r.question for r in records], [r.context for r in records]
    generate = GenerateConfig(max_new_tokens=loaded.config.generate.max_new_tokens, temperature=0.0,
                              precision="fp32")
    template = PromptTemplate(loaded.info.prompt_template, loaded.info.answer_prefix)
    prompts = [template.render(q, c) for q, c in zip(questions, contexts, strict=True)]
    start = time.perf_counter()
    run_answers = answer_questions(loaded.model, loaded.tokenizer, loaded.info, questions, contexts, generate)
    result["eval"] = {"file": str(EVAL_FILE.relative_to(ROOT)), "rows": len(records),
                      "generate": "greedy, fp32, max_new_tokens " + str(generate.max_new_tokens)}
    result["run_scores"] = {**{k: round(v, 2) for k, v in corpus_scores(run_answers, golds).items()},
                            "wall_s": round(time.perf_counter() - start)}
    print(f"run: {result['run_scores']}", flush=True)
    del loaded

    llama_cpp, why_not = llama_cpp_module(args.install_llama_cpp)
    result["llama_cpp"] = ({"version": llama_cpp.__version__} if llama_cpp is not None else {"unavailable": why_not})
    exports = {}
    for quant in args.quant:
        path = work / f"smollm2-qa-{quant}.gguf"
        path.unlink(missing_ok=True)
        path.with_suffix(".Modelfile").unlink(missing_ok=True)
        start = time.perf_counter()
        _, check = export_gguf(run, path, quant, rows=args.check_rows)
        entry: dict[str, object] = {"bytes": path.stat().st_size, "export_wall_s": round(time.perf_counter() - start),
                                    "check": check.to_dict()}
        print(f"{quant}: {path.stat().st_size / 1e6:.0f} MB; export check: {check.line()}", flush=True)
        exported = load_gguf_run(path, device="cpu")
        start = time.perf_counter()
        answers = answer_questions(exported.model, exported.tokenizer, exported.info, questions, contexts, generate)
        entry["transformers"] = {**{k: round(v, 2) for k, v in corpus_scores(answers, golds).items()},
                                 "same_as_run": shares(answers, run_answers),
                                 "wall_s": round(time.perf_counter() - start)}
        print(f"{quant} via transformers: {entry['transformers']}", flush=True)
        del exported
        if llama_cpp is not None:
            start = time.perf_counter()
            native = llama_cpp_answers(llama_cpp, path, prompts, generate.max_new_tokens)
            entry["llama_cpp"] = {**{k: round(v, 2) for k, v in corpus_scores(native, golds).items()},
                                  "same_as_run": shares(native, run_answers),
                                  "same_as_transformers_on_the_file": shares(native, answers),
                                  "wall_s": round(time.perf_counter() - start),
                                  "first_differences_from_run": [
                                      {"question": q, "run": a, "llama_cpp": b}
                                      for q, a, b in zip(questions, run_answers, native, strict=True) if a != b][:3]}
            print(f"{quant} via llama.cpp: {entry['llama_cpp']['exact_match']} EM, {entry['llama_cpp']['f1']} F1, "
                  f"same as run {entry['llama_cpp']['same_as_run']}", flush=True)
        exports[quant] = entry
    result["exports"] = exports
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["note"] = ("qatune answers are stripped of surrounding whitespace, and so are llama.cpp's here; wall times "
                      "move with what else runs on the machine (see the load averages)")
    write_json(Path(args.json) if args.json else results_path(STEM), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
