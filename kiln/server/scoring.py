"""A generation server's scoring routes, in SGLang's shapes (sglang/srt/entrypoints/openai/protocol.py ScoringRequest
and V1RerankReqInput; serving_score.py, serving_rerank.py):

- POST /v1/score: for each item, the probability of each of `label_token_ids` as the next token after query + item
  (item + query with item_first; texts joined before tokenizing, token lists concatenated), one list per item in
  the labels' order; apply_softmax renormalises over the labels alone (SGLang's score_request).
- POST /v1/rerank, a decoder reranker (Qwen3-Reranker): each document's prompt scored P(yes) = softmax over the
  "yes" and "no" tokens' logits at the prompt's last position (SGLang's p_yes / (p_yes + p_no)), the documents
  returned best first, cut to top_n. The prompt is SGLang's: the chat template rendered with the query and the
  document as two user messages (and `instruct` when given) where the template is a reranker's (SGLang's test:
  it says the answer can only be "yes" or "no"; its examples/chat_template/qwen3_reranker.jinja). Where it is not,
  SGLang would fall back to a cross-encoder, which needs an --is-embedding classification model Kiln does not
  serve; Kiln writes the prompt Qwen3-Reranker's model card does instead (RERANK_PREFIX ... RERANK_SUFFIX).
"""

from __future__ import annotations

import math
from typing import Any

import jinja2
from fastapi import Request
from pydantic import Field

from kiln.sampling_params import InvalidParam
from kiln.scheduler.io import PoolSpec
from kiln.server.embeddings import PoolingServing, _Strict

DEFAULT_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class ScoringRequest(_Strict):
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


class RerankRequest(_Strict):
    query: str
    documents: list[str]
    instruct: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    model: str | None = None  # not SGLang's field; rerank clients (Cohere's shape) send it


def is_reranker_template(template: Any) -> bool:
    """SGLang's test for a decoder reranker's chat template (_is_qwen3_reranker_template)."""
    t = template.lower() if isinstance(template, str) else ""
    return 'answer can only be "yes" or "no"' in t or (
        "answer can only be" in t and '"yes"' in t and '"no"' in t
    )


def rerank_prompt(template: Any, query: str, document: str, instruct: str | None) -> str:
    """The text a document is scored on (see the module)."""
    if is_reranker_template(template):
        env = jinja2.Environment(loader=jinja2.BaseLoader(), autoescape=False)
        kwargs: dict[str, Any] = {
            "messages": [{"role": "user", "content": query}, {"role": "user", "content": document}]
        }
        if instruct:  # left undefined otherwise: the template's default(...) applies
            kwargs["instruct"] = instruct
        return env.from_string(template).render(**kwargs)
    body = f"<Instruct>: {instruct or DEFAULT_INSTRUCT}\n<Query>: {query}\n<Document>: {document}"
    return RERANK_PREFIX + body + RERANK_SUFFIX


def yes_no_ids(tokenizer) -> tuple[int, int]:
    """The single tokens "yes" and "no" (SGLang's lookup); a 400 where the tokenizer has none."""
    ids = []
    for word in ("yes", "no"):
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise InvalidParam(
                "documents", f"this model's tokenizer has no single {word!r} token: /v1/rerank scores decoder "
                "rerankers (Qwen3-Reranker) by their yes / no logits",
            )  # fmt: skip
        ids.append(encoded[0])
    return ids[0], ids[1]


async def score(pooling: PoolingServing, req: ScoringRequest, raw: Request) -> dict:
    pooling.serving.check_model(req.model)
    pooling.require_generation("/v1/score")
    if not req.label_token_ids:
        raise InvalidParam("label_token_ids", "label_token_ids must be provided: the tokens to score")
    vocab = pooling.serving.limits.vocab_size
    bad = next((t for t in req.label_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidParam("label_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
    prompts = _score_prompts(pooling, req)
    pool = PoolSpec("labels", label_ids=tuple(req.label_token_ids))
    outs = await pooling.run(prompts, pool, "items", raw)
    scores = [_probabilities(out.embedding or [], req.apply_softmax) for out in outs]
    tokens = sum(out.prompt_tokens for out in outs)
    usage = {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    return {"scores": scores, "model": pooling.serving.model_name, "usage": usage, "object": "scoring"}


def _score_prompts(pooling: PoolingServing, req: ScoringRequest) -> list[list[int]]:
    """query + item per item, as texts joined or token lists concatenated (SGLang's two forms; no mix)."""
    items = [req.items] if isinstance(req.items, str) else req.items
    if req.query is None or not items:
        raise InvalidParam(
            "items" if req.query is not None else "query", "give a query and at least one item"
        )
    pooling.check_count(len(items), "items")
    join = (lambda q, i: i + q) if req.item_first else (lambda q, i: q + i)
    if isinstance(req.query, str) and all(isinstance(i, str) for i in items):
        return [pooling.serving.encode(join(req.query, item), "items") for item in items]
    if isinstance(req.query, list) and all(isinstance(i, list) for i in items):
        return [join(list(req.query), list(item)) for item in items]
    raise InvalidParam("items", "give query and items both as text or both as token ids")


def _probabilities(logprobs: list[float], softmax: bool) -> list[float]:
    """Each label's probability; with softmax, renormalised over the labels (SGLang's apply_softmax)."""
    if not softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    return [w / sum(weights) for w in weights]


async def rerank(pooling: PoolingServing, req: RerankRequest, raw: Request) -> list[dict]:
    pooling.serving.check_model(req.model)
    pooling.require_generation("/v1/rerank")
    if not req.query.strip():
        raise InvalidParam("query", "query cannot be empty or whitespace only")
    if not req.documents:
        raise InvalidParam("documents", "documents cannot be empty")
    pooling.check_count(len(req.documents), "documents")
    for i, doc in enumerate(req.documents):
        if not doc.strip():
            raise InvalidParam("documents", f"documents[{i}] cannot be empty or whitespace only")
    tokenizer = pooling.serving.tokenizer
    yes, no = yes_no_ids(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    try:
        texts = [rerank_prompt(template, req.query, doc, req.instruct) for doc in req.documents]
    except jinja2.TemplateError as e:
        raise InvalidParam("documents", f"the reranker chat template failed: {e}") from None
    prompts = [pooling.serving.encode(text, "documents") for text in texts]
    outs = await pooling.run(prompts, PoolSpec("labels", label_ids=(yes, no)), "documents", raw)
    results = []
    for i, out in enumerate(outs):
        lp_yes, lp_no = out.embedding or [0.0, 0.0]
        entry: dict[str, Any] = {"score": _sigmoid(lp_yes - lp_no), "index": i}
        if req.return_documents:
            entry["document"] = req.documents[i]
        results.append(entry)
    results.sort(key=lambda r: r["score"], reverse=True)
    return results[: req.top_n] if req.top_n else results


def _sigmoid(x: float) -> float:
    """softmax([yes, no])[0] from their logprobs' difference, without overflow either way."""
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
