"""SGLang's request fields that Kiln takes only at the value meaning "not used", and SGLang's handling of the
`model` name. SGLang's clients (its benchmark, its router, scripts written against it) send these fields at
their defaults on every request, so a Kiln that refused them outright would refuse those clients; a Kiln that
ignored a non-default value would silently answer a different question. Each is therefore accepted at its
default and refused at any other value with a 400 naming it and saying why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kiln.config import LORA_OFF
from kiln.sampling_params import InvalidParam


@dataclass(frozen=True)
class Unsupported:
    """The values of a field that mean "not used", and why any other is refused."""

    accepted: tuple[Any, ...]
    reason: str


_NO_MULTIMODAL = "Kiln serves text-only models: image, video and audio inputs are not supported"
_NO_DISAGGREGATION = "prefill/decode disaggregation is not supported by Kiln"

UNSUPPORTED: dict[str, Unsupported] = {
    "lora_path": Unsupported((None,), LORA_OFF),
    "custom_logit_processor": Unsupported((None,), "custom logit processors are not supported by Kiln"),
    "custom_params": Unsupported((None,), "custom logit processor parameters are not supported by Kiln"),
    "image_data": Unsupported((None,), _NO_MULTIMODAL),
    "video_data": Unsupported((None,), _NO_MULTIMODAL),
    "audio_data": Unsupported((None,), _NO_MULTIMODAL),
    "modalities": Unsupported((None,), _NO_MULTIMODAL),
    "input_embeds": Unsupported(
        (None,), "input embeddings are not supported by Kiln: send text or input_ids"
    ),
    "token_ids_logprob": Unsupported(
        (None,), "logprobs of chosen token ids are not computed by Kiln: use top_logprobs_num"
    ),
    "session_id": Unsupported(
        (None,), "sessions are not supported by Kiln (the prefix cache reuses prompts)"
    ),
    "session_params": Unsupported(
        (None,), "sessions are not supported by Kiln (the prefix cache reuses prompts)"
    ),
    "return_routed_experts": Unsupported((False,), "Kiln does not return the experts a MoE model routed to"),
    "priority": Unsupported(
        (None,), "Kiln schedules requests first come, first served: priorities are not supported"
    ),
    "routed_dp_rank": Unsupported((None, 0), "a Kiln server is one data-parallel rank: only rank 0 exists"),
    "data_parallel_rank": Unsupported(
        (None, 0), "a Kiln server is one data-parallel rank: only rank 0 exists"
    ),
    "extra_key": Unsupported((None,), "extra prefix-cache keys are not supported by Kiln"),
    "cache_salt": Unsupported((None,), "prefix-cache salts are not supported by Kiln"),
    "custom_labels": Unsupported((None,), "custom metric labels are not supported by Kiln"),
    "bootstrap_host": Unsupported((None,), _NO_DISAGGREGATION),
    "bootstrap_port": Unsupported((None,), _NO_DISAGGREGATION),
    "bootstrap_room": Unsupported((None,), _NO_DISAGGREGATION),
    "bootstrap_pair_key": Unsupported((None,), _NO_DISAGGREGATION),
    "require_reasoning": Unsupported((False,), "Kiln does not enforce reasoning"),
    "max_thinking_tokens": Unsupported((None,), "thinking budgets are not supported by Kiln"),
    "return_prompt_token_ids": Unsupported((False,), "Kiln does not return the prompt's token ids"),
    # sampling_params
    "stop_regex": Unsupported(
        (None,), "regular-expression stop conditions are not supported by Kiln: use stop"
    ),
    "spaces_between_special_tokens": Unsupported(
        (True,), "Kiln detokenizes with the tokenizer's own spacing around special tokens"
    ),
    "stream_interval": Unsupported((None, 1), "Kiln streams every token as it is generated"),
    "watermark": Unsupported((None,), "watermarking is not supported by Kiln"),
}


def _unused(value: Any, accepted: tuple[Any, ...]) -> bool:
    """A value meaning "not used": one of `accepted`, or a batch's list of such values (as SGLang takes)."""
    if isinstance(value, list):
        return all(_unused(item, accepted) for item in value)
    return any(value is item or (type(value) is type(item) and value == item) for item in accepted)


def refuse_unsupported(body: BaseModel, prefix: str = "", served: frozenset[str] = frozenset()) -> None:
    """Raises InvalidParam naming the first field of `body` (nested bodies included) that Kiln accepts only at
    its default but was given another value; `served` names those this server takes after all (lora_path with
    --enable-lora)."""
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            refuse_unsupported(value, f"{prefix}{name}.", served)
        rule = UNSUPPORTED.get(name) if name not in served else None
        if rule is not None and not _unused(value, rule.accepted):
            shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
            raise InvalidParam(f"{prefix}{name}", f"{prefix}{name}={shown}: {rule.reason}")


def adapter_named(asked: str | None, served: str) -> str | None:
    """The LoRA adapter a request's `model` names, or None. SGLang serves one model and answers whatever `model` a
    request names (its docs use "default"); only the form "<served name>:<adapter>" (or "<base>:<adapter>") means
    more."""
    if asked is None or ":" not in asked or asked == served:
        return None
    adapter = asked[len(served) + 1 :] if asked.startswith(f"{served}:") else asked.split(":", 1)[1]
    return adapter.strip() or None


def check_model_name(asked: str | None, served: str) -> None:
    """A `model` naming a LoRA adapter, refused here: a server without --enable-lora (kiln.server.lora_routes
    resolves it on one with)."""
    adapter = adapter_named(asked, served)
    if adapter:
        raise InvalidParam(
            "model",
            f"model {asked!r} names the LoRA adapter {adapter!r}; {LORA_OFF}. Any other name (or none) "
            f"is served by {served!r}",
        )
