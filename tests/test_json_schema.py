"""JSON Schema as a regex (structured outputs): for a table of schemas covering each supported keyword,
valid instances match and invalid ones do not, written compactly and with a space after ':' and ','
(with Python's re, and with the token-mask compiler, grammar.py); optional properties and their commas,
exhaustively; tuples' lengths and commas, against jsonschema; random JSON values against any_json_regex, and
random schemas with instances and mutations of them; and the schemas refused, each with its path in the message."""

from __future__ import annotations

import collections
import datetime
import ipaddress
import itertools
import json
import math
import random
import re
import time
import string
import urllib.parse
import uuid
from fractions import Fraction
from typing import Annotated

import jsonschema
import pydantic
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
    ("uri", {"type": "string", "format": "uri"},
     ["http://example.com/a?b=c#d", "https://user:pw@example.com:8080/p/q.html?x=1&y=2#top", "ftp://[::1]/",
      "git+ssh://host.example/repo", "file://host/p", "http://192.168.0.1:80/", "HTTP://EXAMPLE.COM", "f://a",
      "files://u@h:1", "http://a/%7Euser/?q=a%20b"],
     ["//example.com", "/a/b", "example.com", "", "http://a.1", "http://1.2.3.4.5", "file://u@h/", "FILE://h:1",
      "http://a:65536/", "http://xn--abc.com", "http://a--b.com", "http:// a", "http://a/%zz", "1http://a",
      "http://a:08", "http://a/\\b", "http://a/b c"]),  # a.1: an IPv4 address to WHATWG; xn--: one for IDNA
    ("uri-reference", {"type": "string", "format": "uri-reference"},
     ["", "/a/b?c#d", "a/b:c", "//host/p", "?q", "#f", "http://example.com", ".", "../x"],
     ["a b", "%zz", "[x]", "#a#b", "http://exa mple.com", "//a b", "a:b/c:"]),
    ("ipv4", {"type": "string", "format": "ipv4"}, ["192.168.0.1", "0.0.0.0", "255.255.255.255", "10.0.20.9"],
     ["256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5", "1.2.3.4 ", "1.2.3.-4"]),
    ("ipv6", {"type": "string", "format": "ipv6"},
     ["::", "::1", "1:2:3:4:5:6:7:8", "fe80::1:2", "::ffff:192.0.2.1", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8", "1::8",
      "ABCD:ef01::", "1:2:3:4:5:6:1.2.3.4", "0000:0000::0001"],
     ["1:2:3:4:5:6:7:8:9", "1::2::3", ":1:2", "12345::", "1.2.3.4", "::ffff:256.1.1.1", "1:2:3:4:5:6:7",
      "1:2:3:4:5:6:7:1.2.3.4", "g::", "::1%eth0"]),
    ("hostname", {"type": "string", "format": "hostname"},
     ["example.com", "a", "xn--bcher-kva.example", "a-b.c0", "A" * 46 + ".b", "a.b.c.d.e"],
     ["-a.com", "a-.com", "a..b", "", "a" * 64 + ".com", "1.2.3.4", "a_b.com", "example.com.", "a." * 127 + "a"]),
    ("duration", {"type": "string", "format": "duration"},
     ["P3Y6M4DT12H30M5S", "PT0S", "P1W", "P1D", "P1M", "PT36H", "P0D", "P2M1D", "PT1M1S", "P1YT1S"],
     ["P", "PT", "P1H", "P1Y1D", "1D", "P1.5D", "P1W1D", "PT1D", "P1DT", "p1d"]),
    ("pattern with maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}, ["a", "abcde"],
     ["", "abcdef", "ABC"]),
    ("pattern with lengths", {"type": "string", "pattern": "[a-z]+@[a-z]+", "minLength": 5, "maxLength": 9},
     ["ab@cd", "abcd@efgh", "abc@de"], ["a@b", "abcde@fghij", "abcd@e", "ab@c"]),
    ("pattern with minLength", {"type": "string", "pattern": "(?:ab)+c?", "minLength": 5}, ["ababc", "abababc"],
     ["abab", "abc", "ababa"]),
    ("pattern with escapes and lengths", {"type": "string", "pattern": '["\\n]+x', "minLength": 3, "maxLength": 3},
     ['"\nx', '""x', "\n\nx"], ['"x', '"""x', "x"]),  # an escaped character counts as one
    ("pattern alternatives left out", {"type": "string", "pattern": "cat|horse|ox", "maxLength": 3}, ["cat", "ox"],
     ["horse"]),
    ("uri with Pydantic's HttpUrl lengths", {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
     ["http://example.com/a?b=c#d", "https://user:pw@example.com:8080/p/q.html?x=1&y=2#top",
      "https://www.my-site.example.org/path/to/page.html?query=search+term&page=2#section-3",
      "https://api.example.com/v2/users/12345/orders/latest", "http://a.b/" + "x" * 18],
     ["http://example.com/" + "x" * 2100]),
    ("date-time with maxLength", {"type": "string", "format": "date-time", "maxLength": 22},
     ["2024-01-31T12:00:00Z", "2024-01-31T12:00:00.5Z"], ["2024-01-31T12:00:00.12Z", "2024-01-31T12:00:00+01:00"]),
    ("uuid with its length", {"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36},
     ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
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
    ({"type": "string", "pattern": "[a-z]{5}", "maxLength": 3}, "schema.pattern"),  # a fixed length past the range
    ({"type": "string", "pattern": "a{1,3}|bc", "minLength": 4}, "schema.pattern"),  # a bounded one below it
    ({"type": "string", "pattern": "(?:ab)+", "minLength": 3, "maxLength": 3}, "schema.pattern"),  # none between
    ({"type": "string", "pattern": "a+", "minLength": 1001}, "schema.minLength"),
    ({"type": "string", "pattern": "a+", "maxLength": -1}, "schema.maxLength"),
    ({"type": "string", "pattern": "a+", "maxLength": True}, "schema.maxLength"),
    ({"type": "string", "pattern": "a+", "minLength": 3, "maxLength": 2}, "schema.maxLength"),
    ({"type": "string", "format": "uuid", "maxLength": 35}, "schema.format"),
    ({"type": "string", "format": "ipv4", "minLength": 16}, "schema.format"),
    ({"type": "string", "format": "hostname", "minLength": 254}, "schema.format"),  # at most 253 characters
    ({"type": "string", "format": "email", "maxLength": 5}, "schema.format"),
    ({"type": "string", "format": "uri", "pattern": "x"}, "schema.format"),
    ({"type": "string", "format": "date", "pattern": "x"}, "schema.format"),
    ({"type": "array", "items": {"type": "string", "format": "idn-hostname"}}, "schema.items.format"),
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
    with pytest.raises(SchemaError, match="supported: date, time, date-time, uuid, email, uri, uri-reference, ipv4, "
                                          "ipv6, hostname, duration$"):
        schema_regex({"type": "string", "format": "idn-email"})
    with pytest.raises(SchemaError, match=r"^schema.pattern: no match of '\[a-z\]\{5\}' has a length from 0 to 3 "):
        schema_regex({"type": "string", "pattern": "[a-z]{5}", "maxLength": 3})
    with pytest.raises(SchemaError, match="^schema.format: no 'uuid' string has a length of 37 or more "):
        schema_regex({"type": "string", "format": "uuid", "minLength": 37})
    with pytest.raises(SchemaError, match="^schema.format: no 'hostname' string .its own length is from 1 to 253. "
                                          "has a length from 254 to 300 "):
        schema_regex({"type": "string", "format": "hostname", "minLength": 254, "maxLength": 300})
    with pytest.raises(SchemaError, match="at most 64"):
        schema_regex(optional_properties(65))
    with pytest.raises(SchemaError, match="supported: .*additionalItems, .*prefixItems, ") as raised:
        schema_regex({"type": "array", "uniqueItems": True})
    assert "'uniqueItems' is not supported" in str(raised.value)
    assert re.fullmatch(schema_regex(optional_properties(64)), '{"p3":1,"p63":2}')
    assert issubclass(SchemaError, ValueError)


# --- strings of a pattern or a format, fitted into minLength and maxLength ---------------------------------

SAMPLE_POOL = [chr(c) for c in range(0x80)] + list("éß日本😀\u2028\u3000\x85\ud7ff\ue000\U0010ffff\u0663")
SAMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
SAMPLE_QUANTIFIER = re.compile(r"[*+?]|\{(\d*)(,?)(\d*)\}")


class RegexSampler:
    """Random full matches of a regex of the subset schema_regex writes (characters, escapes, classes, groups,
    | and quantifiers): a class's characters come from SAMPLE_POOL; a count is often the least or the most."""

    def __init__(self, regex: str):
        self.text, self.i, self.members = regex, 0, {}
        self.tree = self._alternation()
        assert self.i == len(regex), (regex, self.i)

    def _alternation(self):
        branches = [self._sequence()]
        while self.text.startswith("|", self.i):
            self.i += 1
            branches.append(self._sequence())
        return "alt", branches

    def _sequence(self):
        items = []
        while self.i < len(self.text) and self.text[self.i] not in "|)":
            atom = self._atom()
            while (found := SAMPLE_QUANTIFIER.match(self.text, self.i)) and (found[1] or found[3] or found[0] in "*+?"):
                self.i = found.end()
                if found[0] in "*+?":
                    low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[found[0]]
                else:
                    low = int(found[1] or 0)
                    high = (int(found[3]) if found[3] else None) if found[2] else low
                atom = ("rep", atom, low, high)
            items.append(atom)
        return "seq", items

    def _atom(self):
        text, i = self.text, self.i
        if text[i] == "(":
            self.i = i + (3 if text.startswith("(?:", i) else 1)
            inner = self._alternation()
            assert text[self.i] == ")", (text, self.i)
            self.i += 1
            return inner
        if text[i] == "[":
            end = i + 1 + text.startswith("^", i + 1)
            end += text.startswith("]", end)
            while text[end] != "]":
                end += 2 if text[end] == "\\" else 1
            self.i = end + 1
            return "class", text[i:end + 1]
        if text[i] == "\\":
            escaped = text[i + 1]
            if escaped in "xu":
                width = 2 if escaped == "x" else 4
                self.i = i + 2 + width
                return "char", chr(int(text[i + 2:i + 2 + width], 16))
            self.i = i + 2
            return ("class", text[i:i + 2]) if escaped in "dwsDWS" else ("char", SAMPLE_ESCAPES.get(escaped, escaped))
        self.i = i + 1
        return ("class", ".") if text[i] == "." else ("char", text[i])

    def sample(self, rng: random.Random) -> str:
        out = []
        self._walk(self.tree, rng, out)
        return "".join(out)

    def _walk(self, node, rng: random.Random, out: list):
        if node[0] == "char":
            out.append(node[1])
        elif node[0] == "class":
            if node[1] not in self.members:
                self.members[node[1]] = [c for c in SAMPLE_POOL if re.fullmatch(node[1], c)]
            out.append(rng.choice(self.members[node[1]]))
        elif node[0] == "seq":
            for item in node[1]:
                self._walk(item, rng, out)
        elif node[0] == "alt":
            self._walk(rng.choice(node[1]), rng, out)
        else:
            _, child, low, high = node
            high = low + rng.choice([0, 1, 2, 4]) if high is None else high
            for _ in range(rng.choice([low, high, rng.randint(low, high), rng.randint(low, min(high, low + 3))])):
                self._walk(child, rng, out)


def sampled_values(regex: str, rng: random.Random, count: int) -> list:
    """count random strings the regex (of a JSON string) matches, read back from their JSON."""
    sampler, compiled = RegexSampler(regex), re.compile(regex)
    out = []
    for _ in range(count):
        text = sampler.sample(rng)
        assert compiled.fullmatch(text), (regex, text)
        out.append(json.loads(text))
    return out


def random_pattern(rng: random.Random, depth: int, top: bool = True) -> str:
    """A pattern over a and b: characters, [ab], ., groups of alternatives nesting depth deep, quantifiers. Inside a
    group only quantifiers that keep an item from matching empty, and on a group only bounded ones (Python's re
    backtracks for ever on some (...)+)."""
    items = []
    for _ in range(rng.randint(1, 3 if top else 2)):
        if depth and rng.random() < 0.35:
            branches = [random_pattern(rng, depth - 1, False) for _ in range(rng.randint(1, 3))]
            atom = rng.choice(["(", "(?:"]) + "|".join(branches) + ")"
        else:
            atom = rng.choice(["a", "b", "a", "b", "[ab]", "."])
        unbounded = ["*", "+", "{2,}"] if atom[0] != "(" else []
        items.append(atom + rng.choice(["", "", "{2}", "{1,3}"] + (["?", "{0,2}", "{3}"] + unbounded) * top))
    return "".join(items)


BRUTE_FORCE_LENGTH = 9  # the longest string over a, b tried for a match in range


@pytest.mark.timeout(120)
def test_pattern_lengths_random():
    """For random patterns and random length ranges: every sampled match of the fitted regex matches the pattern
    (Python's re), has a length in range and is valid to jsonschema; a fit is found whenever a string over a, b of
    a length in range matches, and refused (naming the pattern and the range) only where none does, which is
    checked for every length where the range ends at BRUTE_FORCE_LENGTH or below."""
    rng = random.Random(2083)
    counts = collections.Counter()
    for case in range(600):
        pattern = random_pattern(rng, 2)
        low = rng.randint(0, 8)
        high = rng.choice([None, low + rng.randint(0, 6)])
        schema = {"type": "string", "pattern": pattern, "minLength": low}
        schema.update({} if high is None else {"maxLength": high})
        compiled = re.compile(pattern)
        longest = BRUTE_FORCE_LENGTH if high is None else min(high, BRUTE_FORCE_LENGTH)
        found = any(compiled.fullmatch("".join(s)) for n in range(low, longest + 1)
                    for s in itertools.product("ab", repeat=n))
        try:
            regex = schema_regex(schema)
        except SchemaError as exc:
            assert not found, (schema, str(exc))
            assert str(exc).startswith(f"schema.pattern: no match of {pattern!r} has a length "), str(exc)
            counts["refused, checked" if high is not None and high <= BRUTE_FORCE_LENGTH else "refused"] += 1
            continue
        counts["fitted" if found else "fitted, no match over a, b found"] += 1
        validator = jsonschema.Draft202012Validator(schema)
        values = sampled_values(regex, rng, 30)
        for value in values:
            assert compiled.fullmatch(value), (schema, regex, value)
            assert low <= len(value) and (high is None or len(value) <= high), (schema, regex, value)
            assert validator.is_valid(value), (schema, regex, value)
        if case % 10 == 0:
            grammar = Grammar.from_regex(regex)
            for value in values[:5]:
                assert through_grammar(grammar, json.dumps(value, ensure_ascii=False)), (schema, regex, value)
    assert counts["fitted"] > 350 and counts["refused, checked"] > 50, counts


def test_pattern_lengths_fit_every_match():
    """Repetitions narrowed (``+`` capped, lower counts raised), alternatives that cannot fit left out, copies of
    different lengths where one length does not fit; every match in range, exhaustively for short ones."""
    cases = [  # (pattern, minLength, maxLength, some of the values expected)
        ("[a-z]+", 0, 3, ["a", "abc"]),
        ("^[a-z]+$", 0, 20, ["a" * 20]),
        ("(?:ab)+", 5, 7, ["ababab"]),
        ("cat|horse|ox", 3, 4, ["cat"]),
        ("(?:a|bc){2}", 3, 3, ["abc", "bca"]),  # one of them at least
        ("(?:a|bcd){2}", 4, 4, ["abcd", "bcda"]),
        ("(a?){3}", 1, 1, ["a"]),
        ("(?:xy|z)*w", 4, 6, ["xyxyw", "zzzw"]),
        ("[ab]{0,1000}", 990, 995, ["a" * 990]),
        ("(?:a{1000}){5,}", 1, 7000, ["a" * 5000, "a" * 7000]),  # lengths far past minLength
    ]
    for pattern, low, high, some in cases:
        regex = re.compile(schema_regex({"type": "string", "pattern": pattern, "minLength": low, "maxLength": high}))
        offered = [v for v in some if regex.fullmatch(json.dumps(v))]
        assert offered, (pattern, regex.pattern)
        if high > 10:
            continue
        for n in range(high + 2):  # strings of the pattern's letters and one other
            for chars in itertools.product(set(re.findall("[a-z]", pattern)) | {"q"}, repeat=n):
                value = "".join(chars)
                if regex.fullmatch(json.dumps(value)):
                    assert re.fullmatch(pattern, value) and low <= len(value) <= high, (pattern, regex.pattern, value)


def test_pattern_and_format_lengths_keep_regexes_small_and_counts_bounded():
    """maxLength past MAX_COUNT (Pydantic's HttpUrl: 2083) is taken beside a pattern or a format, and the counts of
    the regex stay within 1000; a plain string's maxLength is still bounded by it."""
    for schema in [{"type": "string", "pattern": "[a-z]+", "maxLength": 5000},
                   {"type": "string", "pattern": "(?:[a-z]+,)*[a-z]+", "minLength": 900, "maxLength": 10 ** 9},
                   {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
                   {"type": "string", "format": "email", "maxLength": 320}]:
        regex = schema_regex(schema)
        assert len(regex) < 10_000, (schema, len(regex))
        counts = [int(n) for n in re.findall(r"\{(\d+)(?:,(\d*))?\}", regex) for n in n if n]
        assert max(counts) <= 1000, (schema, max(counts))
        Grammar.from_regex(regex)
    regex = schema_regex({"type": "string", "pattern": "[a-z]+", "maxLength": 5000})
    assert re.fullmatch(regex, '"' + "a" * 1000 + '"') and not re.fullmatch(regex, '"' + "a" * 1001 + '"')
    with pytest.raises(SchemaError, match="^schema.maxLength: must be a whole number from 0 to 1000"):
        schema_regex({"type": "string", "maxLength": 1001})


def test_a_pattern_too_costly_to_fit_is_refused_at_once():
    """A crafted pattern (many repetitions whose lengths come in steps) would take seconds to fit into a length
    range (~12 s for 2,000 of them); its fit stops at MAX_FIT_RUNS, where the same pattern without lengths and a
    fit of a few of them still work."""
    started = time.monotonic()
    with pytest.raises(SchemaError, match=r"^schema.pattern: fitting it into minLength and maxLength takes too long"):
        schema_regex({"type": "string", "pattern": "(?:aa)*" * 2000, "maxLength": 4000})
    assert time.monotonic() - started < 10  # the cap, not the whole fit (which takes ~100 times the cap's work)
    schema_regex({"type": "string", "pattern": "(?:aa)*" * 2000})
    regex = schema_regex({"type": "string", "pattern": "(?:aa)*" * 5, "maxLength": 11})
    assert re.fullmatch(regex, '"' + "a" * 10 + '"') and not re.fullmatch(regex, '"' + "a" * 12 + '"')


def test_spare_length_spread_over_the_parts():
    """The room below maxLength goes to every part that can grow, not to the first: an email's name and its
    domain both grow; where a part's lengths come in steps, what it could not use goes to another part."""
    regex = schema_regex({"type": "string", "format": "email", "maxLength": 40})
    values = sampled_values(regex, random.Random(5), 400)
    names, domains = zip(*(value.split("@") for value in values))
    assert max(map(len, names)) >= 12 and max(map(len, domains)) >= 16, (regex, max(map(len, names)))
    assert max(map(len, values)) <= 40
    regex = re.compile(schema_regex({"type": "string", "format": "date-time", "maxLength": 22}))
    assert regex.fullmatch('"2024-01-31T12:00:00.5Z"')  # the offset's room, too small for +01:00, to the fraction
    regex = re.compile(schema_regex({"type": "string", "pattern": "[a-z]+@[a-z]+\\.[a-z]+", "maxLength": 30}))
    for value in ["a" * 8 + "@b.c", "a@" + "b" * 8 + ".c", "a@b." + "c" * 8]:
        assert regex.fullmatch(json.dumps(value)), (regex.pattern, value)


def rfc3986(value: str, absolute: bool) -> bool:
    """Whether value is a URI (absolute) or a URI reference by RFC 3986's grammar: split as its appendix B
    does, each part checked for its characters, an IP literal with ipaddress."""
    parts = re.fullmatch(r"(?:([^:/?#]+):)?(?://([^/?#]*))?([^?#]*)(?:\?([^#]*))?(?:#(.*))?", value)
    scheme, authority, path, query, fragment = parts.groups()

    def made_of(text, more: str) -> bool:
        return text is None or bool(re.fullmatch(rf"(?:[A-Za-z0-9\-._~!$&'()*+,;={more}]|%[0-9A-Fa-f]{{2}})*", text))

    if scheme is None and absolute or scheme is not None and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme):
        return False
    if authority is not None:
        user, at, host = authority.rpartition("@")
        if at and not made_of(user, ":"):
            return False
        if host.startswith("["):
            literal, _, port = host[1:].partition("]")
            try:
                ipaddress.IPv6Address(literal)
            except ValueError:
                return False
            if port and not re.fullmatch(r":[0-9]*", port):
                return False
        else:
            name, _, port = host.partition(":")
            if not made_of(name, "") or not re.fullmatch(r"[0-9]*", port):
                return False
        if path and not path.startswith("/"):
            return False
    elif scheme is None and ":" in path.split("/")[0]:  # a relative path's first segment holds no ":"
        return False
    return made_of(path, ":@/") and made_of(query, ":@/?") and made_of(fragment, ":@/?")


@pytest.mark.timeout(60)
def test_format_uri_samples_parse():
    """Every sampled uri is an RFC 3986 URI, has a scheme to urlsplit and validates as Pydantic's AnyUrl (the
    WHATWG parser); every uri-reference is an RFC 3986 reference. HttpUrl's schema (uri, lengths 1 to 2083)
    compiles, its samples are AnyUrls of at most 2083 characters, and HttpUrls where the scheme is http(s)."""
    any_url, http_url = pydantic.TypeAdapter(pydantic.AnyUrl), pydantic.TypeAdapter(pydantic.HttpUrl)
    http_schema = http_url.json_schema()
    assert http_schema == {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}, http_schema
    rng = random.Random(3986)
    for schema in [{"type": "string", "format": "uri"}, http_schema,
                   {"type": "string", "format": "uri", "minLength": 30, "maxLength": 60}]:
        regex = schema_regex(schema)
        grammar = Grammar.from_regex(regex)
        for i, value in enumerate(sampled_values(regex, rng, 500)):
            assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", math.inf), value
            assert rfc3986(value, absolute=True), value
            assert urllib.parse.urlsplit(value).scheme, value
            any_url.validate_python(value)
            if value.lower().startswith(("http://", "https://")):
                http_url.validate_python(value)
            if i < 20:
                assert through_grammar(grammar, json.dumps(value)), value
    for value in ["http://example.com/a?b=c#d", "https://www.example.org:8443/a/b.html?q=1#top"]:
        assert re.fullmatch(schema_regex(http_schema), json.dumps(value))
        http_url.validate_python(value)
    regex = schema_regex({"type": "string", "format": "uri-reference"})
    kinds = collections.Counter()
    for value in sampled_values(regex, rng, 1500):
        assert rfc3986(value, absolute=False), value
        parts = urllib.parse.urlsplit(value)
        kinds["absolute" if parts.scheme else "network" if parts.netloc else "path" if parts.path else "none"] += 1
        if parts.scheme:
            any_url.validate_python(value)
    assert min(kinds.values()) >= 50, kinds
    for value in ["http://exa mple.com", "a:b:c", "//a b", "%zz"]:
        assert not rfc3986(value, absolute=False) or ":" in value, value  # the reference check refuses what it should


def test_format_ip_addresses():
    """Sampled ipv4 and ipv6 addresses parse with ipaddress; every text form of RFC 4291 is offered: Python's
    compressed and exploded forms of random addresses, and IPv4-suffixed ones, all match."""
    rng = random.Random(4291)
    ipv4, ipv6 = schema_regex({"type": "string", "format": "ipv4"}), schema_regex({"type": "string", "format": "ipv6"})
    for value in sampled_values(ipv4, rng, 500):
        assert str(ipaddress.IPv4Address(value)) == value
    forms = collections.Counter()
    for value in sampled_values(ipv6, rng, 3000):
        ipaddress.IPv6Address(value)
        forms["::" if "::" in value else "eight groups"] += 1
        forms["IPv4 suffix"] += "." in value
    assert min(forms.values()) > 100, forms
    compiled = re.compile(ipv6)
    for _ in range(500):
        address = ipaddress.IPv6Address(rng.choice([rng.getrandbits(128), rng.getrandbits(16) << rng.randrange(113),
                                                    0xFFFF << 32 | rng.getrandbits(32), rng.getrandbits(64)]))
        v4 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        groups = address.exploded.split(":")
        for text in [str(address), address.exploded, address.compressed.upper(), ":".join(groups[:6]) + f":{v4}"]:
            assert compiled.fullmatch(json.dumps(text)), text


def rfc1123(name: str) -> bool:
    """A host name by RFC 1123: at most 253 characters, labels of 1 to 63 letters, digits and hyphens, neither
    starting nor ending with a hyphen."""
    allowed = set(string.ascii_letters + string.digits + "-")
    return len(name) <= 253 and all(0 < len(label) <= 63 and set(label) <= allowed and label[0] != "-" != label[-1]
                                    for label in name.split("."))


def test_format_hostname():
    rng = random.Random(1123)
    for schema in [{"type": "string", "format": "hostname"}, {"type": "string", "format": "hostname", "maxLength": 40},
                   {"type": "string", "format": "hostname", "minLength": 100}]:
        values = sampled_values(schema_regex(schema), rng, 500)
        for value in values:
            assert rfc1123(value) and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 253), value
        if "maxLength" not in schema:
            assert max(len(value.split(".")) for value in values) >= 4
    assert rfc1123("a-b.c") and not rfc1123("a-.c") and not rfc1123("a" * 64) and not rfc1123("a." * 127 + "a")


# the ISO 8601 duration of JSON Schema (draft 2019-09, appendix A), rule by rule
DUR_SECOND = "[0-9]+S"
DUR_MINUTE = f"[0-9]+M(?:{DUR_SECOND})?"
DUR_HOUR = f"[0-9]+H(?:{DUR_MINUTE})?"
DUR_TIME = f"T(?:{DUR_HOUR}|{DUR_MINUTE}|{DUR_SECOND})"
DUR_DAY, DUR_WEEK = "[0-9]+D", "[0-9]+W"
DUR_MONTH = f"[0-9]+M(?:{DUR_DAY})?"
DUR_YEAR = f"[0-9]+Y(?:{DUR_MONTH})?"
DUR_DATE = f"(?:{DUR_DAY}|{DUR_MONTH}|{DUR_YEAR})(?:{DUR_TIME})?"
DURATION = re.compile(f"P(?:{DUR_DATE}|{DUR_TIME}|{DUR_WEEK})")


def test_format_duration():
    """The regex and the ABNF agree on every string of up to five parts (each a 1 and a designator, or T) after P,
    on hand examples, and on samples."""
    regex = re.compile(schema_regex({"type": "string", "format": "duration"}))
    for good in ["P3Y6M4DT12H30M5S", "PT0S", "P1W"]:
        assert DURATION.fullmatch(good) and regex.fullmatch(json.dumps(good)), good
    for bad in ["P", "PT", "P1H"]:
        assert not DURATION.fullmatch(bad) and not regex.fullmatch(json.dumps(bad)), bad
    tokens, counts = ["1Y", "1M", "1W", "1D", "T", "1H", "1S", "12"], collections.Counter()
    for n in range(6):
        for parts in itertools.product(tokens, repeat=n):
            value = "P" + "".join(parts)
            expected = bool(DURATION.fullmatch(value))
            assert bool(regex.fullmatch(json.dumps(value))) == expected, value
            counts[expected] += 1
    assert counts[True] > 50, counts
    for value in sampled_values(regex.pattern, random.Random(8601), 500):
        assert DURATION.fullmatch(value), value


FORMAT_CHECKS = {  # a check of each format's values, independent of the regexes
    "date": datetime.date.fromisoformat, "time": lambda v: datetime.time.fromisoformat(v.replace("Z", "+00:00")),
    "date-time": lambda v: datetime.datetime.fromisoformat(v.replace("Z", "+00:00")), "uuid": uuid.UUID,
    "email": lambda v: re.fullmatch(r"[^@\s]+@[^@\s]+\.[A-Za-z]{2,}", v) or 1 / 0,
    "uri": lambda v: rfc3986(v, True) and pydantic.TypeAdapter(pydantic.AnyUrl).validate_python(v) or 1 / 0,
    "uri-reference": lambda v: rfc3986(v, False) or 1 / 0, "ipv4": ipaddress.IPv4Address,
    "ipv6": ipaddress.IPv6Address, "hostname": lambda v: rfc1123(v) or 1 / 0, "duration": DURATION.fullmatch,
}


@pytest.mark.timeout(120)
def test_formats_fitted_into_random_lengths():
    """Each format with random length ranges: samples are in range, match the format's regex unfitted and pass the
    format's check; a range is refused only where no sample of the unfitted format has a length in it."""
    rng = random.Random(2019)
    counts = collections.Counter()
    for name, check in FORMAT_CHECKS.items():
        whole = schema_regex({"type": "string", "format": name})
        lengths = sorted(len(v) for v in sampled_values(whole, rng, 300))
        for _ in range(12):
            low = rng.choice([0, rng.randint(0, 40), rng.choice(lengths)])
            high = rng.choice([None, low + rng.randint(0, 30), rng.choice(lengths)])
            if high is not None and high < low:
                low, high = high, low
            schema = {"type": "string", "format": name, "minLength": low}
            schema.update({} if high is None else {"maxLength": high})
            try:
                regex = schema_regex(schema)
            except SchemaError as exc:
                assert str(exc).startswith(f"schema.format: no {name!r} string"), str(exc)
                assert not any(low <= n <= (high if high is not None else n) for n in lengths), (schema, lengths)
                counts["refused"] += 1
                continue
            counts["fitted"] += 1
            for value in sampled_values(regex, rng, 40):
                assert low <= len(value) and (high is None or len(value) <= high), (schema, value)
                if name != "hostname":  # its regex is fitted too, into its own 253 characters
                    assert re.fullmatch(whole, json.dumps(value)), (schema, value)
                if name not in ("date", "date-time") or not value.startswith("0000"):  # Python's years start at 1
                    assert check(value), (schema, value)
    assert counts["fitted"] > 100 and counts["refused"] > 5, counts


class Site(pydantic.BaseModel):
    """A Pydantic model of the kinds of string fields its users write."""
    url: pydantic.HttpUrl
    contact: Annotated[str, pydantic.Field(json_schema_extra={"format": "email"})]
    slug: str = pydantic.Field(pattern=r"^[a-z][a-z0-9-]*$", min_length=3, max_length=20)
    code: Annotated[str, pydantic.StringConstraints(pattern=r"^[A-Z]{2}-\d+$", max_length=8)]
    updated: datetime.datetime
    id: uuid.UUID
    address: ipaddress.IPv4Address
    v6: ipaddress.IPv6Address | None = None
    ttl: datetime.timedelta
    mirror: pydantic.AnyUrl | None = None


class SiteOfAnyUrl(Site):
    url: pydantic.AnyUrl  # uri's meaning: any scheme (HttpUrl's schema says no more)


@pytest.mark.timeout(60)
def test_pydantic_models():
    """Pydantic models' schemas (HttpUrl with its lengths, pattern with lengths, date-time, uuid, ipv4, ipv6,
    duration) compile, through the token grammar too; samples are valid to jsonschema and to Pydantic."""
    schema = Site.model_json_schema()
    regex = schema_regex(schema)
    grammar = Grammar.from_regex(regex)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    sampler, rng = RegexSampler(regex), random.Random(2)
    for i in range(300):
        text = sampler.sample(rng)
        value = json.loads(text)
        assert validator.is_valid(value), (text, [e.message for e in validator.iter_errors(value)])
        if not value["updated"].startswith("0000"):  # Python's years start at 1
            SiteOfAnyUrl.model_validate_json(text)
        if i < 10:
            assert through_grammar(grammar, text), text
    example = Site(url="https://example.com/a?b=c#d", contact="a@b.co", slug="my-site", code="AB-12",
                   updated=datetime.datetime(2024, 1, 31, 12, tzinfo=datetime.timezone.utc), id=uuid.uuid4(),
                   address="10.0.0.1", v6="::1", ttl=datetime.timedelta(days=1, hours=2), mirror="ftp://mirror.org/x")
    text = example.model_dump_json()
    assert re.fullmatch(regex, text) and through_grammar(grammar, text), text
