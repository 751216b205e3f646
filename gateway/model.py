"""The model this gateway serves: names, tokenizer, context size and token bytes; requests -> prompt ids."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.detokenize import token_byte_table
from gateway.errors import invalid
from gateway.responses import TokenLogprob
from gateway.schemas import GenerationRequest
from worker.tokenizer import Tokenizer, load_tokenizer

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
            return self._encode_chat(req.messages)
        prompt = req.prompt
        if isinstance(prompt, str):
            return Encoded(self.tokenizer.encode(prompt), None)
        assert prompt is not None
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"Token id {bad} is outside the vocabulary [0, {self.vocab_size}).", param="prompt")
        return Encoded(list(prompt), None)

    def _encode_chat(self, messages: list[dict[str, str]]) -> Encoded:
        tok = self.tokenizer
        try:
            text = tok.render_chat(messages, add_generation_prompt=True)
            last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
            head = tok.render_chat(messages[:last_user], add_generation_prompt=False) if last_user else ""
            enc = tok.encode_chat(messages, add_generation_prompt=True)
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
