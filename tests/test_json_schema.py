"""JSON Schema as a regex (structured outputs): for a table of schemas covering each supported keyword,
valid instances match and invalid ones do not, written compactly and with a space after ':' and ','
(with Python's re, and with the token-mask compiler, grammar.py); optional properties and their commas,
exhaustively; tuples' lengths and commas, against jsonschema; random JSON values against any_json_regex, and
random schemas with instances and mutations of them; and the schemas refused, each with its path in the message."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from fractions import Fraction

import jsonschema
import pytest

from twinplane.controlplane.grammar import Grammar
from twinplane.controlplane.json_schema import SchemaError, any_json_regex, schema_regex

LAYOUTS = ((",", ":"), (", ", ": "))


def texts(value) -> list[str]:
    """value as JSON text, compact and with a space after each ':' and ','."""
    return [json.dumps(value, ensure_ascii=False, separators=layout) for layout in LAYOUTS]


def nesting(value) -> int:
    """How deep containers nest in value (a scalar: 0)."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max(map(nesting, children), default=0)


def chain(depth: int, **leaf) -> dict:
    """A tree of nodes depth deep (each but the last with children: the next one and a leaf)."""
    node = {"value": depth, **leaf}
    for level in range(depth - 1):
        node = {"value": level, "children": [node, {"value": -1}]}
    return node


def linked(length: int):
    """A linked list of length cells (None: the empty list)."""
    cell = None
    for head in range(length):
        cell = {"head": head, "tail": cell}
    return cell


