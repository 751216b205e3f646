"""The errors an engine raises for one request, and the prompt checks every engine makes (Switchyard's and
the vLLM adapter's). `RequestError` carries a wire `ErrorCode`, so both are defined with the protocol
(`worker.protocol`) and named here for the engine's callers.
"""

from common.priorities import Priority
from worker.protocol import ErrorCode, RequestError, bad_request

__all__ = ["ErrorCode", "RequestError", "bad_request", "check_context", "check_prompt"]


def check_prompt(token_ids: list[int], priority: int, resumed: int, max_tokens: int, vocab_size: int) -> None:
    """The prompt's ids, the priority and the resumed count; RequestError names the first failing."""
    if not token_ids:
        raise bad_request("prompt is empty", "prompt")
    try:
        ok = all(0 <= t < vocab_size for t in token_ids) and not any(
            isinstance(t, bool) or not isinstance(t, int) for t in token_ids)
    except TypeError:
        ok = False
    if not ok:
        raise bad_request(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    if priority not in (Priority.INTERACTIVE, Priority.BATCH):
        raise bad_request("priority must be 0 (interactive) or 1 (batch)", "priority")
    if not 0 <= resumed < len(token_ids) or resumed >= max_tokens:
        raise bad_request("resumed must count fewer tokens than the prompt and max_tokens", "resumed")


def check_context(token_ids: list[int], resumed: int, max_tokens: int, max_context: int) -> int:
    """The tokens the request can hold (prompt + max_tokens; resumed tokens count within max_tokens), or a
    non-retryable `capacity` error when they exceed the model's context (the gateway answers 400)."""
    prompt_len = len(token_ids) - resumed
    total = prompt_len + max_tokens
    if total > max_context:
        raise RequestError("capacity", f"prompt ({prompt_len}) + max_tokens ({max_tokens}) "
                           f"exceeds the model context of {max_context} tokens", param="max_tokens")
    return total
