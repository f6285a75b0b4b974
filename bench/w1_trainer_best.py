"""W1 as a person would write it with transformers.Trainer at its best: build the tokenizer and the
model, encode the rows (answer + EOS supervised, prompt -100), train one epoch, save the final model.

The same work as `qatune train` on W1 (bench/workloads.py; bench/w1_process_vs_trainer.py runs both as
whole processes): a byte-level BPE of 4,096 tokens trained on the rows, a GPT-2 6x512x8 from config, batch 16,
lr 5e-4, no weight decay, clipping at 1.0, length-grouped batches with dynamic padding, bf16 autocast where
bf16 is native (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX; else fp32), no checkpoints, no
evaluation, the final model saved as safetensors. It imports nothing of qatune.

    python bench/w1_trainer_best.py DATA.csv OUTPUT_DIR [--seed 42] [--fp32]
"""

import csv
import os
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    DataCollatorForSeq2Seq,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)
from workloads import W1, w1_trainer_arguments  # bench/ is on sys.path

EOS = "<|endoftext|>"


ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def native_bf16() -> bool:
    """A CUDA GPU's bf16, else the CPU's bf16 flags, unless oneDNN is held below them (bench_machine.AVX2_ONLY):
    bf16 is then emulated."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and cap.strip().upper() not in ONEDNN_WITHOUT_BF16


def main(data: str, output: str, seed: int, fp32: bool = False) -> None:
    with open(data, encoding="utf-8", newline="") as f:
        rows = [(r["question"].strip(), r["answer"].strip()) for r in csv.DictReader(f)]
    prompts = [f"Question: {q}\nAnswer:" for q, _ in rows]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.train_from_iterator([p + " " + a for p, (_, a) in zip(prompts, rows)], trainers.BpeTrainer(
        vocab_size=W1.vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                        pad_token=EOS)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=W1.positions, n_embd=W1.width,
                                       n_layer=W1.layers, n_head=W1.heads,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id))
    prompt_ids = tokenizer(prompts)["input_ids"]
    answer_ids = tokenizer([" " + a for _, a in rows], add_special_tokens=False)["input_ids"]
    features = []
    for p, a in zip(prompt_ids, answer_ids):
        ids = p + a + [tokenizer.eos_token_id]
        features.append({"input_ids": ids, "labels": [-100] * len(p) + ids[len(p):]})
    args = TrainingArguments(**w1_trainer_arguments(output, seed, native_bf16() and not fp32))
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
    trainer = Trainer(model=model, args=args, train_dataset=features, data_collator=collator,
                      processing_class=tokenizer)
    trainer.train()
    trainer.save_model(output)
    # What it chose, for bench/w1_process_vs_trainer.py to record (its stdout is not kept).
    (Path(output) / "precision.txt").write_text("bf16" if args.bf16 else "fp32", encoding="utf-8")


if __name__ == "__main__":
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 42
    main(sys.argv[1], sys.argv[2], seed, fp32="--fp32" in sys.argv)