TREE = {"$defs": {"node": {"type": "object", "required": ["value"], "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
    "$ref": "#/$defs/node"}
CELL = {"type": "object", "required": ["head", "tail"],
        "properties": {"head": {"type": "integer"}, "tail": {"$ref": "#/definitions/list"}}}
LIST = {"definitions": {"list": {"anyOf": [{"type": "null"}, CELL]}}, "$ref": "#/definitions/list"}
POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}
ENUM = ["plain", 'say "hi"\n', "back\\slash", "a.b*c+d?", "(x)|[y]{z}^$", "ünï 😀", 1, 2.5, True, None,
        {"k": [1, "v"]}, [1, [2]]]

CASES = [  # (name, schema, valid instances, invalid instances)
    ("string", {"type": "string"}, ["", "plain", 'quote " backslash \\ slash /', "tab\t newline\n nul\x00 us\x1f",
                                    "ünï 日本 😀 \u2028"], [1, None, ["a"], {"a": "b"}]),
    ("integer", {"type": "integer"}, [0, -7, 12345678901234567890], [1.5, "1", True, None]),
    ("number", {"type": "number"}, [0, -1.5, 1e-7, 2.5e300, 12, -0.0], ["1", False, [1]]),
    ("boolean", {"type": "boolean"}, [True, False], [0, "true", None]),
    ("null", {"type": "null"}, [None], [0, "", False, "null"]),
    ("type list", {"type": ["string", "null"]}, ["x", None], [1, False, []]),
    ("enum", {"enum": ENUM}, ENUM, ["plainer", "a.bxc+d?", "a.b*c+d", "back\\\\slash", 3, False, {"k": [1]}, [1, 2]]),
    ("const", {"const": "x.y"}, ["x.y"], ["xzy", "x.y ", None]),
    ("const object", {"const": {"a": [1, None]}}, [{"a": [1, None]}], [{"a": [1]}, {"a": [1, None], "b": 1}]),
    ("enum with type", {"type": "string", "enum": ["a", 1, "bc"]}, ["a", "bc"], [1]),
    ("enum with maxLength", {"type": "string", "enum": ["a", "bcd"], "maxLength": 2}, ["a"], ["bcd"]),
    ("nested objects and arrays", {"type": "object", "required": ["name", "points"], "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "points": {"type": "array", "items": POINT}}},
     [{"name": "a", "points": []},
      {"name": "a", "tags": ["x", "y"], "points": [{"x": 1, "y": 2.5}, {"x": -1, "y": 0}]}],
     [{"name": "a"}, {"points": []}, {"name": "a", "points": [{"x": 1}]}, {"name": "a", "points": [], "extra": 1},
      {"points": [], "name": "a"}, {"name": "a", "points": [{"y": 1, "x": 2}]}]),
    ("keys needing escapes", {"type": "object", "properties": {'we"ird.key*': {"type": "integer"}, "a\\b": {}}},
     [{}, {'we"ird.key*': 1}, {'we"ird.key*': 1, "a\\b": [None]}], [{"weXird.key*": 1}, {'we"ird.key': 1}]),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     [{}, {"x": 1, "y": -2}, {'a b"c': 3}], [{"x": "1"}, {"x": 1.5}, []]),
    ("additionalProperties true", {"type": "object", "additionalProperties": True},
     [{}, {"a": {"b": [1, "c", None]}}], [[], "x"]),
    ("any object", {"type": "object"}, [{}, {"a": 1, "b": {"c": [True]}}], [[], 1, None]),
    ("no properties allowed", {"type": "object", "additionalProperties": False}, [{}], [{"a": 1}]),
    ("array bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [[1, 2], [1, 2, 3]], [[], [1], [1, 2, 3, 4], ["a", "b"]]),
    ("array of at least one", {"type": "array", "items": {"type": "boolean"}, "minItems": 1},
     [[True], [True, False, True]], [[], [None]]),
    ("empty array only", {"type": "array", "maxItems": 0}, [[]], [[1]]),
    ("array of anything", {"type": "array"}, [[], [1, "a", [None], {"k": []}]], [{}, "[]"]),
    ("nested arrays", {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
     [[], [[], [1, 2]]], [[[1, 2, 3]], [1]]),
    ("string lengths", {"type": "string", "minLength": 2, "maxLength": 3},
     ["ab", "éé", "日本語", "😀😀", 'a"', "\n\t"], ["", "a", "日本語です", "😀"]),
    ("pattern", {"type": "string", "pattern": "^[a-z]+-\\d{2}$"}, ["abc-12", "x-00"], ["ABC-12", "abc-1", "abc-123"]),
    ("pattern alternatives", {"type": "string", "pattern": "cat|dog"}, ["cat", "dog"], ["catdog", "cow", ""]),
    ("pattern dot", {"type": "string", "pattern": "a.*z"}, ["az", 'a"quoted"z', "a\\z", "a\tz"], ["a\nz", "abc"]),
    ("pattern negated class", {"type": "string", "pattern": "[^@ ]+@[^@ ]+"},
     ["x@y", 'q"uote@b\\s'], ["x@y@z", "x y@z", "@y"]),
    ("pattern of a class holding a quote", {"type": "string", "pattern": "[ -~]+"}, ['say "hi" \\ ok', "~"],
     ["tab\t", "é", ""]),
    ("pattern of escaped characters", {"type": "string", "pattern": '"[a-z]+"\\n\\x41\\u00e9\\.'},
     ['"ab"\nAé.'], ['"ab"Aé.', '"ab"\nAéx']),
    ("pattern repeating escaped characters", {"type": "string", "pattern": 'a\\n+"*[\\\\]?b'},
     ["a\nb", 'a\n\n""\\b'], ["ab", 'a\n"\\\\b', "a\n\\"]),
    ("pattern groups", {"type": "string", "pattern": "(?:ab){2,3}(x|y)?[\\w.\\-]*\\s?"},
     ["abab", "ababx", "abababy_a.b-c", "abab\t"], ["ab", "ababz!"]),
    ("date", {"type": "string", "format": "date"}, ["2024-02-29", "2000-02-29", "1999-12-31", "2023-04-30"],
     ["2023-02-29", "1900-02-29", "2024-13-01", "2024-04-31", "2024-00-10", "24-01-01", "2024-1-01"]),
    ("time", {"type": "string", "format": "time"}, ["12:30:00Z", "23:59:59.25+02:00", "00:00:00-11:30"],
     ["24:00:00Z", "12:30Z", "12:30:00", "12:60:00Z"]),
    ("date-time", {"type": "string", "format": "date-time"}, ["2024-01-31T12:00:00Z", "1999-12-31T23:59:59.9+01:00"],
     ["2024-01-31 12:00:00Z", "2024-01-31T12:00:00", "2024-01-32T12:00:00Z"]),
    ("uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
     ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"]),
    ("email", {"type": "string", "format": "email"}, ["a.b+c@example.com", "x@mail.example.org"],
     ["not an email", "a@b", "@example.com", "a b@example.com"]),
    ("integer minimum 0", {"type": "integer", "minimum": 0}, [0, 7, 100], [-1, 1.5, "1"]),
    ("integer minimum 1", {"type": "integer", "minimum": 1}, [1, 10], [0, -1]),
    ("integer exclusiveMinimum 0", {"type": "integer", "exclusiveMinimum": 0}, [1, 20], [0, -3]),
    ("number minimum 0", {"type": "number", "minimum": 0}, [0, 0.5, 3e5, 7], [-0.5, -1]),
    ("number exclusiveMinimum 0", {"type": "number", "exclusiveMinimum": 0}, [0.5, 3, 0.001, 10.0],
     [0, 0.0, -1, -0.5, 1e-9]),  # 1e-09: bounded numbers have no exponent
    ("integer from 1 to 100", {"type": "integer", "minimum": 1, "maximum": 100}, [1, 9, 10, 99, 100],
     [0, 101, 1000, -1, 50.5]),
    ("integer minimum 18", {"type": "integer", "minimum": 18}, [18, 19, 20, 99, 100, 12345678901234567890],
     [17, 9, 0, -18]),
    ("integer from -40 to 125", {"type": "integer", "minimum": -40, "maximum": 125}, [-40, -9, 0, 7, 125],
     [-41, -400, 126, 1250]),
    ("integer exclusive bounds", {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 10},
     [-2, 0, 9], [-3, 10, -30]),
    ("integer maximum -1", {"type": "integer", "maximum": -1}, [-1, -10, -12345678901234567890], [0, 1, 10]),
    ("integer draft-4 exclusive", {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 255},
     [1, 255], [0, 256]),
    ("number from 0 to 1", {"type": "number", "minimum": 0, "maximum": 1}, [0, 0.5, 1, 1.0, 0.999],
     [1.5, -0.1, 2, 1.01, 1e-9]),
    ("number from -90 to 90", {"type": "number", "minimum": -90, "maximum": 90}, [-90, -89.5, 0, 45.25, 90.0],
     [-90.5, 90.001, 180]),
    ("number exclusiveMaximum 0", {"type": "number", "exclusiveMaximum": 0}, [-0.5, -3, -1000.25], [0, 0.0, 1]),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, [1, "a", ""], ["ab", None, 1.5]),
    ("oneOf", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}, [True, None], [0, "null"]),
    ("allOf of one", {"allOf": [{"type": "integer", "minimum": 1}]}, [3], [0]),
    ("$defs", {"$defs": {"point": POINT}, "type": "object", "required": ["a"],
               "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}},
     [{"a": {"x": 1, "y": 2}}, {"a": {"x": 1, "y": 2}, "b": {"x": 0, "y": 0}}], [{"b": {"x": 1, "y": 2}}, {"a": {}}]),
    ("definitions", {"definitions": {"s": {"type": "string"}}, "type": "array", "items": {"$ref": "#/definitions/s"}},
     [["a"], []], [[1]]),
    ("recursive tree", TREE, [chain(1), chain(3), chain(4), chain(4, children=[])],
     [chain(5), chain(4, children=[{"value": 1}]), {"children": []}]),
    ("recursive list", LIST, [None, linked(1), linked(3)], [linked(4), {"head": 1}]),  # the 4th unrolling: null
    ("$id below the root, over no $ref", {"type": "object", "properties": {"p": {"$id": "p.json", "type": "integer"}}},
     [{}, {"p": 1}], [{"p": "1"}]),
    ("recursive root", {"type": "object", "properties": {"next": {"$ref": "#"}}},
     [{}, {"next": {"next": {}}}], [{"next": 1}]),
    ("any value", {}, [1, "x", None, [1, {"a": [2]}], {"a": {"b": {"c": {"d": 1}}}}, [[[[]]]]],
     [[[[[[1]]]]], {"a": {"b": {"c": {"d": {}}}}}]),
    ("true", True, [1, {"a": [None]}], [[[[[[]]]]]]),
    ("any value in a property", {"type": "object", "properties": {"a": {"description": "anything"}}},
     [{"a": [[[1]]]}], [{"a": [[[[1]]]]}]),
    ("type from keywords", {"properties": {"a": {"type": "integer"}}}, [{"a": 1}, {}], [1, {"a": "x"}]),
    ("annotations", {"type": "integer", "title": "n", "description": "d", "default": 1, "examples": [1],
                     "$comment": "c", "$schema": "https://json-schema.org/draft/2020-12/schema"}, [1], ["1"]),
]

DRAFT_7 = "http://json-schema.org/draft-07/schema#"
INT, STR, BOOL = {"type": "integer"}, {"type": "string"}, {"type": "boolean"}
PAIR = {"type": "array", "prefixItems": [INT, STR], "minItems": 2, "maxItems": 2}  # tuple[int, str] in Pydantic
NESTED_TUPLE = {"$defs": {"t": {"type": "array", "prefixItems": [INT, {"$ref": "#/$defs/t"}]}}, "$ref": "#/$defs/t"}
TUPLE_CASES = [  # (name, schema, valid instances, invalid instances): as jsonschema has them, but deeper than max_depth
    ("tuple of one", {"type": "array", "prefixItems": [INT], "minItems": 1, "maxItems": 1}, [[1], [-5]],
     [[], [1, 2], ["1"], [True], [1.5]]),
    ("tuple of two", PAIR, [[1, "a"], [0, ""]], [[1], ["a", 1], [1, "a", 2], [], [1, 2], {"0": 1, "1": "a"}]),
    ("tuple of three with a rest", {"type": "array", "prefixItems": [INT, STR, BOOL], "items": {"type": "null"}},
     [[], [1], [1, "a"], [1, "a", True], [1, "a", False, None, None]],
     [["a"], [1, 2], [1, "a", True, 1], [1, "a", None], [1, "a", True, None, 0]]),
    ("tuple, any items after", {"type": "array", "prefixItems": [STR, INT]},
     [[], ["a"], ["a", 1], ["a", 1, {"k": [None]}, "x", [2]]], [[1], ["a", "b"], ["a", 1.5, 2]]),
    ("tuple, items false", {"type": "array", "prefixItems": [INT, STR], "items": False},
     [[], [1], [1, "a"]], [[1, "a", None], [1, "a", "b"], ["a"], [1, 1]]),
    ("tuple, minItems shorter than it", {"type": "array", "prefixItems": [INT, STR, BOOL], "items": False,
                                         "minItems": 2}, [[1, "a"], [1, "a", True]], [[], [1], [1, "a", True, None]]),
    ("tuple, maxItems shorter than it", {"type": "array", "prefixItems": [INT, STR, BOOL], "maxItems": 2},
     [[], [1], [1, "a"]], [[1, "a", True], ["a"], [1, True]]),
    ("tuple, minItems past it", {"type": "array", "prefixItems": [INT], "items": STR, "minItems": 2, "maxItems": 3},
     [[1, "a"], [1, "a", "b"]], [[1], [1, "a", "b", "c"], [1, 2], ["a", "b"]]),
    ("tuple in a tuple", {"type": "array", "prefixItems": [STR, {"type": "array", "prefixItems": [
        {"type": "number"}, {"type": "number"}], "minItems": 2, "maxItems": 2}], "minItems": 2, "maxItems": 2},
     [["a", [1, 2.5]], ["", [-1e5, 0]]], [["a", [1]], ["a", [1, 2, 3]], ["a", ["1", 2]], [["a"], [1, 2]], ["a"]]),
    ("tuple in an object", {"type": "object", "properties": {"pair": PAIR, "n": INT}, "required": ["pair"]},
     [{"pair": [1, "a"]}, {"pair": [2, "b"], "n": 3}], [{"pair": [1]}, {"pair": ["a", 1]}, {"n": 3}]),
    ("tuple, an item false", {"type": "array", "prefixItems": [INT, False, STR]}, [[], [1]],
     [[1, 2], [1, None], [1, "a"], [1, 2, "a"]]),
    ("recursive tuple", NESTED_TUPLE, [[], [1], [1, []], [1, [2, [3]]], [1, [2, [3, [4]]]], [1, [2], None]],
     [[1, [2, [3, [4, []]]]], ["a"], [1, 2]]),  # the 5th array deep: past max_depth
    ("draft 7 items list, additionalItems false", {"$schema": DRAFT_7, "type": "array", "items": [INT, STR],
                                                   "additionalItems": False},
     [[], [1], [1, "a"]], [[1, "a", 2], [1, "a", "b"], ["a"]]),
    ("draft 7 items list, additionalItems schema", {"$schema": DRAFT_7, "type": "array", "items": [INT],
                                                    "additionalItems": BOOL, "minItems": 1},
     [[1], [1, True, False]], [[], [1, 1], [True], [1, None]]),
    ("draft 7 items list, any items after", {"$schema": DRAFT_7, "type": "array", "items": [INT]},
     [[], [1], [1, "x", None]], [["x"], [None, 1]]),
    ("draft 7 additionalItems beside an items schema", {"$schema": DRAFT_7, "type": "array", "items": INT,
                                                        "additionalItems": False},
     [[], [1, 2, 3]], [["a"], [1, "a"]]),  # ignored, as the spec says
    ("items false", {"type": "array", "items": False}, [[]], [[1], [None], [[]]]),
    ("items false, maxItems 0", {"type": "array", "items": False, "maxItems": 0, "minItems": 0}, [[]], [[1]]),
]
CASES += TUPLE_CASES


@pytest.mark.parametrize("schema, valid, invalid", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_schema_table(schema, valid, invalid):
    regex = re.compile(schema_regex(schema))
    for value in valid:
        for text in texts(value):
            assert regex.fullmatch(text), text
    for value in invalid:
        for text in texts(value):
            assert not regex.fullmatch(text), text


@pytest.mark.parametrize("schema, valid, invalid", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_schema_table_through_token_grammar(schema, valid, invalid):
    """The regexes keep to the subset the token-mask compiler takes, and mean there what they mean to re."""
    grammar = Grammar.from_regex(schema_regex(schema))
    for value, expected in [(v, True) for v in valid] + [(v, False) for v in invalid]:
        for text in texts(value):
            assert grammar.is_accepting(grammar.advance(grammar.initial_state, text.encode())) == expected, text


@pytest.mark.parametrize("schema, valid, invalid", [case[1:] for case in TUPLE_CASES],
                         ids=[case[0] for case in TUPLE_CASES])
def test_tuple_cases_agree_with_jsonschema(schema, valid, invalid):
    """The tuple cases' verdicts are the spec's (jsonschema's), but for values nested deeper than max_depth."""
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    for value in valid:
        assert validator.is_valid(value) and nesting(value) <= 4, value
    for value in invalid:
        assert not validator.is_valid(value) or nesting(value) > 4, value


@pytest.mark.parametrize("low, high, rest", [(low, high, rest) for low in (0, 1, 3, 4) for high in (None, 2, 3, 5)
                                              for rest in ("any", "null", False) if high is None or low <= high])
def test_tuple_lengths_and_commas(low, high, rest):
    """Against jsonschema, for a tuple of three beside minItems, maxItems and a rest: arrays of each length, of
    the right items and with one wrong, match iff valid; stray, doubled and missing commas never match."""
    schema = {"type": "array", "prefixItems": [INT, STR, BOOL], "minItems": low}
    schema.update({} if high is None else {"maxItems": high}, **{} if rest == "any" else {"items": rest and {
        "type": "null"}})
    if rest is False and low > 3:
        with pytest.raises(SchemaError, match="^schema.items: false allows no items past the 3 of prefixItems"):
            schema_regex(schema)
        return
    regex = re.compile(schema_regex(schema))
    grammar = Grammar.from_regex(regex.pattern)
    validator = jsonschema.Draft202012Validator(schema)
    right = [7, "s", True, None, None, None]
    for length in range(7):
        values = [right[:length]] + [right[:i] + [{"x": 1}] + right[i + 1:length] for i in range(length)]
        for value in values:
            for text in texts(value):
                assert bool(regex.fullmatch(text)) == validator.is_valid(value), (schema, text)
                assert through_grammar(grammar, text) == validator.is_valid(value), (schema, text)
        items = [json.dumps(v) for v in right[:length]]
        malformed = ["[," + ",".join(items) + "]", "[" + ",".join(items) + ",]"]
        malformed += ["[" + "".join(items) + "]"] * (length > 1)
        malformed += ["[" + ",".join(items[:k]) + ",," + ",".join(items[k:]) + "]" for k in range(1, length)]
        for text in malformed:
            assert not regex.fullmatch(text), (schema, text)


def test_tuple_regex_grows_linearly():
    """Each item of a tuple past minItems nests one optional group: the size grows with the items, linearly,
    up to MAX_OPTIONAL of them; the token-mask compiler takes the deepest."""
    sizes = [len(schema_regex({"type": "array", "prefixItems": [INT] * n, "items": False})) for n in (16, 32, 64)]
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0]), sizes
    regex = schema_regex({"type": "array", "prefixItems": [INT] * 64, "items": False})
    grammar = Grammar.from_regex(regex)
    for n in (0, 1, 63, 64, 65):
        text = json.dumps(list(range(n)))
        assert bool(re.fullmatch(regex, text)) == through_grammar(grammar, text) == (n <= 64), n
    regex = schema_regex({"type": "array", "prefixItems": [INT] * 100, "minItems": 36, "maxItems": 100})
    assert re.fullmatch(regex, json.dumps(list(range(36)))) and not re.fullmatch(regex, json.dumps(list(range(35))))


def test_string_and_number_syntax():
    """Text that is no JSON string or number never matches (what json.dumps cannot write)."""
    string, integer, number = (re.compile(schema_regex({"type": t})) for t in ("string", "integer", "number"))
    for text in ['"a"b"', '"a\\"', '"\\x41"', '"\\u12"', '"tab\there"', '"new\nline"', "'a'", '"a', 'a"']:
        assert not string.fullmatch(text), text
    for text in ['"\\u00e9\\/\\b\\f"', '"\\ud83d\\ude00"']:
        assert string.fullmatch(text), text
    for text in ["01", "-", "+1", "1.", ".5", "1e", "1e+", "--1", "1 ", "0x10", "NaN", "Infinity"]:
        assert not number.fullmatch(text) and not integer.fullmatch(text), text
    for text in ["1E5", "-0", "1.5e-3", "0.0"]:
        assert number.fullmatch(text), text


SHORTHAND_CASES = [  # (pattern, strings Python's re matches whole, strings it does not)
    ("\\S+", ["a!", "~\x7f", "\x00\x1b"], ["\x1c", "\x1f", "\x85", "\u3000", "a\u2028"]),
    ("\\D", ["a", " ", "\x1c", "\n"], ["7", "\u0663", "\uff11"]),
    ("\\W", ["-", " ", "\x00"], ["_", "a", "\u00e9", "\u0663"]),
    ("[^\\s,]+", ["ab", 'q"\\'], ["a,b", "\x1d", "\xa0"]),
    ("[^\\d]", ["x"], ["7", "\u0663"]),
    ("\\d+", ["0", "42"], ["x"]),
    ("[\\w.]+", ["a_1.b"], ["-"]),
    ("\\s", [" ", "\t", "\x1c"], ["a"]),
]


@pytest.mark.parametrize("pattern, valid, invalid", SHORTHAND_CASES, ids=[case[0] for case in SHORTHAND_CASES])
def test_pattern_shorthands_as_python_reads_them(pattern, valid, invalid):
    """``\\d \\w \\s`` and their negations mean what Python's re makes of them, in Unicode (\\x1c is a space to it,
    \\u0663 a digit): of a negated one only ASCII characters come, those it allows; re and the token-mask compiler
    read the regex alike."""
    regex = schema_regex({"type": "string", "pattern": pattern})
    grammar = Grammar.from_regex(regex)
    for value, expected in [(v, True) for v in valid] + [(v, False) for v in invalid]:
        assert bool(re.fullmatch(pattern, value)) == expected, value
        text = json.dumps(value, ensure_ascii=False)
        assert bool(re.fullmatch(regex, text)) == expected, (regex, text)
        assert through_grammar(grammar, text) == expected, (regex, text)
    for value in ["\u0663", "\u00e9", "\u3000", "\x85"]:
        text = json.dumps(value, ensure_ascii=False)
        assert bool(re.fullmatch(regex, text)) == through_grammar(grammar, text), (regex, text)


def test_string_lengths_count_characters_as_the_string_holds_them():
    """minLength and maxLength count characters as the string holds them: where the length is bounded, a
    character past U+FFFF comes as itself, one character, never as a surrogate pair of \\u escapes (two)."""
    regex = schema_regex({"type": "string", "minLength": 2, "maxLength": 2})
    grammar = Grammar.from_regex(regex)
    for text, expected in [('"a😀"', True), ('"😀\\u00e9"', True), ('"😀😀"', True), ('"a\\ud83d\\ude00"', False),
                           ('"\\ud7ff\\ue000"', True), ('"\\ud83d\\ude00"', False), ('"a\\ud83d\\ude00b"', False),
                           ('"a\\ud800"', False), ('"\\udc00a"', False), ('"\\ude00\\ud83d"', False)]:
        assert bool(re.fullmatch(regex, text)) == expected, text
        assert through_grammar(grammar, text) == expected, text
        if expected:
            assert len(json.loads(text)) == 2, text


@pytest.mark.parametrize("schema, value", [
    ({"enum": ["\ud800", "a"]}, "\ud800"), ({"const": "x\udfff"}, "x\udfff"),
    ({"type": "object", "properties": {"\ud800": {"const": 1}}, "required": ["\ud800"]}, {"\ud800": 1}),
    ({"type": "string", "pattern": "\udc00+"}, "\udc00\udc00"),
], ids=["enum", "const", "property", "pattern"])
def test_lone_surrogates_come_escaped(schema, value):
    """A lone surrogate in a name, a value or a pattern (JSON may hold one, UTF-8 cannot) is offered as its \\u
    escape, which the token-mask compiler takes and which reads back as the value."""
    regex = schema_regex(schema)
    text = json.dumps(value)
    assert re.fullmatch(regex, text) and through_grammar(Grammar.from_regex(regex), text)
    assert json.loads(text) == value


@pytest.mark.parametrize("pattern", [".*", "[ -~]*", "[^x]*", "\\S*", "(?:a|\\W)*", '["\\\\\\n]*'])
def test_patterns_keep_strings_json(pattern):
    """Whatever a pattern allows, a bare quote, a lone backslash or a raw control character never matches."""
    regex = re.compile(schema_regex({"type": "string", "pattern": pattern}))
    for text in ['"a"b"', '"a\\"', '"\\"', '"\n"', '"\x00"', '"a\\x"']:
        assert not regex.fullmatch(text), (pattern, text)


def test_layout():
    """One optional space after ':' and ',', and no whitespace anywhere else."""
    regex = re.compile(schema_regex({"type": "object", "properties": {"a": {"type": "array"}}}))
    assert regex.fullmatch('{"a": [1, 2]}') and regex.fullmatch('{"a":[1,2]}')
    for text in ['{ "a":[1]}', '{"a" :[1]}', '{"a":  [1]}', '{"a":[1 ,2]}', '{"a":[1,  2]}', '{"a":[1]} ',
                 '{"a":\n[1]}', '{"a":[ 1]}']:
        assert not regex.fullmatch(text), text


@pytest.mark.parametrize("required", ["".join(r) for n in range(5) for r in itertools.combinations("abcd", n)])
def test_optional_properties_and_commas(required):
    """Every subset of the properties, in order, matches iff it holds the required ones; stray, doubled
    and missing commas, and properties out of order, never match."""
    names = "abcd"
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": list(required)}
    regex = re.compile(schema_regex(schema))
    for present in ("".join(s) for n in range(5) for s in itertools.combinations(names, n)):
        value = {name: i for i, name in enumerate(present)}
        for text in texts(value):
            assert bool(regex.fullmatch(text)) == (set(required) <= set(present)), (required, text)
        members = [f'"{name}":{i}' for i, name in enumerate(present)]
        malformed = ["{," + ",".join(members) + "}", "{" + ",".join(members) + ",}"]
        malformed += ["{" + "".join(members) + "}"] * (len(members) > 1)
        malformed += ["{" + ",".join(members[:k]) + ",," + ",".join(members[k:]) + "}" for k in range(1, len(members))]
        malformed += ["{" + ",".join(reversed(members)) + "}"] * (len(members) > 1)
        malformed += ["{" + ",".join(members + members[-1:]) + "}"] * bool(members)
        for text in malformed:
            if text != "{}":
                assert not regex.fullmatch(text), (required, text)


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice('ab Z09"\\/\n\t\x00\x1f\x7fé日😀\u2028{}[],:') for _ in range(rng.randint(0, 6)))


def random_value(rng: random.Random, depth: int, kind: str | None = None):
    """A random JSON value whose containers nest at most depth deep."""
    kind = kind or rng.choice(["string", "int", "float", "bool", "null"] + ["list", "dict"] * 3 * (depth > 0))
    if kind == "list":
        return [random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {random_string(rng): random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))}
    return {"string": random_string, "int": lambda r: r.randint(-10**12, 10**12), "bool": lambda r: r.random() < 0.5,
            "float": lambda r: r.choice([r.uniform(-1e3, 1e3), r.uniform(-1, 1) * 10.0 ** r.randint(-30, 30), -0.0]),
            "null": lambda r: None}[kind](rng)


def test_any_json_random():
    """Objects at the top nesting at most max_depth deep match; other values, and deeper objects, do not."""
    rng = random.Random(20240601)
    regexes = {depth: re.compile(any_json_regex(depth)) for depth in (1, 2, 4)}
    counts = {True: 0, False: 0}
    for _ in range(400):
        max_depth = rng.choice(list(regexes))
        value = random_value(rng, rng.randint(0, max_depth + 2), "dict" if rng.random() < 0.8 else None)
        expected = isinstance(value, dict) and nesting(value) <= max_depth
        counts[expected] += 1
        for text in texts(value):
            assert bool(regexes[max_depth].fullmatch(text)) == expected, (max_depth, text)
    assert min(counts.values()) > 50


ENUM_POOL = ["red", "gr.een", 'bl"ue', 7, None, True, [1, "x"], {"k": "v"}]
NAME_POOL = ["id", "name", 'we"ird.key', "back\\slash", "ünï", "x*y", "tags", "n"]
WRONG = {"string": 7, "integer": "7", "number": "7.5", "boolean": "true", "null": 0, "array": {}, "object": []}


def random_schema(rng: random.Random, depth: int, kind: str | None = None) -> dict:
    """A random schema of the supported subset (objects: additionalProperties false)."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum"] + ["array", "object"] * (depth > 0)
    kind = kind or rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(ENUM_POOL, rng.randint(1, 4))}
    schema = {"type": kind}
    if kind == "string":
        schema.update(rng.choice([{}, {"minLength": 1, "maxLength": 4}, {"format": "date"}, {"pattern": "^[a-z]{1,5}$"},
                                  {"enum": ["a.b", "c"]}]))
    elif kind in ("integer", "number"):
        schema.update(rng.choice([{}, {"minimum": 0}, {"minimum": 1}, {"minimum": -5, "maximum": 20}, {"maximum": 3},
                                  {"exclusiveMinimum": 1, "exclusiveMaximum": 7}]))
    elif kind == "array" and rng.random() < 0.4:  # a tuple, with a rest or none
        prefix = [random_schema(rng, depth - 1) for _ in range(rng.randint(1, 3))]
        low = rng.randint(0, len(prefix) + 1)
        schema.update(prefixItems=prefix, items=rng.choice([False, random_schema(rng, depth - 1)]), minItems=low,
                      **rng.choice([{}, {"maxItems": low + 1}]))
        if schema["items"] is False and low > len(prefix):
            schema["items"] = random_schema(rng, depth - 1)
    elif kind == "array":
        low = rng.randint(0, 2)
        schema.update(items=random_schema(rng, depth - 1), minItems=low, **rng.choice([{}, {"maxItems": low + 2}]))
    elif kind == "object":
        names = rng.sample(NAME_POOL, rng.randint(1, 4))
        schema.update(properties={name: random_schema(rng, depth - 1) for name in names}, additionalProperties=False,
                      required=[name for name in names if rng.random() < 0.5])
    return schema


def random_instance(rng: random.Random, schema: dict):
    """A random value valid under a schema of random_schema's."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        if "format" in schema:
            return f"{rng.randint(1000, 2999)}-{rng.randint(1, 12):02}-{rng.randint(1, 28):02}"
        if "pattern" in schema:
            return "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 5)))
        return "".join(rng.choice('a é"\\\n日😀') for _ in range(rng.randint(schema.get("minLength", 0), 4)))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1000) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 1000) - 1)
        if kind == "number" and rng.random() < 0.5:
            return round(rng.uniform(low, high), 3) + 0.0  # + 0.0: never -0.0
        return rng.randint(low, high)
    if kind == "array":
        prefix = schema.get("prefixItems", [])
        most = schema.get("maxItems", schema["minItems"] + 3)
        count = rng.randint(schema["minItems"], most if schema["items"] is not False else min(most, len(prefix)))
        return [random_instance(rng, prefix[i] if i < len(prefix) else schema["items"]) for i in range(count)]
    if kind == "object":
        return {name: random_instance(rng, sub) for name, sub in schema["properties"].items()
                if name in schema["required"] or rng.random() < 0.5}
    return rng.random() < 0.5 if kind == "boolean" else None


