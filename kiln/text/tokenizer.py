"""Tokenizer loading (HF directory or GGUF metadata) and chat-template rendering."""

from __future__ import annotations

import json
import os


def load_tokenizer(model_path: str, tokenizer_path: str | None = None, chat_template: str | None = None):
    from kiln.loader.model_config import resolve_model_path

    # the model's own path resolved as its weights are (a directory holding one .gguf file means that file)
    path = tokenizer_path or resolve_model_path(model_path)
    if path.endswith(".gguf"):
        from kiln.loader.gguf_tokenizer import load_gguf_tokenizer

        tok = load_gguf_tokenizer(path)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path))
    if chat_template:
        with open(chat_template) as f:
            tok.chat_template = f.read()
    return tok


def chat_template_options(continue_final_message: bool = False, **kwargs) -> dict:
    """The chat template's keyword arguments: open the assistant's turn, or with continue_final_message leave the
    last (assistant) message open for the model to continue (no end of its turn, no new turn). A client's
    chat_template_kwargs (`kwargs`) come last and win, as in vLLM."""
    opens_a_turn = not continue_final_message
    return {"add_generation_prompt": opens_a_turn, "continue_final_message": continue_final_message, **kwargs}


def apply_chat_template(
    tokenizer, messages: list[dict], continue_final_message: bool = False, **kwargs
) -> list[int]:
    """The chat's prompt ids (see chat_template_options)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use /v1/completions or pass --chat-template")
    options = chat_template_options(continue_final_message, **kwargs)
    ids = tokenizer.apply_chat_template(messages, **{**options, "tokenize": True})
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def longest_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token stands for, where the tokenizer guarantees a bound: byte-level BPE
    (each character of a vocabulary entry is one byte) with no normalizer (which could shrink the text), no
    pre-tokenizer that drops text, no fused unknown token and no added token that swallows the whitespace
    around it. None for any other tokenizer: its prompts are always tokenized before their length is judged."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    if (
        spec.get("normalizer") is not None
        or not _byte_level_keeping_all_text(spec.get("pre_tokenizer"))
        or model.get("type") != "BPE"
        or model.get("fuse_unk")
        or any(token.get("lstrip") or token.get("rstrip") for token in added)
    ):
        return None
    longest = max((len(entry) for entry in model.get("vocab", {})), default=1)
    return max([longest, *(len(token["content"].encode("utf-8")) for token in added)])


def _byte_level_keeping_all_text(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    parts = (
        pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    )
    keeps = all(
        part.get("type") in ("ByteLevel", "Digits")
        or (part.get("type") in ("Split", "Punctuation") and part.get("behavior") != "Removed")
        for part in parts
    )
    return keeps and any(part.get("type") == "ByteLevel" for part in parts)
