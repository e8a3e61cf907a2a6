"""Tokenizer loading (HF directory or GGUF metadata) and chat-template rendering."""

from __future__ import annotations

import os


def load_tokenizer(model_path: str, tokenizer_path: str | None = None, chat_template: str | None = None):
    from kiln.loader.model_config import resolve_model_path

    # the model's own path resolved as its weights are (a directory holding one .gguf file means that file)
    path = tokenizer_path or resolve_model_path(model_path)
    if path.endswith(".gguf"):
        from kiln.loader.gguf_loader import load_gguf_tokenizer

        tok = load_gguf_tokenizer(path)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path))
    if chat_template:
        with open(chat_template) as f:
            tok.chat_template = f.read()
    return tok


def apply_chat_template(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use /v1/completions or pass --chat-template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