def mutations(rng: random.Random, schema: dict, value: dict) -> list[dict]:
    """Invalid variants of an object valid under schema: a required property gone, an extra one, a wrong type."""
    out = [{**value, "extra_property": 1}]
    if schema["required"]:
        gone = rng.choice(schema["required"])
        out.append({k: v for k, v in value.items() if k != gone})
    for name in value:
        sub = schema["properties"][name]
        out.append({**value, name: wrong(sub)})
        if "prefixItems" not in sub:
            continue
        items = value[name]
        if items:  # a tuple's first item of the wrong type
            out.append({**value, name: [wrong(sub["prefixItems"][0])] + items[1:]})
        most = min(sub.get("maxItems", math.inf), len(sub["prefixItems"]) if sub["items"] is False else math.inf)
        if len(items) == most:  # one item too many
            out.append({**value, name: items + [None]})
        if items and len(items) == sub["minItems"]:  # one too few
            out.append({**value, name: items[:-1]})
    return out


def wrong(schema: dict):
    """A value invalid under a schema of random_schema's."""
    return WRONG[schema["type"]] if "type" in schema else "not in the enum"


def test_random_schemas():
    """Random instances of random schemas (jsonschema's verdict: valid) match their regex; mutated instances
    (invalid) do not."""
    rng = random.Random(7)
    tuples = 0
    for _ in range(120):
        schema = random_schema(rng, 3, "object")
        regex = re.compile(schema_regex(schema))
        validator = jsonschema.Draft202012Validator(schema)
        tuples += '"prefixItems"' in json.dumps(schema)
        for _ in range(8):
            value = random_instance(rng, schema)
            assert validator.is_valid(value), (schema, value)
            for text in texts(value):
                assert regex.fullmatch(text), (schema, text)
            for bad in mutations(rng, schema, value):
                assert not validator.is_valid(bad), (schema, bad)
                for text in texts(bad):
                    assert not regex.fullmatch(text), (schema, text)
    assert tuples >= 10, tuples


