"""OpenAI response bodies (`chat.completion`, `chat.completion.chunk`, `text_completion`) as plain dicts."""

from __future__ import annotations

from dataclasses import dataclass, field

SYSTEM_FINGERPRINT = "switchyard-v1"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class TokenLogprob:
    token: str
    raw: bytes
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)  # the most likely tokens at this position


def _chat_logprobs(items: list[TokenLogprob] | None) -> dict | None:
    if items is None:
        return None
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.raw),
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.raw)}
                                          for a in t.top]}
                        for t in items]}


def _completion_logprobs(items: list[TokenLogprob] | None, offset: int) -> dict | None:
    if items is None:
        return None
    offsets: list[int] = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    top = [{a.token: a.logprob for a in t.top} for t in items] if any(t.top for t in items) else None
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": top, "text_offset": offsets}


@dataclass(slots=True)
class ResponseShape:
    """Constants of one response: OpenAI id, creation time, model name, chat or completion."""

    id: str
    created: int
    model: str
    chat: bool

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def full(self, text: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprob] | None) -> dict:
        """The non-streaming body."""
        if self.chat:
            body = self._head("chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": _chat_logprobs(logprobs), "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": _completion_logprobs(logprobs, 0),
                      "finish_reason": finish_reason}
        body["choices"] = [choice]
        body["usage"] = usage.to_dict()
        return body

    def chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None,
              *, first: bool = False, text_offset: int = 0, with_usage_field: bool = False) -> dict:
        """One streamed chunk with a single choice."""
        if self.chat:
            body = self._head("chat.completion.chunk")
            delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text and not first:
                delta = {}
            choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(logprobs),
                      "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": _completion_logprobs(logprobs, text_offset),
                      "finish_reason": finish_reason}
        body["choices"] = [choice]
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        """The final `stream_options.include_usage` chunk: empty choices, usage set."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.to_dict()
        return body
