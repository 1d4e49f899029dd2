"""A token's raw bytes, for the `bytes` field of OpenAI logprobs.

`tokenizer.decode([id])` of a token that ends inside a multi-byte character (a CJK character or an emoji
spans 3-4 bytes, often 2-3 byte-level tokens) is U+FFFD, whose UTF-8 is not the token's bytes. Byte-level
BPE vocabularies (DeepSeek's, GPT-2's, the demo model's) spell every token in a printable alphabet with one
character per byte, so the token's bytes are read back from its vocabulary string. Other tokenizers, and
tokens outside that alphabet (added special tokens), fall back to the decoded text's UTF-8.
"""

from __future__ import annotations

import json
from typing import Any


def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE: the printable Latin-1 bytes stand for themselves, the other
    68 (controls, space, DEL, NBSP, soft hyphen, ...) are moved to U+0100 upward in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table, moved = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + moved)] = b
            moved += 1
    return table


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in parts)


class TokenBytes:
    """token id (and its decoded text) -> the token's bytes; cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._alphabet = byte_level_alphabet() if _is_byte_level(tokenizer) else None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int, decoded: str) -> bytes:
        if self._alphabet is None:
            return decoded.encode()
        found = self._cache.get(token_id)
        if found is None:
            spelled = self._tokenizer.convert_ids_to_tokens(token_id) or ""
            if spelled and all(ch in self._alphabet for ch in spelled):
                found = bytes(self._alphabet[ch] for ch in spelled)
            else:
                found = decoded.encode()
            self._cache[token_id] = found
        return found