def through_grammar(grammar: Grammar, text: str) -> bool:
    """Whether the token-mask compiler's automaton, fed text one byte at a time, ends in a full match."""
    state = grammar.initial_state
    for byte in text.encode():
        state = grammar.advance(state, bytes([byte]))
    return grammar.is_accepting(state)


def bound_keywords(rng: random.Random, value: int, lower: bool) -> dict:
    """Keywords that bound the integers at value (the least allowed, or the greatest), in a random form of
    those a schema may use: plain, exclusive (2020-12 and draft 4), fractional, float, beside a looser bound."""
    plain, exclusive = ("minimum", "exclusiveMinimum") if lower else ("maximum", "exclusiveMaximum")
    out = 1 if lower else -1  # from value toward the excluded side is -out
    forms = [{plain: value}, {exclusive: value - out}, {plain: value - out, exclusive: True},
             {plain: value, exclusive: value - 7 * out}, {exclusive: value - out, plain: value - 3 * out}]
    if abs(value) < 10 ** 15:  # floats hold it exactly
        forms += [{plain: value - 0.5 * out}, {exclusive: value - 0.5 * out}, {plain: float(value)}]
    return rng.choice(forms)


def random_integer(rng: random.Random) -> int:
    """Small, next to a power of ten, or large; either sign."""
    pick = rng.random()
    if pick < 0.4:
        return rng.randint(-60, 60)
    sign = rng.choice([-1, 1])
    if pick < 0.75:
        return sign * (10 ** rng.randint(1, 7) + rng.randint(-2, 2))
    return sign * rng.randint(0, 10 ** rng.randint(2, 22))


