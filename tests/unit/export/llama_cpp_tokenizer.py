"""llama.cpp's SentencePiece tokenizer (src/llama-vocab.cpp, llm_tokenizer_spm), written again in Python: what a
GGUF file's tokens and scores make llama.cpp write for a text, without llama.cpp. The GGUF tests and
bench/quality/gemma3_270m_gguf.py hold qatune's tokenizer to it."""

from __future__ import annotations

import heapq


def sentencepiece_ids(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm) on text without special tokens, given the file's tokens'
    ids (token -> id) and scores: spaces as ▁, the characters merged pair by pair, the best-scored pair that is a
    token first (the leftmost of equals), and a piece that is no token written as its bytes' <0xXX> tokens."""
    symbols = list(text.replace(" ", "\u2581"))
    alive = [True] * len(symbols)
    right = list(range(1, len(symbols) + 1))
    left = list(range(-1, len(symbols) - 1))
    queue = []

    def offer(a, b):
        if a >= 0 and b < len(symbols) and symbols[a] + symbols[b] in ids:
            heapq.heappush(queue, (-scores[ids[symbols[a] + symbols[b]]], a, symbols[a] + symbols[b]))

    for at in range(len(symbols) - 1):
        offer(at, at + 1)
    while queue:
        _, a, merged = heapq.heappop(queue)
        b = right[a]
        if not alive[a] or b >= len(symbols) or symbols[a] + symbols[b] != merged:
            continue
        symbols[a], alive[b] = merged, False
        right[a] = right[b]
        if right[b] < len(symbols):
            left[right[b]] = a
        offer(left[a], a)
        offer(a, right[a])
    out = []
    for symbol, kept in zip(symbols, alive):
        if kept:
            out.extend([ids[symbol]] if symbol in ids else [ids[f"<0x{byte:02X}>"] for byte in symbol.encode()])
    return out
