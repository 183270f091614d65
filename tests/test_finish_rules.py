"""The finish rules (controlplane/finish.py): the token rule, the stop-string rule and the fit rule,
with their edges, and the callers that word what the fit rule returns."""

from __future__ import annotations

import pytest

from twinplane.controlplane.engine_core import never_fits
from twinplane.controlplane.finish import (Limit, Misfit, first_stop_string, length_reached, misfit, output_room,
                                           stop_strings_apply, stop_token_ids, token_finish_reason, tokens_left)
from twinplane.controlplane.metrics import EngineMetrics
from twinplane.controlplane.request_state import RequestState, Unsent
from twinplane.controlplane.sequence import FinishReason, RequestParams, Sequence
from twinplane.proto import dataplane_pb2 as dp

STOP, LENGTH, STOP_STRING = FinishReason.STOP_TOKEN, FinishReason.LENGTH, FinishReason.STOP_STRING
EOS = frozenset({2})


def rule(position: int, token_id: int = 5, *, prompt: int = 3, max_tokens: int = 4, min_tokens: int = 0,
         max_model_len: int = 100):
    params = RequestParams(max_tokens=max_tokens, min_tokens=min_tokens)
    return token_finish_reason(token_id, position, prompt, params, EOS, max_model_len)


# ---- the token rule: outputs start at position 3 (a 3-token prompt) ---------------------------


def test_a_stop_token_ends_the_request_from_its_first_output():
    assert rule(3, token_id=2) is STOP
    assert rule(3, token_id=7) is None


def test_min_tokens_masks_a_stop_token_until_that_many_outputs():
    assert rule(3, token_id=2, min_tokens=2) is None  # output 1
    assert rule(4, token_id=2, min_tokens=2) is None  # output 2: still within min_tokens
    assert rule(5, token_id=2, min_tokens=2) is STOP  # output 3


def test_max_tokens_ends_at_its_last_output_and_a_stop_token_there_wins():
    assert rule(5) is None  # output 3 of 4
    assert rule(6) is LENGTH  # output 4
    assert rule(6, token_id=2) is STOP
    assert rule(6, token_id=2, min_tokens=4) is LENGTH  # masked by min_tokens = max_tokens


def test_the_last_position_of_max_model_len_ends_the_request():
    assert rule(8, max_tokens=50, max_model_len=10) is None  # position 8: one more fits
    assert rule(9, max_tokens=50, max_model_len=10) is LENGTH  # position 9: the last of 10
    assert rule(9, token_id=2, max_tokens=50, max_model_len=10) is STOP


def test_stop_tokens_are_the_requests_and_the_models_unless_ignore_eos():
    assert stop_token_ids(RequestParams(max_tokens=9, stop_token_ids=(7, 8)), (2,)) == {2, 7, 8}
    assert stop_token_ids(RequestParams(max_tokens=9, stop_token_ids=(7,), ignore_eos=True), (2,)) == {7}
    assert stop_token_ids(RequestParams(max_tokens=9, stop_token_ids=(7,), ignore_eos=True), (2,), whole=True) == {2, 7}
    assert stop_token_ids(RequestParams(max_tokens=9), ()) == frozenset()


def test_length_is_reached_at_max_tokens_outputs_or_max_model_len_tokens():
    assert not length_reached(6, 3, 4, 100) and length_reached(7, 3, 4, 100)  # 3 then 4 outputs of 4
    assert not length_reached(9, 3, 50, 10) and length_reached(10, 3, 50, 10)  # 10 tokens of max_model_len 10
    assert [tokens_left(n, 3, 4, 100) for n in (3, 6, 7)] == [4, 1, 0] and tokens_left(8, 3, 50, 10) == 2


# ---- the stop-string rule ------------------------------------------------------------------


def test_stop_strings_apply_only_past_min_tokens():
    assert not stop_strings_apply(5, RequestParams(max_tokens=9))  # no stop strings
    assert not stop_strings_apply(2, RequestParams(max_tokens=9, min_tokens=2, stop=("x",)))
    assert stop_strings_apply(3, RequestParams(max_tokens=9, min_tokens=2, stop=("x",)))
    assert stop_strings_apply(1, RequestParams(max_tokens=9, stop=("x",)))


