"""Why a request ends, and whether it can ever run: every such rule, as small pure functions.

- The token rule (``token_finish_reason``): a stop token (``stop_token_ids``; end-of-sequence
  counts even with ignore_eos once a structured output's text can go no further) past min_tokens,
  max_tokens, or the last position of max_model_len (``length_reached``, ``tokens_left``, which also
  bounds a plan of several decode steps). The engine core applies
  it to each sampled token (``replica.py``), so a sequence it ends is never planned again; the
  scheduler does not plan a sequence whose token in flight reaches the length; the data plane
  masks the stop tokens while min_tokens is not reached (``plan_codec.py`` sends them).
- The stop-string rule (``stop_strings_apply``, ``first_stop_string``): past min_tokens, the
  earliest stop string in the output text not sent yet. The frontend applies it
  (``request_state.py``) to the text its detokenizer has accumulated, so a stop string may span
  several tokens. A stop token ends the request before its text is looked at; a stop string
  found at the token that reached max_tokens still ends it as a stop string.
- The fit rule (``output_room``, ``misfit``): prompt + max_tokens must fit max_model_len and the
  KV cache. The frontend refuses a request that does not on arrival (INVALID_ARGUMENT); the core
  refuses one that no longer does after a data plane came back smaller (FAILED_PRECONDITION),
  unless it left max_tokens unset (``default_max_tokens``): that one is lowered to what fits now,
  if its outputs so far leave room. Each caller words its own message from what ``misfit`` returns.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from twinplane.controlplane.sequence import FinishReason, RequestParams


def stop_token_ids(params: RequestParams, eos_token_ids, whole: bool = False) -> frozenset[int]:
    """The tokens that end a request: its stop_token_ids, and the model's end-of-sequence ids unless
    ignore_eos; whole: its structured output's text is a match that nothing can extend, so those ids
    end it even with ignore_eos (they are all it may sample)."""
    eos = frozenset() if params.ignore_eos and not whole else frozenset(eos_token_ids)
    return frozenset(params.stop_token_ids) | eos


def tokens_left(num_tokens: int, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """How many more tokens a sequence of num_tokens tokens (prompt included) may have: max_tokens
    outputs, and no more than max_model_len tokens in all."""
    return min(max_tokens - (num_tokens - num_prompt_tokens), max_model_len - num_tokens)


def length_reached(num_tokens: int, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    """Whether a sequence of num_tokens tokens (prompt included) has all the tokens it may have."""
    return tokens_left(num_tokens, num_prompt_tokens, max_tokens, max_model_len) <= 0


def token_finish_reason(token_id: int, position: int, num_prompt_tokens: int, params: RequestParams,
                        stop_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Why a request ends at the token it sampled at position (0-based, prompt included), if it does.
    stop_ids: stop_token_ids(params, the model's end-of-sequence ids)."""
    if token_id in stop_ids and position + 1 - num_prompt_tokens > params.min_tokens:
        return FinishReason.STOP_TOKEN
    if length_reached(position + 1, num_prompt_tokens, params.max_tokens, max_model_len):
        return FinishReason.LENGTH
    return None


def stop_strings_apply(num_outputs: int, params: RequestParams) -> bool:
    """Whether stop strings can end a request that has num_outputs output tokens (past min_tokens)."""
    return bool(params.stop) and num_outputs > params.min_tokens


def first_stop_string(text: str, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """The stop string that occurs earliest in text, and where it starts (of two that start at the
    same place, the one listed first); None if none occurs."""
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def partial_tag(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker (a stop string, or a parser's
    tag): that much of the text is held back, as the marker may be completed later."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def output_room(num_prompt_tokens: int, max_model_len: int) -> int:
    """Output tokens that fit after the prompt within max_model_len."""
    return max_model_len - num_prompt_tokens


def default_max_tokens(num_prompt_tokens: int, max_model_len: int, kv_capacity: int) -> int:
    """max_tokens for a request that leaves it unset: the outputs that fit after the prompt in
    max_model_len and in the KV cache (kv_capacity tokens). A request that ran on a data plane
    which came back smaller is lowered to it (``max_tokens_unset``), not refused."""
    return output_room(num_prompt_tokens, min(max_model_len, kv_capacity))


class Limit(enum.Enum):
    MAX_MODEL_LEN = "max_model_len"
    KV_CACHE = "KV cache"


class Misfit(NamedTuple):
    """What a request does not fit: the limit, the tokens it needs, and the tokens that limit allows."""

    limit: Limit
    needed: int  # prompt + max_tokens
    available: int


def misfit(num_prompt_tokens: int, max_tokens: int, max_model_len: int, kv_capacity: int) -> Misfit | None:
    """What a request with this prompt and max_tokens does not fit (max_model_len is checked first);
    None if it fits. kv_capacity: tokens the KV cache holds (blocks x block size)."""
    needed = num_prompt_tokens + max_tokens
    if needed > max_model_len:
        return Misfit(Limit.MAX_MODEL_LEN, needed, max_model_len)
    if needed > kv_capacity:
        return Misfit(Limit.KV_CACHE, needed, kv_capacity)
    return None