BIG = sorted({s * (10 ** k + d) for k in range(27) for d in (-1, 0, 1) for s in (-1, 1)})


def test_integer_ranges_random():
    """For random ranges (bounded or not, negative, single values, across 0 and powers of ten), each integer
    around the range, and very large ones, matches iff it is in it; zero-padded, -0 and +1 forms never do."""
    rng = random.Random(1234)
    kinds = {"bounded": 0, "lower": 0, "upper": 0, "single": 0, "across 0": 0}
    for case in range(500):
        low, high = sorted([random_integer(rng), random_integer(rng)])
        if case % 10 == 0:
            high = low
        if case % 7 == 1:
            low = None
        elif case % 7 == 2:
            high = None
        schema = {"type": "integer"}
        for value, lower in ((low, True), (high, False)):
            if value is not None:
                schema.update(bound_keywords(rng, value, lower))
        regex = schema_regex(schema)
        compiled = re.compile(regex)
        kinds["bounded" if None not in (low, high) else "lower" if high is None else "upper"] += 1
        kinds["single"] += low == high
        kinds["across 0"] += (low is None or low < 0) and (high is None or high >= 0)
        ends = [v for v in (low, high) if v is not None]
        if None not in (low, high) and high - low <= 2000:
            values = list(range(low - 50, high + 51))
        else:
            values = [v + d for v in ends for d in range(-50, 51)] + BIG
            values += [rng.randint(low, high) for _ in range(50)] if None not in (low, high) else []

        def inside(v: int) -> bool:
            return (low is None or v >= low) and (high is None or v <= high)

        for v in values:
            assert bool(compiled.fullmatch(str(v))) == inside(v), (schema, regex, v)
        for v in [v for v in values if inside(v)][:200]:
            padded = "0" + str(v) if v >= 0 else "-0" + str(-v)
            for text in (padded, "+" + str(v)):
                assert not compiled.fullmatch(text), (schema, regex, text)
        for text in ("-0", "00", "-00", "+0", ""):
            assert not compiled.fullmatch(text), (schema, regex, text)
        grammar = Grammar.from_regex(regex)
        for v in rng.sample(values, 6) + ends:
            assert through_grammar(grammar, str(v)) == inside(v), (schema, regex, v)
            assert not through_grammar(grammar, "0" + str(abs(v))), (schema, regex, v)
        assert not through_grammar(grammar, "-0")
    assert min(kinds.values()) >= 30, kinds


