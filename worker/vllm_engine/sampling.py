"""A `gen` request's sampling as the keyword arguments of vLLM's `SamplingParams`, or the refusal of what
vLLM's engine cannot do the way Switchyard's does."""

from __future__ import annotations

from typing import Any

from worker.protocol import RequestError, SamplingParams, bad_request
from worker.protocol.grammar_spec import GrammarError, GrammarSpec, lark_text


def vllm_sampling_kwargs(sampling: SamplingParams, vocab_size: int, resumed: int = 0) -> dict[str, Any]:
    """`SamplingParams(**kwargs)` for vLLM: the same draws, stops and logprobs as Switchyard's engine gives.

    `resumed`: the last this many prompt tokens were streamed already; they count within max_tokens and
    min_tokens. Raises RequestError (400, `param` named) for what cannot be mapped."""
    sampling.validate(vocab_size)
    if resumed and sampling.grammar is not None:
        # vLLM's matcher starts at the output's first token: it cannot be advanced over streamed tokens
        raise bad_request("a constrained stream cannot resume on a vLLM-engine worker", "resumed")
    kw: dict[str, Any] = {
        "n": 1,
        "max_tokens": sampling.max_tokens - resumed,
        "min_tokens": max(0, sampling.min_tokens - resumed),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "seed": sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logit_bias": dict(sampling.logit_bias) or None,
        "skip_special_tokens": False,  # the gateway detokenizes; vLLM's text is not used
        "detokenize": False,
    }
    if sampling.logprobs or sampling.top_logprobs:
        kw["logprobs"] = sampling.top_logprobs  # vLLM adds the sampled token's own logprob to the k
    if sampling.grammar is not None:
        kw["grammar"] = _grammar(sampling.grammar)
    return kw


def _grammar(wire: dict) -> str:
    """A constrained request's grammar as Lark text, which vLLM's `guidance` backend hands to the same
    matcher."""
    try:
        return lark_text(GrammarSpec.from_dict(wire))
    except GrammarError as exc:
        raise RequestError("bad_request", exc.message, param=exc.param) from None
