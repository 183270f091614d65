"""CPU cost of structured output's token masks on the engine core.

    python -m twinplane.controlplane.bench_grammar [--tokenizer FOLDER]

For each form (any JSON object, a JSON Schema, a regex, a choice) it compiles the constraint, then
walks a text of that form token by token as a sequence would generate it, asking before each token
for the mask of the tokens allowed there twice: the first call computes it when the automaton meets
that state for the first time (a walk down the vocabulary's trie), the second reads the cache. Prints
the compile time and both times. The tokenizer defaults to the embedded model's (SmolLM2, 49,152
tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

from twinplane.controlplane.json_schema import any_json_regex
from twinplane.controlplane.structured import TokenMatcher, Vocabulary, choice_regex, compiled, json_schema_regex
from twinplane.controlplane.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "email": {"type": "string", "format": "email"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8}},
          "required": ["name", "age"]}
CASES = {  # form -> (regex, a text of that form)
    "json_object": (any_json_regex, '{"city": "Paris", "days": [{"t": 21.5, "rain": false}, {"t": 19, "rain": null}]}'),
    "json_schema": (lambda: json_schema_regex(PERSON, "schema"),
                    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["maths", "poetry"]}'),
    "regex": (lambda: r"\(\d{3}\) \d{3}-\d{4}", "(555) 010-4477"),
    "choice": (lambda: choice_regex(["positive", "negative", "neutral"], "choice"), "neutral"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)")
    args = p.parse_args()
    if args.tokenizer is None:
        from twinplane.dataplane.embedded import resolve_model
        args.tokenizer = resolve_model("default")
    tokenizer = Tokenizer(args.tokenizer)
    started = time.perf_counter()
    vocabulary = Vocabulary(tokenizer, tokenizer.vocab_size, [tokenizer.token_id(tokenizer.eos_token) or 0])
    print(f"vocabulary of {tokenizer.vocab_size} tokens read in {(time.perf_counter() - started) * 1e3:.0f} ms")
    print(f"{'form':<12} {'regex chars':>11} {'compile ms':>10} {'tokens':>6} {'first mask ms (median / max)':>29} "
          f"{'cached us':>9}")
    for form, (regex_of, text) in CASES.items():
        started = time.perf_counter()
        regex = regex_of()
        grammar = compiled(regex)
        compile_ms = (time.perf_counter() - started) * 1e3
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher, new, cached = TokenMatcher(grammar, vocabulary), [], []
        for token_id in [*ids, None]:
            started = time.perf_counter()
            matcher.mask()
            new.append(time.perf_counter() - started)
            started = time.perf_counter()
            matcher.mask()
            cached.append(time.perf_counter() - started)
            if token_id is not None:
                matcher.accept(token_id)
        assert grammar.is_accepting(matcher.state), f"{form}: the text does not match"
        print(f"{form:<12} {len(regex):>11} {compile_ms:>10.1f} {len(ids):>6} "
              f"{statistics.median(new) * 1e3:>15.2f} / {max(new) * 1e3:>5.2f}       "
              f"{statistics.median(cached) * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