def test_the_earliest_stop_string_wins_and_ties_go_to_the_first_listed():
    assert first_stop_string("say hello world", ("world", "hello")) == (4, "hello")
    assert first_stop_string("abcd", ("bcd", "bc")) == (1, "bcd")
    assert first_stop_string("abcd", ("bc", "bcd")) == (1, "bc")
    assert first_stop_string("abcd", ("x", "dc")) is None
    assert first_stop_string("", ("x",)) is None


class CharTokenizer:
    """Token i is the character chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def request(stop: tuple[str, ...], min_tokens: int = 0, max_tokens: int = 10) -> RequestState:
    params = RequestParams(max_tokens=max_tokens, min_tokens=min_tokens, stop=stop)
    return RequestState(1, "r", [25], params, CharTokenizer(), 1, EngineMetrics(), 0.0, Unsent())


def feed(state: RequestState, tokens: list[int], core_reasons=None) -> list[FinishReason | None]:
    """Each token's final reason, as the frontend decides it (prompt of one token: outputs at 1, 2, ...)."""
    reasons = []
    for i, token in enumerate(tokens):
        state.record_token(token, 1 + i, None, 0)
        reasons.append(state.add_text(token, core_reasons[i] if core_reasons else None))
        state.emit(reasons[-1])
        if reasons[-1] is not None:
            break
    return reasons


def test_a_stop_string_spanning_two_tokens_ends_the_request_at_the_second():
    state = request(("bc",))
    assert feed(state, [0, 1, 2, 3]) == [None, None, STOP_STRING]  # "a", "b", "c": "bc" spans tokens 2 and 3
    sent = [state.outputs.popleft() for _ in range(len(state.outputs))]
    assert "".join(out.text for out in sent) == "a" and sent[-1].matched_stop == "bc"


def test_min_tokens_masks_a_stop_string_that_ends_within_them():
    assert feed(request(("bc",), min_tokens=3), [0, 1, 2, 3]) == [None, None, None, None]
    assert feed(request(("bc",), min_tokens=2), [0, 1, 2]) == [None, None, STOP_STRING]


def test_a_stop_token_skips_the_text_and_a_stop_string_outranks_length():
    assert feed(request(("c",)), [2], [STOP]) == [STOP]
    assert feed(request(("c",)), [2], [LENGTH]) == [STOP_STRING]
    assert feed(request(("x",)), [2], [LENGTH]) == [LENGTH]


# ---- the fit rule ---------------------------------------------------------------------------


def test_prompt_and_max_tokens_must_fit_max_model_len_first_then_the_kv_cache():
    assert output_room(3, 10) == 7
    assert misfit(3, 7, 10, 10) is None  # exactly max_model_len and exactly the KV cache
    assert misfit(3, 8, 10, 100) == Misfit(Limit.MAX_MODEL_LEN, 11, 10)
    assert misfit(3, 7, 10, 9) == Misfit(Limit.KV_CACHE, 10, 9)
    assert misfit(3, 8, 10, 9) == Misfit(Limit.MAX_MODEL_LEN, 11, 10)  # both: max_model_len is named


@pytest.mark.parametrize(("max_model_len", "num_kv_blocks", "words"), [
    (16, 100, "exceeds the data plane's max_model_len (16)"),
    (64, 4, "no longer fits in the data plane's KV cache (16 tokens)"),
    (64, 5, None),
])
def test_the_core_words_a_misfit_after_a_data_plane_shrank(max_model_len, num_kv_blocks, words):
    seq = Sequence(1, "r", list(range(10)), RequestParams(max_tokens=10))
    why = never_fits(seq, dp.DescribeResponse(max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                                              block_size=4))
    assert (why is None) if words is None else (why.startswith("prompt + max_tokens (20 tokens) ") and words in why)


def test_text_held_back_for_a_stop_string_goes_out_when_length_ends_the_request():
    """"b" may begin "bc" and waits for the next token; max_tokens ends the request there, so it goes out."""
    state = request(("bc",), max_tokens=2)
    assert feed(state, [0, 1], [None, LENGTH]) == [None, LENGTH]
    sent = [state.outputs.popleft() for _ in range(len(state.outputs))]
    assert [out.text for out in sent] == ["a", "b"] and sent[-1].matched_stop == ""
