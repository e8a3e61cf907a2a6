"""After sampling: append the token, decide whether the request ended (EOS, stop ids, stop strings, length),
and package what the client has not seen yet."""

from __future__ import annotations

from kiln.scheduler.io import ReqOutput, TokenLogprob
from kiln.scheduler.req import Req


class OutputProcessor:
    def __init__(self, eos_ids: set[int], context_len: int, stream_interval: int):
        self.eos_ids = eos_ids
        self.context_len = context_len
        self.stream_interval = max(1, stream_interval)

    def _stop_ids(self, req: Req) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids |= self.eos_ids
        return ids

    def banned_ids(self, req: Req, ahead: int = 0) -> list[int]:
        """EOS and stop ids may not end a request before min_new_tokens (`ahead`: with that many more output
        tokens, as a speculative verify row sees the request)."""
        if len(req.output_ids) + ahead >= req.params.min_new_tokens:
            return []
        return sorted(self._stop_ids(req) | self.eos_ids)

    @staticmethod
    def stops_live(req: Req) -> bool:
        """Stop strings may end a request once it has min_new_tokens output tokens, the one just appended
        included: vLLM's min_tokens rule, which checks them after appending (EOS and stop ids are banned at
        sampling instead, see banned_ids)."""
        return len(req.output_ids) >= req.params.min_new_tokens

    def append_token(self, req: Req, token: int, logprob: float | None, top: list | None) -> None:
        req.output_ids.append(token)
        req.pending_ids.append(token)
        if logprob is not None:
            req.pending_logprobs.append(TokenLogprob(token, logprob, top))
        p = req.params
        if token in self._stop_ids(req):
            req.finish_reason = {"type": "stop", "matched": token}
            req.pending_text += req.detok.flush(self.stops_live(req))
            return
        text, matched = req.detok.add([token], self.stops_live(req))
        req.pending_text += text
        if matched is not None:
            req.finish_reason = {"type": "stop", "matched": matched}
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        if req.finish_reason is not None and matched is None:
            req.pending_text += req.detok.flush(self.stops_live(req))

    def follow_grammar(self, req: Req, token: int) -> None:
        """Advance a constrained request's matcher by its new token; a grammar that can take no further token
        ends the request as a stop on that token (SGLang's rule), so nothing past the match is generated."""
        if req.matcher is None or req.finished:
            return
        if not req.matcher.accept(token):  # unreachable while the mask applied: rank 0 sampled under it
            req.finish_reason = {
                "type": "abort",
                "message": f"grammar refused token {token}: {req.matcher.error}",
            }
        elif req.matcher.is_terminated:
            req.finish_reason = {"type": "stop", "matched": token}
        if req.finished:
            req.pending_text += req.detok.flush(self.stops_live(req))

    def should_stream(self, req: Req) -> bool:
        return req.stream and len(req.pending_ids) >= self.stream_interval

    def flush_output(self, req: Req) -> ReqOutput:
        out = ReqOutput(
            rid=req.rid,
            new_ids=req.pending_ids,
            text_delta=req.pending_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            logprobs=req.pending_logprobs or None,
            input_logprobs=req.pending_input_logprobs,
            num_retractions=req.num_retractions,
            error=req.error,
            queue_time=req.queue_time,
            embedding=req.embedding if req.finished else None,
        )
        req.pending_ids, req.pending_text, req.pending_logprobs, req.queue_time = [], "", [], None
        req.pending_input_logprobs = None
        return out

    @staticmethod
    def error_output(rid: str, prompt_tokens: int, message: str) -> ReqOutput:
        return ReqOutput(
            rid=rid,
            new_ids=[],
            text_delta="",
            finished=True,
            finish_reason={"type": "abort", "message": message},
            prompt_tokens=prompt_tokens,
            completion_tokens=0,
            cached_tokens=0,
            error=message,
        )
