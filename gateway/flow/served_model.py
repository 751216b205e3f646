"""The model this gateway serves: names, tokenizer, context size and token bytes; requests -> prompt ids."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.flow.detokenize import token_byte_table
from gateway.openai.bodies import TokenLogprob
from gateway.openai.schemas import GenerationRequest
from gateway.web.api_errors import invalid
from worker.text.tokenizer import (
    PLACEHOLDER_CHARS,
    Tokenizer,
    hermes_messages,
    load_tokenizer,
    native_messages,
    special_texts,
)

DEFAULT_ALIAS = "default"


@dataclass(slots=True)
class Encoded:
    ids: list[int]
    stable_len: int | None  # chat: tokens before the last user turn; None for completions


class ServedModel:
    def __init__(self, tokenizer: Tokenizer, aliases: tuple[str, ...] = (DEFAULT_ALIAS,)) -> None:
        self.tokenizer = tokenizer
        self.model_id = tokenizer.model_id
        self.names = frozenset((self.model_id, *aliases))
        self.max_context = tokenizer.max_context
        self.vocab_size = tokenizer.vocab_size
        self.version = tokenizer.version
        self.byte_table = token_byte_table(tokenizer.hf, tokenizer.vocab_size)
        self._specials = special_texts(tokenizer.hf)

    @classmethod
    def load(cls, spec: str = "default") -> ServedModel:
        return cls(load_tokenizer(spec))

    def encode(self, req: GenerationRequest) -> Encoded:
        bad_bias = next((t for t, _ in req.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad_bias is not None:
            raise invalid(f"logit_bias token id {bad_bias} is outside the vocabulary [0, {self.vocab_size}).",
                          param="logit_bias")
        if req.kind == "chat":
            assert req.messages is not None
            tools = req.tools.tools if req.tools is not None and req.tools.active else None
            if not self.tokenizer.renders_tools:
                return self._encode_chat(hermes_messages(req.messages, tools))
            # the template writes tools, calls and call ids as its own text: no special token may hide in
            # them, checked in the form it renders (arguments parsed, so an escaped \u003c is caught too)
            listing = None if tools is None else [{"type": "function", "function": t} for t in tools]
            self._no_specials(listing, "tools")
            messages = native_messages(req.messages)
            for i, m in enumerate(messages):
                self._no_specials(m.get("tool_calls"), f"messages[{i}].tool_calls")
                self._no_specials(m.get("tool_call_id"), f"messages[{i}].tool_call_id")
            return self._encode_chat(messages, listing)
        assert req.prompt is not None
        return self.encode_prompt(req.prompt)

    def encode_prompt(self, prompt: str | list[int], param: str = "prompt") -> Encoded:
        if isinstance(prompt, str):
            return Encoded(self.tokenizer.encode(prompt), None)
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"Token id {bad} is outside the vocabulary [0, {self.vocab_size}).", param=param)
        return Encoded(list(prompt), None)

    def _no_specials(self, value: object, param: str) -> None:
        if value is None:
            return
        text = json.dumps(value, ensure_ascii=False)
        if any(s in text for s in self._specials):
            raise invalid("Special-token text is not allowed here.", param=param)
        if any(c in text for c in PLACEHOLDER_CHARS):  # the content markers of the template's rendering
            raise invalid("Private-use characters U+E000 and U+E001 are not allowed here.", param=param)

    def _encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> Encoded:
        tok = self.tokenizer
        try:
            text = tok.render_chat(messages, add_generation_prompt=True, tools=tools)
            last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
            head = tok.render_chat(messages[:last_user], add_generation_prompt=False, tools=tools) \
                if last_user else ""
            enc = tok.encode_chat(messages, add_generation_prompt=True, tools=tools)
        except ValueError as exc:  # the template's raise_exception (e.g. roles out of order)
            raise invalid(f"The chat template rejected the messages: {exc}", param="messages") from None
        # The stable prefix is every token that ends inside the rendered history.
        if not head or not text.startswith(head):
            return Encoded(enc.ids, 0)
        limit = len(head)
        stable = next((i for i, end in enumerate(enc.ends) if end > limit), len(enc.ids))
        return Encoded(enc.ids, stable)

    def token_logprobs(self, tokens: list[int], logprobs: list[float], top_ids: list[list[int]] | None = None,
                       top_logprobs: list[list[float]] | None = None) -> list[TokenLogprob]:
        out = [self._token(t, lp) for t, lp in zip(tokens, logprobs, strict=False)]
        if top_ids is not None and top_logprobs is not None:
            for item, ids, lps in zip(out, top_ids, top_logprobs, strict=False):
                item.top = [self._token(t, lp) for t, lp in zip(ids, lps, strict=False)]
        return out

    def _token(self, token: int, logprob: float) -> TokenLogprob:
        raw = self.byte_table[token]
        return TokenLogprob(raw.decode("utf-8", "replace"), raw, logprob)
