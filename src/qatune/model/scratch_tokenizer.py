"""The tokenizer of a model built from scratch (``model.scratch``), trained on the run's own texts: byte-level BPE
for GPT-2, Unigram for T5, WordPiece for BERT; the same texts give the same vocabulary in every process."""

from __future__ import annotations

from typing import Any

from qatune.model.sources import BERT_SPECIALS, GPT2_SPECIAL, T5_SPECIALS
from qatune.tasks import task_kind


def train_scratch_tokenizer(task: str, texts: list[str], vocab_size: int, architecture: str = "auto") -> Any:
    """Byte-level BPE (GPT-2), Unigram (T5) or WordPiece (BERT) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if architecture == "t5":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=T5_SPECIALS, unk_token="<unk>",
                                          show_progress=False)
        tok.train_from_iterator(texts, trainer)
        tok.model = _canonical_unigram(tok)
        eos = tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                           special_tokens=[("</s>", eos)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    if task_kind(task).writes:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT2_SPECIAL],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer)
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=GPT2_SPECIAL, eos_token=GPT2_SPECIAL,
                                       unk_token=GPT2_SPECIAL, pad_token=GPT2_SPECIAL)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    # The trainer numbers a word's inner pieces ('##a') in the order it meets the words, which changes from one
    # process to the next, and breaks ties between equally frequent merges by those numbers: the same texts gave
    # a different vocabulary each run. Numbering the pieces first, as special tokens, makes it one vocabulary; the
    # model is then rebuilt from the vocabulary alone, so the pieces are ordinary tokens again.
    alphabet = sorted({char for text in texts for char in tok.normalizer.normalize_str(text) if not char.isspace()})
    pieces = [f"##{char}" for char in alphabet]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIALS + pieces,
                                        initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    vocab = tok.get_vocab(with_added_tokens=False)
    trained, tok = tok, Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = trained.normalizer, trained.pre_tokenizer, trained.decoder
    tok.add_special_tokens(BERT_SPECIALS)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                   cls_token="[CLS]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def _canonical_unigram(tok: Any) -> Any:
    """The trained Unigram model with its pieces numbered the same way every run: the special tokens first, then
    by score and text (the trainer numbers them in an order that changes from one process to the next, and its
    scores differ in their last digits)."""
    import json

    from tokenizers import models

    trained = json.loads(tok.to_str())["model"]
    pieces = [(piece, round(score, 6)) for piece, score in trained["vocab"]]
    specials = [piece for piece in pieces if piece[0] in T5_SPECIALS]
    rest = sorted((piece for piece in pieces if piece[0] not in T5_SPECIALS), key=lambda p: (-p[1], p[0]))
    ordered = specials + rest
    return models.Unigram(ordered, unk_id=[piece for piece, _ in ordered].index("<unk>"), byte_fallback=False)