def test_integer_range_construction():
    """Ranges split into pieces sharing a prefix, then digit ranges; the size grows with the digits, linearly."""
    assert schema_regex({"type": "integer", "minimum": 18, "maximum": 255}) == \
        "(?:1[89]|[2-9][0-9]|1[0-9]{2}|2[0-4][0-9]|25[0-5])"
    assert schema_regex({"type": "integer", "minimum": 1}) == "[1-9][0-9]*"
    assert schema_regex({"type": "integer", "maximum": -10}) == "-[1-9][0-9]+"
    sizes = [len(schema_regex({"type": "integer", "minimum": -(10 ** n) // 7, "maximum": 10 ** n // 3}))
             for n in (50, 100, 200, 400)]
    assert sizes[-1] < 20_000 and sizes[-1] < 2.5 * sizes[-2] < 6.25 * sizes[-3], sizes
    huge = 10 ** 999
    regex = re.compile(schema_regex({"type": "integer", "minimum": -huge + 12345, "maximum": huge - 54321}))
    for v, expected in [(0, True), (huge - 54321, True), (huge - 54320, False), (-huge + 12345, True),
                        (-huge + 12344, False), (huge, False), (-huge // 3, True)]:
        assert bool(regex.fullmatch(str(v))) == expected, v


NUMBER_CASES = [  # (schema, texts that match, texts that do not)
    ({"minimum": 0, "maximum": 1}, ["0", "0.5", "1", "1.0", "1.00", "0.0", "0.999", "0.000"],
     ["1.5", "-0.1", "2", "01", "1.01", "1.000001", "-0", "-0.0", "-1", "1e0", "0.", ".5", "00.5", "+0.5", "1.5e-1"]),
    ({"minimum": 0, "exclusiveMaximum": 1}, ["0", "0.0", "0.99999"], ["1", "1.0", "1.5", "-0.5"]),
    ({"exclusiveMinimum": 0}, ["0.001", "0.1", "1", "10.5", "1000000000000000000000"],
     ["0", "0.0", "0.000", "-1", "-0.5", "-0", "1e3", "01"]),
    ({"minimum": -1, "maximum": 1}, ["-1", "-1.0", "-0.5", "0", "0.25", "1", "1.000"],
     ["-1.5", "-1.01", "1.5", "1.01", "-0", "-0.0", "-2", "2"]),
    ({"exclusiveMinimum": -1, "exclusiveMaximum": 1}, ["-0.999", "0", "0.5", "-0.001"],
     ["-1", "-1.0", "1", "1.0", "-1.5"]),
    ({"maximum": -2}, ["-2", "-2.0", "-2.01", "-3.5", "-100"], ["-1.99", "-1", "0", "2", "-2.5e1"]),
    ({"exclusiveMaximum": -2}, ["-2.01", "-3", "-20"], ["-2", "-2.0", "-2.000", "-1", "0"]),
    ({"minimum": 10, "maximum": 10}, ["10", "10.0", "10.00"], ["10.1", "9.9", "9.99", "11", "1", "100"]),
    ({"minimum": 5, "exclusiveMinimum": True}, ["5.1", "5.001", "6", "1000.5"], ["5", "5.0", "4.9", "-6"]),
    ({"minimum": 0, "maximum": 100.0}, ["100", "99.9", "0.5", "100.0"], ["100.1", "101", "-0.5", "1000"]),
    ({"minimum": -273, "exclusiveMinimum": -300, "maximum": 5.0e3}, ["-273", "-272.5", "4999.99", "5000"],
     ["-273.15", "-274", "5000.01", "5001"]),
    ({"minimum": 0.5, "exclusiveMinimum": 1}, ["1.5", "2"], ["1", "0.75"]),  # the tighter bound, 1, is whole
    ({"maximum": 99, "exclusiveMaximum": 99}, ["98.99", "-5"], ["99", "99.0"]),  # at a tie the exclusive one
]


@pytest.mark.parametrize("bounds, valid, invalid", NUMBER_CASES, ids=[json.dumps(c[0]) for c in NUMBER_CASES])
def test_number_bounds_table(bounds, valid, invalid):
    regex = schema_regex({"type": "number", **bounds})
    grammar = Grammar.from_regex(regex)
    for text, expected in [(t, True) for t in valid] + [(t, False) for t in invalid]:
        assert bool(re.fullmatch(regex, text)) == expected, (regex, text)
        assert through_grammar(grammar, text) == expected, (regex, text)


def test_number_ranges_random():
    """Random whole-number bounds, exclusive or not; random decimals (fractions, zeros, values at and
    around the bounds) match iff their exact value is within the bounds; -0 in any form never does."""
    rng = random.Random(4321)
    counts = {True: 0, False: 0}
    for case in range(120):
        ends = [rng.choice([rng.randint(-30, 30), rng.choice([-1, 1]) * 10 ** rng.randint(0, 4), 0])
                for _ in range(2)]
        (low, low_exclusive), (high, high_exclusive) = sorted((v, rng.random() < 0.5) for v in ends)
        if case % 5 == 1:
            low = None
        elif case % 5 == 2:
            high = None
        if low is not None and high is not None and low == high and (low_exclusive or high_exclusive):
            continue  # empty
        schema = {"type": "number"}
        for value, exclusive, plain in ((low, low_exclusive, "minimum"), (high, high_exclusive, "maximum")):
            if value is None:
                continue
            if exclusive:
                schema.update(rng.choice([{"exclusive" + plain.capitalize(): value},
                                          {plain: value, "exclusive" + plain.capitalize(): True}]))
            else:
                schema[plain] = rng.choice([value, float(value)])
        regex = schema_regex(schema)
        compiled = re.compile(regex)
        grammar = Grammar.from_regex(regex) if case % 4 == 0 else None
        near = [v for v in (low, high, 0) if v is not None]
        for _ in range(150):
            base = rng.choice(near) + rng.randint(-2, 2) if rng.random() < 0.8 else rng.randint(-10 ** 6, 10 ** 6)
            negative = base < 0 or (base == 0 and rng.random() < 0.4)
            fraction = rng.choice(["", "", "." + "0" * rng.randint(1, 3), "." + "9" * rng.randint(1, 4),
                                   "." + "0" * rng.randint(0, 3) + "1", "." + str(rng.randint(0, 10 ** 5))])
            text = "-" * negative + str(abs(base)) + fraction
            value = Fraction(text)
            if negative and value == 0:
                expected = False  # -0, -0.00: JSON, but never offered
            else:
                expected = ((low is None or value > low or value == low and not low_exclusive) and
                            (high is None or value < high or value == high and not high_exclusive))
            assert bool(compiled.fullmatch(text)) == expected, (schema, regex, text)
            counts[expected] += 1
            if grammar is not None:
                assert through_grammar(grammar, text) == expected, (schema, regex, text)
            for bad in ("0" + text.lstrip("-"), text + "e0", "+" + text):
                assert not compiled.fullmatch(bad), (schema, regex, bad)
    assert min(counts.values()) > 3000, counts


@pytest.mark.timeout(60)
def test_refs_met_again_expand_once():
    """A $ref met again at the same depth, with the same $refs open, is not expanded again: fifty references to
    the root build at once; $refs that expand one another without end are refused, not followed."""
    assert schema_regex({"anyOf": [{"$ref": "#"} for _ in range(50)] + [{"type": "null"}]}) == "null"
    assert schema_regex({"anyOf": [{"$ref": "#"} for _ in range(50)] + [{"type": "null"}]}, max_depth=8) == "null"
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{j}"} for j in range(8)] + [{"type": "null"}]} for i in range(8)}
    with pytest.raises(SchemaError, match="subschemas"):
        schema_regex({"$defs": defs, "$ref": "#/$defs/d0"})


def test_max_depth():
    assert re.fullmatch(any_json_regex(1), '{"a":1}') and not re.fullmatch(any_json_regex(1), '{"a":[]}')
    one_level = re.compile(schema_regex({}, max_depth=1))
    assert one_level.fullmatch("[1]") and not one_level.fullmatch("[[1]]")
    shallow = re.compile(schema_regex(TREE, max_depth=2))
    assert shallow.fullmatch(json.dumps(chain(2))) and not shallow.fullmatch(json.dumps(chain(3)))
    with pytest.raises(ValueError):
        any_json_regex(0)
    with pytest.raises(SchemaError, match="max_depth"):
        any_json_regex(8)


def optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


REFUSED = [  # (schema, the path the message starts with)
    (False, "schema"),
    ([], "schema"),
    ({"type": "object", "properties": {"a": False}}, "schema.properties.a"),
    ({"type": "strin"}, "schema.type"),
    ({"type": []}, "schema.type"),
    ({"not": {}}, "schema.not"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "schema.properties.a.if"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "schema.patternProperties"),
    ({"type": "object", "minProperties": 1}, "schema.minProperties"),
    ({"type": "object", "required": ["a"]}, "schema.required"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "schema.required"),
    (optional_properties(65), "schema.properties"),
    ({"type": "integer", "multipleOf": 2}, "schema.multipleOf"),
    ({"type": "integer", "minimum": True}, "schema.minimum"),
    ({"type": "integer", "maximum": "9"}, "schema.maximum"),
    ({"type": "integer", "exclusiveMaximum": float("inf")}, "schema.exclusiveMaximum"),
    ({"type": "integer", "minimum": float("nan")}, "schema.minimum"),
    ({"type": "integer", "minimum": 10 ** 1000}, "schema.minimum"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "schema.maximum"),
    ({"type": "integer", "minimum": 2.5, "maximum": 2.9}, "schema.maximum"),
    ({"type": "integer", "exclusiveMinimum": 3, "maximum": 3}, "schema.maximum"),
    ({"type": "integer", "minimum": 3, "maximum": 3, "exclusiveMaximum": True}, "schema.maximum"),
    ({"type": "integer", "exclusiveMinimum": True}, "schema.exclusiveMinimum"),
    ({"type": "number", "exclusiveMaximum": True}, "schema.exclusiveMaximum"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "schema.exclusiveMaximum"),
    ({"type": "number", "minimum": 2, "maximum": 1}, "schema.maximum"),
    ({"type": "number", "maximum": 0.5}, "schema.maximum"),
    ({"type": "number", "minimum": 0, "exclusiveMaximum": 2.5}, "schema.exclusiveMaximum"),
    ({"type": "object", "properties": {"p": {"type": "number", "minimum": -0.1}}}, "schema.properties.p.minimum"),
    ({"type": "array", "prefixItems": [{}], "items": [{}]}, "schema.items"),
    ({"type": "array", "prefixItems": {"type": "integer"}}, "schema.prefixItems"),
    ({"type": "array", "items": False, "minItems": 1}, "schema.items"),
    ({"type": "array", "prefixItems": [{}, {}], "items": False, "minItems": 3}, "schema.items"),
    ({"type": "array", "items": [{}], "additionalItems": False, "minItems": 2}, "schema.additionalItems"),
    ({"type": "array", "prefixItems": [{}, False], "minItems": 2}, "schema.prefixItems[1]"),
    ({"type": "array", "prefixItems": [{"not": {}}]}, "schema.prefixItems[0].not"),
    ({"type": "array", "items": [{}], "additionalItems": {"uniqueItems": True}}, "schema.additionalItems.uniqueItems"),
    ({"type": "array", "prefixItems": [{}] * 65}, "schema.prefixItems"),
    ({"$defs": {"t": {"type": "array", "prefixItems": [{"$ref": "#/$defs/t"}], "minItems": 1}}, "$ref": "#/$defs/t"},
     "schema.$defs.t.prefixItems[0].$ref"),
    ({"type": "array", "uniqueItems": True}, "schema.uniqueItems"),
    ({"type": "array", "contains": {}}, "schema.contains"),
    ({"type": "array", "maxItems": 1001}, "schema.maxItems"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "schema.maxItems"),
    ({"type": "array", "minItems": -1}, "schema.minItems"),
    ({"type": "string", "maxLength": 5000}, "schema.maxLength"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "schema.maxLength"),
    ({"type": "string", "format": "date", "pattern": "x"}, "schema.format"),
    ({"type": "array", "items": {"type": "string", "format": "hostname"}}, "schema.items.format"),
    ({"type": "string", "contentEncoding": "base64"}, "schema.contentEncoding"),
    ({"enum": []}, "schema.enum"),
    ({"const": float("nan")}, "schema.const"),  # no JSON text writes NaN or an infinity (1e400 reads as one)
    ({"enum": [1, float("inf")]}, "schema.enum"),
    ({"const": 10 ** 5000}, "schema.const"),  # more digits than Python's json writes
    ({"enum": [1], "const": 10 ** 5000}, "schema.const"),
    ({"type": "integer", "enum": [10 ** 5000]}, "schema.enum"),
    ({"type": "integer", "enum": ["a"]}, "schema.enum"),
    ({"anyOf": []}, "schema.anyOf"),
    ({"oneOf": {}}, "schema.oneOf"),
    ({"allOf": [{}, {}]}, "schema.allOf"),
    ({"type": "object", "anyOf": [{}]}, "schema.anyOf"),
    ({"$ref": "#", "type": "object"}, "schema.$ref"),
    ({"$ref": "#/properties/a", "properties": {"a": {}}}, "schema.$ref"),
    ({"$ref": "other.json#/$defs/a"}, "schema.$ref"),
    ({"$defs": {"a": {}}, "$ref": "#/$defs/b"}, "schema.$ref"),
    ({"$defs": {"a": {"type": "integer"}}, "type": "object", "properties": {  # names p.json's a, a string
        "p": {"$id": "p.json", "$defs": {"a": {"type": "string"}}, "properties": {"q": {"$ref": "#/$defs/a"}}}}},
     "schema.properties.p.$id"),
    ({"$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
      "$ref": "#/$defs/a"}, "schema.$defs.a.properties.a.$ref"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "schema.items.$ref"),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(40)}, "required": [f"p{i}" for i in range(40)]},
     "schema"),
] + [({"type": "string", "pattern": pattern}, "schema.pattern") for pattern in [
    "(?=a)b", "(?<=a)b", "(?i)a", "a\\bc", "(a)\\1", "a^b", "a$b", "x{1,2000}", "x{3,2}", "[a-", "(a", "a)", "*a",
    "a**", "a*+", "[\\D]", "[z-a]", "\\p{L}", "a\\"]]


@pytest.mark.parametrize("schema, path", REFUSED, ids=[f"{i}:{path}" for i, (_, path) in enumerate(REFUSED)])
def test_refused(schema, path):
    with pytest.raises(SchemaError) as raised:
        schema_regex(schema)
    assert str(raised.value).startswith(path + ":"), str(raised.value)


KEYWORDS = ["type", "properties", "required", "additionalProperties", "items", "prefixItems", "additionalItems",
            "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "exclusiveMinimum",
            "maximum", "exclusiveMaximum", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "title"]
ODD_VALUES = [None, True, False, 0, -1, 1.5, 2000, "", "string", "#", "#/$defs/a", "date", "(", "[a-z]+", [], ["a"],
              [{}], [1, "x"], {}, {"a": {}}, {"type": "string"}, [["x"]], [{"type": "integer"}, True]]


def random_odd_schema(rng: random.Random, depth: int):
    """A schema of the keywords above with values of any kind, well formed or not."""
    if rng.random() < 0.2:
        return rng.choice(ODD_VALUES)
    keys = rng.sample(KEYWORDS, rng.randint(0, 4))
    return {key: random_odd_schema(rng, depth - 1) if depth and rng.random() < 0.4 else rng.choice(ODD_VALUES)
            for key in keys}


def test_malformed_schemas_raise_schema_error():
    """Whatever the schema, the answer is a regex re compiles or a SchemaError, never another exception."""
    rng = random.Random(99)
    for _ in range(1500):
        schema = random_odd_schema(rng, 3)
        try:
            re.compile(schema_regex(schema))
        except SchemaError:
            pass
    nested = {}
    for _ in range(3000):
        nested = {"type": "array", "items": nested}
    with pytest.raises(SchemaError, match="nests too deeply"):
        schema_regex(nested)


def test_refusals_say_what_is_supported():
    with pytest.raises(SchemaError, match="for numbers bounds that are whole numbers"):
        schema_regex({"type": "number", "minimum": 0, "maximum": 0.5})
    with pytest.raises(SchemaError, match="supported: date, time, date-time, uuid, email"):
        schema_regex({"type": "string", "format": "ipv4"})
    with pytest.raises(SchemaError, match="at most 64"):
        schema_regex(optional_properties(65))
    with pytest.raises(SchemaError, match="supported: .*additionalItems, .*prefixItems, ") as raised:
        schema_regex({"type": "array", "uniqueItems": True})
    assert "'uniqueItems' is not supported" in str(raised.value)
    assert re.fullmatch(schema_regex(optional_properties(64)), '{"p3":1,"p63":2}')
    assert issubclass(SchemaError, ValueError)
