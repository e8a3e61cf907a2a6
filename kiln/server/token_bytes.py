"""The bytes each token stands for, as OpenAI's logprobs `bytes` field means them: a token that is only part of
a UTF-8 character decodes, alone, to U+FFFD, whose own bytes say nothing; a client joins the tokens' bytes to
rebuild the text, so each token must give its real bytes."""

from __future__ import annotations

import json
import re
from functools import lru_cache

# SentencePiece's byte fallback spells a byte the vocabulary has no piece for as <0xE2>
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character to byte: printable bytes stand for themselves, the others
    are shifted past U+0100 so that every byte is one visible character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shift)] = byte
            shift += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


class TokenBytes:
    """A tokenizer's token id -> that token's bytes, remembered per id (logprobs ask for the same few tokens
    again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        added = getattr(tokenizer, "get_added_vocab", dict)()
        self.added_ids = set(added.values()) | set(getattr(tokenizer, "all_special_ids", []))
        self._known: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self.added_ids:
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return [int(fallback.group(1), 16)]
            if self.byte_level:
                alphabet = byte_level_alphabet()
                if all(char in alphabet for char in piece):
                    return [alphabet[char] for char in piece]
        return list(self.tokenizer.decode([token_id]).encode("utf-8"))


@lru_cache(maxsize=4)
def token_bytes_for(tokenizer) -> TokenBytes:
    """The one TokenBytes of a tokenizer (a server has one tokenizer for its whole life)."""
    return TokenBytes(tokenizer)
