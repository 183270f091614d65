"""JSON Schema as a regular expression, for structured outputs (constrained decoding).

``schema_regex`` turns a JSON Schema (``response_format``'s ``json_schema.schema``, a tool's
``parameters``) into a regex whose full matches are JSON texts valid under the schema;
``any_json_regex`` is the regex of ``{"type": "json_object"}``. The regexes keep to the subset
``grammar.py`` compiles into token masks: literals, escapes, classes, groups, ``|`` and quantifiers
counting to at most 1000; no anchors, lookarounds or back-references.

The JSON is compact, with one optional space after each ``:`` and ``,`` (``{"a": 1, "b": [1, 2]}``
and ``{"a":1,"b":[1,2]}`` both match). Every match is valid, but where a schema allows more than a
regex offers at a sane size, the regex offers a part of it (see ``schema_regex``). What it cannot
express it refuses with a ``SchemaError`` naming the schema path.

Strings of a ``pattern`` or a ``format`` (both parsed into a tree of the value's characters) may have
``minLength`` and ``maxLength`` too: the tree is fitted into the length range (``_Fit``), and refused only
where no match of it has a length in range.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import math
import re

from twinplane.controlplane.grammar import regex_literal

MAX_REGEX = 200_000  # characters; a schema needing a larger regex is refused
MAX_COUNT = 1000  # the largest count of a {n,m} quantifier
MAX_OPTIONAL = 64  # optional properties per object
MAX_LENGTH_SEARCH = 4096  # how far past its least length in range a pattern fitted into one may go
# the work one pattern's fit may take: runs of lengths shifted (~0.1 s; a URI's fit takes ~3,000, a crafted
# pattern of many repetitions with lengths in steps millions, seconds of a tokenizer thread)
MAX_FIT_RUNS = 200_000
MAX_SCHEMAS = 50_000  # subschemas a schema's regex may visit ($refs expanded again and again count each time)

_SEP, _COLON = ",[ ]?", ":[ ]?"
_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))'  # one character of a JSON string
_STRING = f'"{_CHAR}*"'
# one character of a JSON string, for counting: no surrogate \u escape (a character past U+FFFF comes as itself)
_CODE_POINT = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})))'
_SURROGATE = re.compile("[\ud800-\udfff]")
_DIGITS = "(?:0|[1-9][0-9]*)"
_FRACTION, _EXPONENT = r"(?:\.[0-9]+)?", r"(?:[eE][+\-]?[0-9]+)?"
_INTEGER = "-?" + _DIGITS
_NUMBER = _INTEGER + _FRACTION + _EXPONENT
_SCALAR = f"(?:{_STRING}|{_NUMBER}|true|false|null)"
_BOUNDS_SUPPORTED = ("supported: for integers any minimum, maximum, exclusiveMinimum and exclusiveMaximum "
                     "(fractional ones rounded inwards); for numbers bounds that are whole numbers (0, -5, 100.0); "
                     "exclusive bounds as numbers or, next to minimum and maximum, as true (draft 4); magnitudes "
                     f"below 1e{MAX_COUNT}")

# The formats, as patterns of the string's value (their characters need no JSON escapes); each is offered
# whole, or fitted into minLength and maxLength as a pattern is.
_DATE = ("(?:[0-9]{4}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
         "|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)")  # leap days too
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_IPV4 = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])(?:\.(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3}"
_H16 = "[0-9A-Fa-f]{1,4}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"
# RFC 4291's text forms as RFC 3986 writes them: eight groups, or "::" standing for one or more zero groups
# with i groups at most before it and the rest after it (the last two groups maybe an IPv4 address)
_IPV6 = "(?:" + "|".join([f"(?:{_H16}:){{6}}{_LS32}"] + [
    ("" if i == 0 else f"(?:{_H16})?" if i == 1 else f"(?:(?:{_H16}:){{0,{i - 1}}}{_H16})?") + "::" +
    (f"(?:{_H16}:){{{5 - i}}}{_LS32}" if i <= 5 else _H16 if i == 6 else "") for i in range(8)]) + ")"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
# RFC 1123 labels, the last one starting with a letter (so that no hostname reads as an IPv4 address)
_HOSTNAME = rf"(?:{_LABEL}\.)*[A-Za-z](?:[A-Za-z0-9\-]{{0,61}}[A-Za-z0-9])?"
# URIs (RFC 3986) with an authority, as URL parsers (WHATWG's, Python's) also take them: a registered name's
# labels hold no "--" (no "xn--" label, which IDNA would have to decode) and its last starts with a letter (no
# IPv4 address to read, as "a.1" would be); ports up to 65535; a file URI has no user or port. The parts that
# are short in practice are bounded (a scheme of at most 32 characters, a user of 64, a host of 9 labels), so
# that under maxLength the room goes to the path, the query and the fragment.
_PCT = "%[0-9A-Fa-f]{2}"
_PCHAR = rf"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|{_PCT})"
_QUERY = rf"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|{_PCT})*"  # a query's characters, and a fragment's
_SCHEME_CHAR = r"[A-Za-z0-9+.\-]"
# any scheme but file (which WHATWG parsers take with a host only): one not starting with f, or f and then not "ile"
_NOT_FILE = (rf"(?:[A-EG-Za-eg-z]{_SCHEME_CHAR}{{0,31}}|[Ff](?:[A-HJ-Za-hj-z0-9+.\-]{_SCHEME_CHAR}{{0,30}}|[Ii](?:"
             rf"[A-KM-Za-km-z0-9+.\-]{_SCHEME_CHAR}{{0,29}}|[Ll](?:[A-DF-Za-df-z0-9+.\-]{_SCHEME_CHAR}{{0,28}}|[Ee]"
             rf"{_SCHEME_CHAR}{{1,28}})?)?)?)")
_HOST = rf"(?:\[{_IPV6}\]|{_IPV4}|(?:[A-Za-z0-9](?:-?[A-Za-z0-9]){{0,62}}\.){{0,8}}[A-Za-z](?:-?[A-Za-z0-9]){{0,62}})"
_PORT = "(?:[0-9]|[1-9][0-9]{1,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_AUTHORITY = rf"(?:(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|{_PCT}){{0,64}}@)?{_HOST}(?::{_PORT})?"  # a user maybe, a host
_PATH = rf"(?:/{_PCHAR}*)*"
_AFTER_PATH = rf"(?:\?{_QUERY})?(?:#{_QUERY})?"
_URI = rf"(?:{_NOT_FILE}://{_AUTHORITY}|[Ff][Ii][Ll][Ee]://{_HOST}){_PATH}{_AFTER_PATH}"
# a network path, an absolute path, a relative one (no ":" before its first "/") or none, then a query, a fragment
_RELATIVE_REF = (rf"(?://{_AUTHORITY}{_PATH}|/(?:{_PCHAR}+{_PATH})?|(?:[A-Za-z0-9\-._~!$&'()*+,;=@]|{_PCT})+"
                 rf"{_PATH})?{_AFTER_PATH}")
_NUMERAL = "[0-9]+"
_DURATION_TIME = f"T(?:{_NUMERAL}H(?:{_NUMERAL}M(?:{_NUMERAL}S)?)?|{_NUMERAL}M(?:{_NUMERAL}S)?|{_NUMERAL}S)"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}",
    "email": r"[A-Za-z0-9_%+\-]+(?:\.[A-Za-z0-9_%+\-]+)*@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}",
    "uri": _URI,
    "uri-reference": f"(?:{_URI}|{_RELATIVE_REF})",
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "hostname": _HOSTNAME,
    # JSON Schema's (draft 2019-09, appendix A): "P", then a date part (days; months, maybe days; years, maybe
    # months and days) maybe followed by a time part, or only a time part, or weeks
    "duration": (f"P(?:(?:{_NUMERAL}D|{_NUMERAL}M(?:{_NUMERAL}D)?|{_NUMERAL}Y(?:{_NUMERAL}M"
                 f"(?:{_NUMERAL}D)?)?)(?:{_DURATION_TIME})?|{_DURATION_TIME}|{_NUMERAL}W)"),
}
_FORMAT_LENGTHS = {"hostname": (1, 253)}  # the lengths a format allows of itself (RFC 1123: 253 characters)

_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions", "discriminator"}
_TYPE_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "integer": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "boolean": (),
    "null": (),
}
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")
_KEYWORDS = {"type", "enum", "const", *_COMBINATORS, *(k for keys in _TYPE_KEYWORDS.values() for k in keys)}

_PUNCTUATION = '.\\*+?()[]{}|^$/"-'
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_HEX = re.compile(r"x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})")
_QUANTIFIER = re.compile(r"[*+?]|\{(?=\d|,\d)(\d*)(,?)(\d*)\}")
_GROUP = re.compile(r"\((?:\?:|\?P?<[A-Za-z_][A-Za-z0-9_]*>)?")
_SHORTHANDS = {"d": (False, r"\d"), "w": (False, r"\w"), "s": (False, r"\s"),
               "D": (True, r"\d"), "W": (True, r"\w"), "S": (True, r"\s")}  # letter -> (negated, class item)
_JSON_ESCAPED = '"\\' + "".join(map(chr, range(0x20)))  # the characters a JSON string holds only escaped
_JSON_PLAIN = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF))  # the code points it holds as they are


class SchemaError(ValueError):
    """A schema this module cannot express as a regex; the message names the schema path."""


class _TooVaried(Exception):
    """A pattern whose fit into minLength and maxLength would take more than MAX_FIT_RUNS."""


class _Cut(SchemaError):
    """A recursive $ref past max_depth: the branch holding it is left out wherever the schema has another."""


def schema_regex(schema: dict, max_depth: int = 4) -> str:
    """The regex of the JSON texts valid under schema (parsed JSON; True and False are schemas too).

    Where the schema allows more than is offered, a part of it is (every match is still valid):

    - objects hold the properties listed in ``properties``, in that order, the ones not ``required``
      possibly left out; those are the properties generated (``additionalProperties`` next to
      ``properties`` adds none). Without ``properties``, an ``additionalProperties`` schema gives any
      keys with values of it, and otherwise any object;
    - without ``type``, the types the keywords constrain (``properties`` makes an object, ``minLength``
      a string); with none of them, any value;
    - ``oneOf`` is ``anyOf``: its branches are not checked to exclude one another;
    - a ``pattern`` is matched whole (as if anchored); it describes the string's value, so the
      characters JSON escapes (quote, backslash, control characters) come escaped in the text; of ``\\d \\w
      \\s`` the ASCII characters, and ``\\D \\W \\S`` and classes negating them only ASCII ones;
    - a ``pattern`` or a ``format`` beside ``minLength`` or ``maxLength`` is fitted into the range: its
      repetitions' counts narrowed (``[a-z]+`` with maxLength 20: ``[a-z]{1,20}``) and its alternatives that
      cannot fit left out, so that every match has a length in range; the room for length is shared among the
      parts that can grow (an email's domain grows as its name does), each part then offering its share of it
      (see ``_Fit``); lengths past minLength (or the pattern's least) + MAX_LENGTH_SEARCH are not offered;
    - formats (``date, time, date-time, uuid, email, uri, uri-reference, ipv4, ipv6, hostname, duration``)
      as these parts of them: emails of ASCII letters, digits and ``_%+-``, a domain ending in letters; URIs
      with an authority (``scheme://host``), no IPvFuture, and of the hosts, registered names of labels
      without ``--`` (``xn--``) whose last one starts with a letter, as URL parsers take them (the WHATWG URL
      standard reads ``http://a.1`` as an invalid IPv4 address), and no user or port in a ``file:`` URI;
      hostnames (at most 253 characters) whose last label starts with a letter; IPv4 addresses without leading
      zeros;
    - enum values and integers as written (``1``, not ``1.0``); with bounds, numbers without an exponent
      (``0.001``, not ``1e-3``) and no ``-0`` (nor ``-0.0``); with ``minLength`` or ``maxLength``, no
      surrogate escapes (``\\ud83d\\ude00``): a character past U+FFFF comes as itself, one as ``len`` counts;
    - any value (``{}``, ``true``) nests containers at most max_depth deep, counted from the top,
      and a recursive ``$ref`` unrolls at most max_depth times, the branches recursing further (an
      optional property, an array item, an ``anyOf`` branch) left out.
    """
    if max_depth < 1:
        raise ValueError("max_depth must be at least 1")
    try:
        return _Builder(schema, max_depth).regex(schema, "schema", 0)
    except RecursionError:
        raise SchemaError("schema: nests too deeply") from None


def any_json_regex(max_depth: int = 4) -> str:
    """The regex of any JSON object, containers (the object itself counted) nested at most max_depth deep."""
    if max_depth < 1:
        raise ValueError("max_depth must be at least 1")
    return _object_of(_any_value(max_depth - 1))


def _json(value) -> str:
    """value as JSON text, characters as themselves but lone surrogates, escaped (UTF-8 cannot hold them)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def _literal(value) -> str:
    """A regex matching one JSON value, with the optional spaces of the layout."""
    if isinstance(value, dict):
        members = (regex_literal(_json(k)) + _COLON + _literal(v) for k, v in value.items())
        return r"\{" + _SEP.join(members) + r"\}"
    if isinstance(value, list):
        return r"\[" + _SEP.join(map(_literal, value)) + r"\]"
    return regex_literal(_json(value))


def _counts(low: int, high: int | None) -> str:
    """The quantifier of low to high repeats (high None: unbounded)."""
    short = {(0, None): "*", (1, None): "+", (0, 1): "?", (1, 1): ""}.get((low, high))
    if short is not None:
        return short
    return f"{{{low}}}" if low == high else f"{{{low},{'' if high is None else high}}}"


def _repeat(atom: str, low: int, high: int | None) -> str:
    """atom (a group or a single item) repeated low to high times."""
    return "" if high == 0 else atom + _counts(low, high)


def _list_of(item: str, low: int, high: int | None) -> str:
    """low to high items, comma separated."""
    more = _repeat(f"(?:{_SEP}{item})", max(low - 1, 0), None if high is None else high - 1)
    if low:
        return item + more
    return "" if high == 0 else f"(?:{item}{more})?"


def _object_of(value: str) -> str:
    return r"\{" + _list_of(_STRING + _COLON + value, 0, None) + r"\}"


@functools.lru_cache(maxsize=None)
def _any_value(levels: int) -> str:
    """Any JSON value, with containers nested at most levels deep (0: scalars only)."""
    if levels <= 0:
        return _SCALAR
    inner = _any_value(levels - 1)
    regex = rf"(?:{_SCALAR}|\[{_list_of(inner, 0, None)}\]|{_object_of(inner)})"
    if len(regex) > MAX_REGEX:
        raise SchemaError(f"max_depth: any JSON value nested {levels} deep needs a regex over {MAX_REGEX} characters")
    return regex


def _members(members: list[tuple[str, bool]]) -> str:
    """Object members (regex, required) in order, the optional ones possibly absent, commas only between.

    Built from the last member back, in size linear in the members: ``first`` matches a non-empty run
    of the members from here on (None: there are none), ``tail`` the members from here on each after
    a comma (possibly none of them), and ``needed`` says one of them is required.
    """
    first, tail, needed = None, "", False
    for member, required in reversed(members):
        if required:
            first, tail, needed = member + tail, _SEP + member + tail, True
            continue
        if needed:
            first = f"(?:{member}{_SEP})?{first}"
        else:
            first = member if first is None else f"(?:(?:{member}{_SEP})?{first}|{member})"
        tail = f"(?:{_SEP}{member})?{tail}"
    if first is None:
        return ""
    return first if needed else f"(?:{first})?"


def _count(schema: dict, key: str, path: str, default: int | None, most: int | None = MAX_COUNT) -> int | None:
    """The count schema[key], a whole number from 0 to most (None: any), or default where it has none."""
    if key not in schema:
        return default
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (most is not None and value > most):
        if most is None:
            raise SchemaError(f"{path}.{key}: must be a whole number, 0 or more, got {value!r}")
        raise SchemaError(f"{path}.{key}: must be a whole number from 0 to {most} (larger counts are not "
                          f"supported), got {value!r}")
    return value


def _numeric(schema: dict, path: str, integer: bool) -> str:
    """An integer or a number within the schema's bounds, exactly: any integer bounds; for numbers, bounds
    that are whole numbers (others are refused). A bounded number has no exponent (``0.001``, not ``1e-3``);
    an unbounded one may have one."""
    low, high = _bounds(schema, path, integer)
    if low is None and high is None:
        return _INTEGER if integer else _NUMBER
    if low is not None and high is not None and (low[0] > high[0] or low[0] == high[0] and (low[1] or high[1])):
        raise SchemaError(f"{path}.{high[2]}: no {'integer' if integer else 'number'} is left between {low[2]} "
                          f"{schema[low[2]]!r} and {high[2]} {schema[high[2]]!r}")
    if integer:
        return _group(_integer_range(low[0] if low else None, high[0] if high else None))
    for value, _, key in filter(None, (low, high)):
        if value != math.floor(value):
            raise SchemaError(f"{path}.{key}: a number bound of {schema[key]!r} (not a whole number) is not "
                              f"supported; {_BOUNDS_SUPPORTED}")
    low, high = ((int(b[0]), b[1]) if b else (None, False) for b in (low, high))
    return _group(_number_range(*low, *high))


def _bounds(schema: dict, path: str, integer: bool) -> tuple:
    """The tightest lower and upper bounds (value, exclusive, key), None where there is none; for integers
    the least and the greatest integer allowed (inclusive). Exclusive bounds are numbers (2020-12) or, next to
    minimum and maximum, true (draft 4)."""
    lows, highs = [], []
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key not in schema:
            continue
        value, exclusive, lower = schema[key], key.startswith("exclusive"), key in ("minimum", "exclusiveMinimum")
        plain = "minimum" if lower else "maximum"
        if exclusive and isinstance(value, bool):  # the draft-4 form, a flag on minimum or maximum
            if value and plain not in schema:
                raise SchemaError(f"{path}.{key}: true (the draft-4 form) needs {plain} alongside")
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or isinstance(value, float) and not math.isfinite(value):
            raise SchemaError(f"{path}.{key}: must be a number, got {value!r}")
        if abs(value) >= 10 ** MAX_COUNT:
            raise SchemaError(f"{path}.{key}: bounds of more than {MAX_COUNT} digits are not supported")
        exclusive = exclusive or schema.get("exclusive" + plain.capitalize()) is True
        if integer and lower:
            value, exclusive = (math.floor(value) + 1 if exclusive else math.ceil(value)), False
        elif integer:
            value, exclusive = (math.ceil(value) - 1 if exclusive else math.floor(value)), False
        (lows if lower else highs).append((value, exclusive, key))
    low = max(lows, key=lambda b: (b[0], b[1]), default=None)  # at a tie, the exclusive one
    high = min(highs, key=lambda b: (b[0], not b[1]), default=None)
    return low, high


def _group(alternatives: list[str]) -> str:
    """One atom matching any of the alternatives."""
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"


def _integer_range(low: int | None, high: int | None) -> list[str]:
    """Alternatives matching the integers from low to high (None: unbounded), as JSON writes them (no ``-0``)."""
    out = []
    if high is None or high >= 0:
        out += _natural(0 if low is None else max(low, 0), high)
    if low is None or low < 0:  # a minus sign, then the magnitudes
        out.append("-" + _group(_natural(1 if high is None or high >= 0 else -high, None if low is None else -low)))
    return out


def _number_range(low: int | None, low_exclusive: bool, high: int | None, high_exclusive: bool) -> list[str]:
    """Alternatives matching the numbers (no exponent) between the whole numbers low and high (None: unbounded),
    each end exclusive or not; the range holds at least one number."""
    out = []
    if high is None or high > 0 or high == 0 and not high_exclusive:
        out += _unsigned(0, False, high, high_exclusive) if low is None or low < 0 else \
            _unsigned(low, low_exclusive, high, high_exclusive)
    if low is None or low < 0:  # a minus sign, then the magnitudes: above 0 (no -0), or from -high
        upper = None if low is None else -low
        magnitudes = _unsigned(0, True, upper, low_exclusive) if high is None or high >= 0 else \
            _unsigned(-high, high_exclusive, upper, low_exclusive)
        out.append("-" + _group(magnitudes))
    return out


def _unsigned(low: int, low_exclusive: bool, high: int | None, high_exclusive: bool) -> list[str]:
    """Alternatives matching the numbers without sign or exponent between the whole numbers 0 <= low < high
    (high None: unbounded; or low == high, both inclusive): an integer part inside takes any fraction, one at
    an exclusive low only a fraction above zero, one at an inclusive high only zeros."""
    out = [rf"{low}\.[0-9]*[1-9][0-9]*"] if low_exclusive else []
    first, last = low + low_exclusive, None if high is None else high - 1
    if last is None or first <= last:
        out.append(_group(_natural(first, last)) + _FRACTION)
    if high is not None and not high_exclusive:
        out.append(rf"{high}(?:\.0+)?")
    return out


def _natural(low: int, high: int | None) -> list[str]:
    """Alternatives matching the numerals (no leading zeros) of the integers from low to high, 0 <= low <= high
    (high None: unbounded). Those of low's length at least low, the whole lengths between, and those of high's
    length at most high; O(digits) alternatives, each part of the same length split as ``_same_length`` does."""
    lowest = str(low)
    if high is not None and len(str(high)) == len(lowest):
        return _same_length(lowest, str(high))
    start = len(lowest) + (low != 10 ** (len(lowest) - 1))  # the first length taken whole
    out = [] if start == len(lowest) else _at_least(lowest)
    if high is None:
        return out + ["[1-9][0-9]" + _counts(start - 1, None)]
    highest = str(high)
    end = len(highest) - (high != 10 ** len(highest) - 1)  # the last length taken whole
    if start <= end:
        out.append("[1-9]" + _repeat("[0-9]", start - 1, end - 1))
    if end < len(highest):
        out += _same_length("1" + "0" * (len(highest) - 1), highest)
    return out


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives matching the digit strings from low to high, of one length (low <= high): after the common
    prefix, low's next digit followed by anything at least the rest of low, the digits between followed by any
    digits, and high's next digit followed by anything at most the rest of high. E.g. 118..255:
    ``11[89]|1[2-9][0-9]|2[0-4][0-9]|25[0-5]``."""
    if low == high:
        return [low]
    common = next(i for i, (a, b) in enumerate(zip(low, high)) if a != b)
    first, last, rest = int(low[common]), int(high[common]), len(low) - common - 1
    low_rest, high_rest = low[common + 1:], high[common + 1:]
    out = []
    if low_rest != "0" * rest:
        out += _prefixed(str(first), _at_least(low_rest))
        first += 1
    middle = last if high_rest == "9" * rest else last - 1
    if first <= middle:
        out.append(_digit_range(first, middle) + _repeat("[0-9]", rest, rest))
    if middle < last:
        out += _prefixed(str(last), _at_most(high_rest))
    return _prefixed(low[:common], out)


def _at_least(low: str) -> list[str]:
    """Alternatives matching the digit strings of low's length from low up (to 9...9)."""
    end = len(low.rstrip("0")) - 1  # low's last non-zero digit; below it zeros, which take any digit
    if end < 0:
        return [_repeat("[0-9]", len(low), len(low))]
    out = [_digit_range(int(low[end]), 9) + _repeat("[0-9]", len(low) - 1 - end, len(low) - 1 - end)]
    for i in range(end - 1, -1, -1):
        digit, rest = int(low[i]), len(low) - 1 - i
        out = _prefixed(low[i], out) + [_digit_range(digit + 1, 9) + _repeat("[0-9]", rest, rest)] * (digit < 9)
    return out


def _at_most(high: str) -> list[str]:
    """Alternatives matching the digit strings of high's length up to high (from 0...0)."""
    end = len(high.rstrip("9")) - 1  # high's last digit that is not 9; below it nines, which take any digit
    if end < 0:
        return [_repeat("[0-9]", len(high), len(high))]
    out = [_digit_range(0, int(high[end])) + _repeat("[0-9]", len(high) - 1 - end, len(high) - 1 - end)]
    for i in range(end - 1, -1, -1):
        digit, rest = int(high[i]), len(high) - 1 - i
        out = [_digit_range(0, digit - 1) + _repeat("[0-9]", rest, rest)] * (digit > 0) + _prefixed(high[i], out)
    return out


def _prefixed(prefix: str, alternatives: list[str]) -> list[str]:
    """The alternatives after prefix: prefix(?:a|b) where that is shorter than prefix a|prefix b (so the
    size stays linear in the digits), else each one prefixed."""
    if len(alternatives) > 1 and (len(alternatives) - 1) * len(prefix) > 4:
        return [f"{prefix}(?:{'|'.join(alternatives)})"]
    return [prefix + alternative for alternative in alternatives]


def _digit_range(first: int, last: int) -> str:
    """One digit from first to last."""
    return str(first) if first == last else f"[{first}{last}]" if last == first + 1 else f"[{first}-{last}]"


def _string(schema: dict, path: str) -> str:
    """A string: of the pattern or the format, fitted into minLength and maxLength where the schema has them;
    or of any characters, as many as they allow."""
    if "pattern" in schema and "format" in schema:
        raise SchemaError(f"{path}.format: cannot be combined with pattern (a regex cannot intersect them)")
    plain = "pattern" not in schema and "format" not in schema
    # beside a pattern or a format, maxLength only narrows its counts, so it may be past MAX_COUNT (2083: HttpUrl)
    low = _count(schema, "minLength", path, 0)
    high = _count(schema, "maxLength", path, None, MAX_COUNT if plain else None)
    if high is not None and low > high:
        raise SchemaError(f"{path}.maxLength: {high} is below minLength {low}")
    if plain:
        return f'"{_repeat(_CODE_POINT, low, high)}"' if "minLength" in schema or "maxLength" in schema else _STRING
    if "pattern" in schema:
        pattern = schema["pattern"]
        if not isinstance(pattern, str):
            raise SchemaError(f"{path}.pattern: must be a string, got {pattern!r}")
        tree = _pattern_tree(pattern, path + ".pattern")
        try:
            regex = _fitted(tree, low, high) if "minLength" in schema or "maxLength" in schema else _tree_regex(tree)
        except _TooVaried:
            raise SchemaError(f"{path}.pattern: fitting it into minLength and maxLength takes too long (the lengths "
                              "of its repetitions are too varied); simplify the pattern or drop the lengths") from None
        if regex is None:
            raise SchemaError(f"{path}.pattern: no match of {pattern!r} has a length {_length_range(low, high)} "
                              "(minLength to maxLength)")
        return f'"{regex}"'
    name = schema["format"]
    if not isinstance(name, str) or name not in _FORMATS:
        raise SchemaError(f"{path}.format: format {name!r} is not supported; supported: {', '.join(_FORMATS)}")
    regex = _format_regex(name, low, high)
    if regex is None:
        floor, ceiling = _FORMAT_LENGTHS.get(name, (0, None))
        own = f" (its own length is {_length_range(floor, ceiling)})" if name in _FORMAT_LENGTHS else ""
        raise SchemaError(f"{path}.format: no {name!r} string{own} has a length {_length_range(low, high)} "
                          "(minLength to maxLength)")
    return f'"{regex}"'


@functools.lru_cache(maxsize=256)
def _format_regex(name: str, low: int, high: int | None) -> str | None:
    """The regex of the JSON texts of the format's strings with a length from low to high (None where none)."""
    tree = _pattern_tree(_FORMATS[name], f"format {name}")
    floor, ceiling = _FORMAT_LENGTHS.get(name, (0, None))
    low, high = max(low, floor), ceiling if high is None else high if ceiling is None else min(high, ceiling)
    return _tree_regex(tree) if (low, high) == (0, None) else _fitted(tree, low, high)


def _holds_ref(schema) -> bool:
    """Whether a $ref is anywhere in schema."""
    if isinstance(schema, dict):
        return "$ref" in schema or any(map(_holds_ref, schema.values()))
    return isinstance(schema, list) and any(map(_holds_ref, schema))


class _Builder:
    """The regex of one root schema: $refs resolve against it; ``expanding`` holds the $refs being expanded, and
    ``expanded`` what each expansion came to (a regex or the error), by the $ref, the depth and ``expanding``'s
    counts, which decide it: a $ref met again there is not expanded again."""

    def __init__(self, root, max_depth: int):
        self.root, self.max_depth, self.expanding, self.expanded, self.visited = root, max_depth, [], {}, 0

    def regex(self, schema, path: str, depth: int) -> str:
        """The regex of schema at path, a value inside depth containers."""
        self.visited += 1
        if self.visited > MAX_SCHEMAS:
            raise SchemaError(f"{path}: building the regex visits over {MAX_SCHEMAS} subschemas ($refs expanding "
                              "each other); simplify the schema or lower max_depth")
        if schema is True:
            return _any_value(self.max_depth - depth)
        if schema is False:
            raise SchemaError(f"{path}: the schema false allows no value")
        if not isinstance(schema, dict):
            raise SchemaError(f"{path}: a schema must be an object or a boolean, got {schema!r}")
        if "$id" in schema and schema is not self.root and _holds_ref(schema):
            raise SchemaError(f"{path}.$id: an $id below the root, over a $ref, is not supported (the $ref would "
                              "resolve against this $id)")
        keys = [key for key in schema if key not in _ANNOTATIONS]
        for key in keys:
            if key not in _KEYWORDS:
                raise SchemaError(f"{path}.{key}: the keyword {key!r} is not supported; supported: "
                                  f"{', '.join(sorted(_KEYWORDS))}")
        combinator = next((key for key in _COMBINATORS if key in schema), None)
        if combinator and len(keys) > 1:
            others = ", ".join(key for key in keys if key != combinator)
            raise SchemaError(f"{path}.{combinator}: cannot be combined with {others}")
        if combinator:
            regex = self._combinator(combinator, schema[combinator], f"{path}.{combinator}", depth)
        elif "enum" in schema or "const" in schema:
            regex = self._enum(schema, path, depth)
        else:
            types = self._types(schema, path)
            if not types:
                return _any_value(self.max_depth - depth)
            regex = self._either([functools.partial(self._typed, name, schema, path, depth) for name in types])
        if len(regex) > MAX_REGEX:
            raise SchemaError(f"{path}: the regex of this schema would be over {MAX_REGEX} characters; simplify it "
                              "(fewer alternatives, less nesting, lower max_depth)")
        return regex

    @staticmethod
    def _either(branches) -> str:
        """The alternatives the branches build, leaving out those cut by the recursion bound (all cut: that error)."""
        out, cut = [], None
        for branch in branches:
            try:
                out.append(branch())
            except _Cut as exc:
                cut = exc
        if not out:
            raise cut
        out = list(dict.fromkeys(out))
        return out[0] if len(out) == 1 else f"(?:{'|'.join(out)})"

    def _combinator(self, key: str, value, path: str, depth: int) -> str:
        if key == "$ref":
            return self._ref(value, path, depth)
        if not isinstance(value, list) or not value:
            raise SchemaError(f"{path}: must be a non-empty list of schemas")
        if key == "allOf":
            if len(value) != 1:
                raise SchemaError(f"{path}: only allOf with exactly one schema is supported")
            return self.regex(value[0], f"{path}[0]", depth)
        return self._either([functools.partial(self.regex, s, f"{path}[{i}]", depth) for i, s in enumerate(value)])

    def _ref(self, ref, path: str, depth: int) -> str:
        found = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        if ref == "#":
            target, where = self.root, "schema"
        elif found and isinstance(self.root, dict) and isinstance(self.root.get(found[1]), dict):
            name = found[2].replace("~1", "/").replace("~0", "~")
            target, where = self.root[found[1]].get(name), f"schema.{found[1]}.{name}"
            if target is None:
                raise SchemaError(f"{path}: {ref!r} names no schema")
        else:
            raise SchemaError(f"{path}: only '#', '#/$defs/NAME' and '#/definitions/NAME' (in the root schema) are "
                              f"supported, not {ref!r}")
        if self.expanding.count(ref) >= self.max_depth:
            raise _Cut(f"{path}: {ref!r} recurses more than max_depth={self.max_depth} times, with no branch that "
                       "ends the recursion (an optional property, an empty array, an anyOf alternative)")
        key = (ref, depth, tuple(sorted(collections.Counter(self.expanding).items())))
        if key not in self.expanded:
            self.expanding.append(ref)
            try:
                self.expanded[key] = self.regex(target, where, depth)
            except SchemaError as exc:
                self.expanded[key] = exc
            finally:
                self.expanding.pop()
        if isinstance(self.expanded[key], SchemaError):
            raise self.expanded[key]
        return self.expanded[key]

    def _enum(self, schema: dict, path: str, depth: int) -> str:
        """The values listed; checked against the schema's other keywords (its regex) when it has some."""
        values = schema.get("enum", [])
        if "enum" in schema and (not isinstance(values, list) or not values):
            raise SchemaError(f"{path}.enum: must be a non-empty list")
        for key, value in [("enum", v) for v in values] + [("const", schema.get("const"))] * ("const" in schema):
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):  # NaN or an infinity (1e400 reads as one), an integer too long to write
                raise SchemaError(f"{path}.{key}: a value that cannot be written as JSON (NaN, an infinity, an "
                                  "integer of too many digits, not a JSON type)") from None
        if "const" in schema:
            const = _json(schema["const"])
            values = [v for v in values if _json(v) == const] if "enum" in schema else [schema["const"]]
        rest = {key: value for key, value in schema.items() if key not in ("enum", "const")}
        if set(rest) - _ANNOTATIONS:
            allowed = re.compile(self.regex(rest, path, depth))
            values = [v for v in values if allowed.fullmatch(json.dumps(v, ensure_ascii=False, separators=(",", ":")))]
        if not values:
            raise SchemaError(f"{path}.{'enum' if 'enum' in schema else 'const'}: no value is left that the rest of "
                              "the schema allows")
        return self._either([functools.partial(_literal, v) for v in values])

    @staticmethod
    def _types(schema: dict, path: str) -> list[str]:
        """The types to generate: the schema's, or those its keywords constrain (number for both numerics)."""
        if "type" not in schema:
            return [t for t in ("object", "array", "string", "number") if any(k in schema for k in _TYPE_KEYWORDS[t])]
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not names or not all(isinstance(name, str) and name in _TYPE_KEYWORDS for name in names):
            raise SchemaError(f"{path}.type: must be one of {', '.join(_TYPE_KEYWORDS)} or a non-empty list of them, "
                              f"got {schema['type']!r}")
        return list(dict.fromkeys(names))

    def _typed(self, name: str, schema: dict, path: str, depth: int) -> str:
        if name == "object":
            return self._object(schema, path, depth)
        if name == "array":
            return self._array(schema, path, depth)
        if name == "string":
            return _string(schema, path)
        if name in ("integer", "number"):
            return _numeric(schema, path, name == "integer")
        return "(?:true|false)" if name == "boolean" else "null"

    def _object(self, schema: dict, path: str, depth: int) -> str:
        properties, required = schema.get("properties"), schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if properties is not None and not isinstance(properties, dict):
            raise SchemaError(f"{path}.properties: must be an object of schemas")
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise SchemaError(f"{path}.required: must be a list of property names")
        unlisted = [name for name in required if name not in (properties or {})]
        if unlisted:
            raise SchemaError(f"{path}.required: {unlisted!r} not in properties; the properties listed are the ones "
                              "generated")
        if properties is None:
            if extra is False:
                return r"\{\}"
            try:
                value = self.regex(extra, f"{path}.additionalProperties", depth + 1)
            except _Cut:
                return r"\{\}"
            return _object_of(value)
        members = []
        for name, subschema in properties.items():
            try:
                value = self.regex(subschema, f"{path}.properties.{name}", depth + 1)
            except _Cut:
                if name in required:
                    raise
                continue
            members.append((regex_literal(_json(name)) + _COLON + value, name in required))
        optional = sum(not required for _, required in members)
        if optional > MAX_OPTIONAL:
            raise SchemaError(f"{path}.properties: {optional} optional properties; at most {MAX_OPTIONAL} are "
                              "supported (the regex's alternatives grow with them): make more of them required")
        return r"\{" + _members(members) + r"\}"

    def _array(self, schema: dict, path: str, depth: int) -> str:
        """An array: the tuple's items (``prefixItems``, or ``items`` as a list with ``additionalItems`` beside it,
        drafts 4-7) in order, then items of the rest (``items``, or ``additionalItems``; ``false``: none), as many
        as minItems and maxItems allow. ``additionalItems`` without a list ``items`` is ignored, as the spec says.
        A tuple's item no value matches (``false``, a recursion cut) ends the array before it."""
        low, high = _count(schema, "minItems", path, 0), _count(schema, "maxItems", path, None)
        if high is not None and low > high:
            raise SchemaError(f"{path}.maxItems: {high} is below minItems {low}")
        items = schema.get("items", True)
        if isinstance(items, list) and "prefixItems" in schema:
            raise SchemaError(f"{path}.items: a list of schemas (the drafts 4-7 form of prefixItems) cannot be "
                              "combined with prefixItems; use one of them")
        if isinstance(items, list):
            tuple_key, prefix, rest_key = "items", items, "additionalItems"
        else:
            tuple_key, prefix, rest_key = "prefixItems", schema.get("prefixItems", []), "items"
        if not isinstance(prefix, list):
            raise SchemaError(f"{path}.{tuple_key}: must be a list of schemas, got {prefix!r}")
        rest = schema.get(rest_key, True)
        regexes = []  # those of the tuple's items the array may reach
        for i, subschema in enumerate(prefix):
            where = f"{path}.{tuple_key}[{i}]"
            if i < low:  # required: its errors, a cut too, are the array's
                regexes.append(self.regex(subschema, where, depth + 1))
                continue
            if subschema is False:
                break
            try:
                regexes.append(self.regex(subschema, where, depth + 1))
            except _Cut:
                break
        try:
            item = None if rest is False else self.regex(rest, f"{path}.{rest_key}", depth + 1)
        except _Cut:
            if low > len(prefix):
                raise
            item = None
        if item is None and low > len(prefix):
            past = f" past the {len(prefix)} of {tuple_key}" if prefix else ""
            raise SchemaError(f"{path}.{rest_key}: false allows no items{past}, fewer than minItems {low}")
        if len(regexes) < len(prefix) or item is None:  # the array ends at the tuple's end, or before
            high = len(regexes) if high is None else min(high, len(regexes))
        reached = regexes[:high]
        optional = len(reached) - min(low, len(reached))
        if optional > MAX_OPTIONAL:
            raise SchemaError(f"{path}.{tuple_key}: {optional} items that may be left out (past minItems); at most "
                              f"{MAX_OPTIONAL} are supported (the regex nests a group for each): raise minItems or "
                              "lower maxItems")
        if not reached:
            return r"\[" + ("" if item is None else _list_of(item, low, high)) + r"\]"
        # the rest's items, each after a comma; then the tuple's, from the last back, each with what follows it
        # (optional past minItems), so that the regex stays linear in the items
        after = "" if item is None else _repeat(f"(?:{_SEP}{item})", max(low - len(reached), 0),
                                               None if high is None else high - len(reached))
        for i in range(len(reached) - 1, 0, -1):
            run = reached[i] + after
            after = _SEP + run if i < low else f"(?:{_SEP}{run})?"
        run = reached[0] + after
        return r"\[" + (run if low else f"(?:{run})?") + r"\]"


# --- a string's pattern, as a tree of the characters of its matches ------------------------------------
#
# A pattern (or a format) parses into a tree whose leaves are single characters of the string's value, each
# held as the regex of its JSON text (escaped or not): sequences, alternations and repetitions over them.
# The tree gives the regex of the JSON text of the pattern's matches; with minLength or maxLength, it is first
# fitted into the length range: the counts of its repetitions narrowed, the alternatives that cannot fit left
# out, so that every match of the result has a length in range (and matches the pattern).

@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so cheap to keep facts about
class _Char:
    """One character of the value; regex: a single atom matching its JSON text."""
    regex: str


@dataclasses.dataclass(frozen=True, eq=False)
class _Seq:
    items: tuple


@dataclasses.dataclass(frozen=True, eq=False)
class _Alt:
    branches: tuple


@dataclasses.dataclass(frozen=True, eq=False)
class _Rep:
    child: object
    low: int
    high: int | None  # None: unbounded


def _seq(items) -> object:
    items = tuple(items)
    return items[0] if len(items) == 1 else _Seq(items)


def _alt(branches) -> object:
    return branches[0] if len(branches) == 1 else _Alt(tuple(branches))


def _pattern_tree(pattern: str, path: str):
    """The tree of the strings that match pattern whole.

    The pattern describes the string's value: the characters it allows that JSON escapes come in
    their escaped form, so that ``.*`` or ``[^@]+`` never lets a bare quote end the string early.
    """
    def fail(what: str):
        raise SchemaError(f"{path}: {what} in {pattern!r}; supported: characters, escapes (\\. \\n \\xHH "
                          "\\uHHHH ...), . \\d \\w \\s and negations, [...] classes, groups, |, quantifiers up to "
                          f"{MAX_COUNT}, ^ at the start and $ at the end")

    text = pattern[1:] if pattern.startswith("^") else pattern
    if text.endswith("$") and (len(text) - 1 - len(text[:-1].rstrip("\\"))) % 2 == 0:
        text = text[:-1]
    groups = [([], [])]  # per open group: its alternatives read, and the items of the one being read
    i, last = 0, None  # last: what came before, "atom", "quantifier", "lazy" or None
    while i < len(text):
        quantifier, group = _QUANTIFIER.match(text, i), _GROUP.match(text, i)
        branches, items = groups[-1]
        if quantifier and quantifier[0] == "?" and last == "quantifier":  # lazy: the same strings
            i, last = i + 1, "lazy"
        elif quantifier:
            if last != "atom":
                fail(f"a quantifier with nothing to repeat at {i}")
            if quantifier[0] in "*+?":
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[quantifier[0]]
            else:
                low = int(quantifier[1] or 0)
                high = (int(quantifier[3]) if quantifier[3] else None) if quantifier[2] else low
                if max(low, high or 0) > MAX_COUNT or (high is not None and high < low):
                    fail(f"the quantifier {quantifier[0]} (counts from 0 to {MAX_COUNT}, in order)")
            items[-1] = _Rep(items[-1], low, high)
            i, last = quantifier.end(), "quantifier"
        elif text[i] == "(":
            if text.startswith("(?", i) and not group[0].startswith("(?"):
                fail(f"the group {text[i:i + 4]!r}... (lookarounds, flags)")
            groups.append(([], []))
            i, last = group.end(), None
        elif text[i] == ")":
            if len(groups) == 1:
                fail(f"an unbalanced ) at {i}")
            groups.pop()
            groups[-1][1].append(_alt(branches + [_seq(items)]))
            i, last = i + 1, "atom"
        elif text[i] == "|":
            branches.append(_seq(items))
            groups[-1] = (branches, [])
            i, last = i + 1, None
        elif text[i] in "^$":
            fail(f"the anchor {text[i]} at {i}")
        else:
            atom, i = _pattern_atom(text, i, fail)
            items.append(_Char(atom))
            last = "atom"
    if len(groups) > 1:
        fail("an unclosed (")
    branches, items = groups[0]
    return _alt(branches + [_seq(items)])


def _tree_regex(node) -> str:
    """The regex of the JSON texts (between the quotes) of the strings node matches."""
    if isinstance(node, _Char):
        return node.regex
    if isinstance(node, _Seq):
        return "".join(map(_tree_regex, node.items))
    if isinstance(node, _Alt):
        return f"(?:{'|'.join(map(_tree_regex, node.branches))})"
    if node.high == 0:
        return ""
    inner = _tree_regex(node.child)
    if node.low == node.high == 1:
        return inner
    atom = inner if isinstance(node.child, (_Char, _Alt)) else f"(?:{inner})"
    if node.low == node.high and node.low > MAX_COUNT:  # a count past what a quantifier holds, in two
        thousands, rest = divmod(node.low, MAX_COUNT)
        return f"(?:{atom}{{{MAX_COUNT}}}){_counts(thousands, thousands)}" + _repeat(atom, rest, rest)
    return atom + _counts(node.low, node.high)


def _length_range(low: int, high: int | None) -> str:
    return f"from {low} to {high}" if high is not None else f"of {low} or more"


def _fitted(tree, low: int, high: int | None) -> str | None:
    """The regex of the JSON texts of tree's matches with a length from low to high (None: unbounded), or
    None where it has none; every match of it has a length in range, but it may leave some out (see _Fit), those
    more than MAX_LENGTH_SEARCH past the least length in range among them."""
    fit = _Fit(tree, low, high)
    if not fit.some(tree, low, fit.high):
        return None
    return _tree_regex(fit.fit(tree, low, fit.high))


def _spread(budget, room: list, weights: list) -> list:
    """budget (maybe math.inf) shared out in proportion to weights, as far as room (each part's most, maybe
    math.inf) allows; what a part has no room for goes to the others."""
    if budget == math.inf:
        return list(room)
    out, open_ = [0] * len(room), [i for i, r in enumerate(room) if r > 0]
    while budget > 0 and open_:
        total = sum(weights[i] for i in open_)
        shares = [budget * weights[i] // total for i in open_]
        if not any(shares):  # less than one each: one each to the first ones
            for i in open_[:budget]:
                out[i] += 1
            break
        for i, share in zip(open_, shares):
            given = min(share, room[i] - out[i])
            out[i], budget = out[i] + given, budget - given
        open_ = [i for i in open_ if out[i] < room[i]]
    return out


def _bit_runs(bits: int):
    """The runs of consecutive set bits of bits, as (first, last) positions, lowest first."""
    while bits:
        first = (bits & -bits).bit_length() - 1
        ones = bits >> first
        length = (~ones & (ones + 1)).bit_length() - 1
        yield first, first + length - 1
        bits = ones >> length << (first + length)


class _Fit:
    """Fits a tree into a length range [low, high]. ``lengths`` is the set of the lengths of a node's matches,
    as a bit set (bit n set: some match has n characters), kept up to ``top`` (MAX_LENGTH_SEARCH past the least
    length in range the tree may have, or high): the lengths a fit needs are found there.

    ``fit(node, low, high)`` (a node with a match of a length in range) is a node whose every match is one of
    node's, with a length in range. A sequence finds lengths of its items that add up to the least length in
    range, each item's share of it in proportion to its ``weight`` (the items that have a match anyway first),
    widens each item's range around its share by the room left below and above, shared out by weight alike,
    fits each item into its range, and gives what an item could not use (its lengths come in steps) to the
    first that can. An alternation keeps the alternatives with a match in range, fitted. A repetition takes
    the count n nearest to a balance of copies and their length (about half the square root of what the range
    allows: fewer, longer copies) for which copies of one length from low/n to high/n exist, fits its child
    into that and narrows the counts to what then stays in range; where no count does, it takes copies of
    different lengths, in runs of equal ones (``(?:a|bcd){2}`` of length 4: ``a`` then ``bcd``).
    """

    def __init__(self, tree, low: int, high: int | None):
        self.sets, self.spans, self.weights, self.runs = {}, {}, {}, 0
        # lengths are looked through from the least in range on; a maxLength far past it is taken as that plus
        # MAX_LENGTH_SEARCH: the counts under it multiply into the size of the token grammar's automaton
        start = max(low, self.span(tree)[0])
        self.high = math.inf if high is None else min(high, start + MAX_LENGTH_SEARCH)
        self.top = start + MAX_LENGTH_SEARCH if high is None else self.high
        self.mask = (1 << self.top + 1) - 1

    def span(self, node) -> tuple:
        """The least and the greatest length of node's matches (math.inf: unbounded)."""
        if node not in self.spans:
            if isinstance(node, _Char):
                span = (1, 1)
            elif isinstance(node, _Seq):
                spans = [self.span(item) for item in node.items]
                span = (sum(s[0] for s in spans), sum(s[1] for s in spans))
            elif isinstance(node, _Alt):
                spans = [self.span(branch) for branch in node.branches]
                span = (min(s[0] for s in spans), max(s[1] for s in spans))
            else:
                low, high = self.span(node.child)
                if node.high == 0 or high == 0:
                    span = (0, 0)
                else:
                    span = (node.low * low, math.inf if node.high is None else node.high * high)
            self.spans[node] = span
        return self.spans[node]

    def weight(self, node) -> int:
        """How many unbounded repetitions node holds (an alternation: its alternative holding most), at least 1:
        the parts of a sequence share the room for length in proportion to it, so that a part made of parts
        that each grow (an email's domain; a URI's path) gets more than one that grows only in one place."""
        return max(self._unbounded(node), 1)

    def _unbounded(self, node) -> int:
        if node not in self.weights:
            if isinstance(node, _Char):
                count = 0
            elif isinstance(node, _Seq):
                count = sum(map(self._unbounded, node.items))
            elif isinstance(node, _Alt):
                count = max(map(self._unbounded, node.branches))
            else:
                count = (node.high is None) + self._unbounded(node.child)
            self.weights[node] = count
        return self.weights[node]

    def lengths(self, node) -> int:
        if node not in self.sets:
            if isinstance(node, _Char):
                bits = 2 & self.mask
            elif isinstance(node, _Seq):
                bits = 1
                for item in node.items:
                    bits = self._sum(bits, self.lengths(item))
            elif isinstance(node, _Alt):
                bits = 0
                for branch in node.branches:
                    bits |= self.lengths(branch)
            else:  # the lengths of low copies, then of up to high - low more (each maybe none: length 0)
                child = self.lengths(node.child)
                more = self.top if node.high is None else min(node.high - node.low, self.top)
                bits = self._sum(self._power(child, node.low), self._power(child | 1, more))
            self.sets[node] = bits
        return self.sets[node]

    def some(self, node, low: int, high) -> bool:
        """Whether node has a match of a length from low to high (up to top)."""
        high = min(high, self.top)
        return low <= high and bool(self.lengths(node) >> low & (1 << high - low + 1) - 1)

    def _least(self, bits: int, low: int) -> int:
        """The least length in bits from low on (there is one)."""
        above = bits >> low
        return low + (above & -above).bit_length() - 1

    def _sum(self, a: int, b: int) -> int:
        """The lengths a + b, for a in a and b in b: a shifted over each run of b (the one with fewer runs)."""
        if not a or not b:
            return 0
        runs_a, runs_b = ((x & ~(x << 1)).bit_count() for x in (a, b))
        if runs_a < runs_b:
            a, b, runs_b = b, a, runs_a
        self.runs += runs_b
        if self.runs > MAX_FIT_RUNS:
            raise _TooVaried
        out = 0
        for first, last in _bit_runs(b):
            bits, done = (a << first) & self.mask, 0  # bits holds a shifted by first to first + done
            while done < last - first:
                step = min(done + 1, last - first - done)
                bits, done = (bits | bits << step) & self.mask, done + step
            out |= bits
        return out

    def _power(self, bits: int, count: int) -> int:
        """The lengths of count copies (by squaring)."""
        out = 1
        while count:
            if count & 1:
                out = self._sum(out, bits)
            count >>= 1
            if count:
                bits = self._sum(bits, bits)
        return out

    def fit(self, node, low: int, high):
        least, most = self.span(node)
        if low <= least and most <= high:
            return node
        if isinstance(node, _Alt):
            return _alt([self.fit(b, low, high) for b in node.branches if self.some(b, low, high)])
        if isinstance(node, _Seq):
            return self._fit_seq(node.items, low, high)
        return self._fit_rep(node, low, high)

    def _fit_seq(self, items: tuple, low: int, high):
        sets, after = [self.lengths(item) for item in items], [1]  # after[i]: the lengths of items[i:]
        for bits in reversed(sets):
            after.append(self._sum(bits, after[-1]))
        after.reverse()
        total = self._least(after[0], low)
        spans, weights = [self.span(item) for item in items], [self.weight(item) for item in items]
        # the length past the items' least: to the items that have a match anyway first (an optional part stays
        # optional where it can), then to the rest
        room = [most - least for least, most in spans]
        extra = _spread(total - sum(s[0] for s in spans), [r if s[0] else 0 for r, s in zip(room, spans)], weights)
        more = _spread(total - sum(s[0] for s in spans) - sum(extra), [r - e for r, e in zip(room, extra)], weights)
        extra = [e + m for e, m in zip(extra, more)]
        shares, rest = [], total
        for i, bits in enumerate(sets):  # each item's share: a length of it nearest its part of the extra
            target = spans[i][0] + extra[i]  # length that leaves a length the items after it make up
            share = next(n for d in range(rest + target + 1) for n in (target - d, target + d)
                         if 0 <= n <= rest and bits >> n & 1 and after[i + 1] >> rest - n & 1)
            shares.append(share)
            rest -= share
        ups = _spread(high - total, [most - share for (_, most), share in zip(spans, shares)], weights)
        downs = _spread(total - low, [share - least for (least, _), share in zip(spans, shares)], weights)
        lows = [share - down for share, down in zip(shares, downs)]
        fitted = [self.fit(item, least, share + up) for item, least, share, up in zip(items, lows, shares, ups)]
        if high < math.inf:  # what an item left of its room (its lengths come in steps) goes to the first that
            for i, item in enumerate(items):  # can take it
                spare = high - sum(self.span(node)[1] for node in fitted)
                longest = self.span(fitted[i])[1]
                if spare <= 0:
                    break
                if longest < min(shares[i] + ups[i], spans[i][1]):
                    fitted[i] = self.fit(item, lows[i], longest + spare)
        return _Seq(tuple(fitted))

    def _fit_rep(self, node: _Rep, low: int, high):
        child, least = node.child, max(self.span(node.child)[0], 1)
        most = min(MAX_COUNT if node.high is None else node.high, high // least)
        # enough copies that their least length need not rise (where it can), and under maxLength a balance of
        # copies and their length: about half the square root of what the range allows (fewer, longer copies)
        target = -(-low // least)
        if high < math.inf:
            target = max(target, math.isqrt(high // least) // 2)
        counts = [n for n in range(max(node.low, 1), most + 1)
                  if self.some(child, -(-low // n), high // n if high < math.inf else high)]
        if not counts:
            if low == node.low == 0:  # no copy at all
                return _Seq(())
            return self._fit_copies_apart(node, low, high)
        count = min(counts, key=lambda n: (abs(n - target), -n))
        fitted = self.fit(child, -(-low // count), high // count if high < math.inf else high)
        shortest, longest = self.span(fitted)
        fewest = max(node.low, -(-low // shortest)) if low else node.low
        most = node.high if node.high is not None else math.inf
        if high < math.inf and longest:
            most = min(most, high // longest, MAX_COUNT)
        return _Rep(fitted, fewest, None if most == math.inf else most)

    def _fit_copies_apart(self, node: _Rep, low: int, high):
        """node, a repetition, fitted to one length in range, made of copies of different lengths."""
        bits = self.lengths(node.child)
        total = self._least(self.lengths(node), low)
        powers = [1]  # powers[n]: the lengths of n copies
        while len(powers) <= node.low or not powers[-1] >> total & 1:
            powers.append(self._sum(powers[-1], bits))
        shares, rest = [], total
        for left in range(len(powers) - 1, 0, -1):  # the longest copy first, so that equal lengths run together
            share = next(n for n in range(min(rest, shares[-1] if shares else rest), -1, -1)
                         if bits >> n & 1 and powers[left - 1] >> rest - n & 1)
            shares.append(share)
            rest -= share
        return _seq([_Rep(self.fit(node.child, share, share), len(run), len(run))
                     for share, run in ((s, list(r)) for s, r in itertools.groupby(shares))])


def _pattern_atom(text: str, i: int, fail) -> tuple[str, int]:
    """The pattern's character or class at i, as a regex of its JSON text; and where the next one starts."""
    if text[i] == "[":
        negated = text.startswith("[^", i)
        i += 1 + negated
        items = []
        while i < len(text) and (text[i] != "]" or not items):  # a ] first is a literal
            if text[i] == "\\" and text[i + 1:i + 2] in _SHORTHANDS:
                items.append(text[i:i + 2])
                i += 2
                continue
            low, i = _pattern_char(text, i, fail)
            high = low
            if text.startswith("-", i) and text[i + 1:i + 2] not in ("", "]"):
                high, i = _pattern_char(text, i + 1, fail)
                if high < low:
                    fail(f"the range {low!r}-{high!r}")
            items.append((ord(low), ord(high)))
        if i >= len(text):
            fail("an unclosed [")
        return _class(negated, items, fail), i + 1
    if text[i] == ".":
        return _class(True, [(0x0A, 0x0A)], fail), i + 1
    if text[i] == "\\" and text[i + 1:i + 2] in _SHORTHANDS:
        negated, item = _SHORTHANDS[text[i + 1]]
        return _class(negated, [item], fail), i + 2
    char, i = _pattern_char(text, i, fail)
    one = _json_char(char)
    return f"(?:{one})" if _json(char) != f'"{char}"' else one, i  # an escape: one atom


def _pattern_char(text: str, i: int, fail) -> tuple[str, int]:
    """The character at i, maybe escaped, and where the next one starts."""
    if text[i] != "\\":
        return text[i], i + 1
    escaped = text[i + 1:i + 2]
    if escaped and escaped in _PUNCTUATION:
        return escaped, i + 2
    if escaped in _CHAR_ESCAPES:
        return _CHAR_ESCAPES[escaped], i + 2
    found = _HEX.match(text, i + 1)
    if not found:
        fail(f"the escape \\{escaped} (word boundaries, back-references and others are not supported)")
    return chr(int(found[1] or found[2], 16)), found.end()


def _json_char(char: str) -> str:
    """A regex of char as a JSON string holds it (escaped or not)."""
    return regex_literal(_json(char)[1:-1])


def _class_item(item) -> str:
    if isinstance(item, str):
        return item
    return _class_char(item[0]) if item[0] == item[1] else f"{_class_char(item[0])}-{_class_char(item[1])}"


def _class_char(code: int) -> str:
    char = chr(code)
    return "\\" + char if char in "\\]-^[" else f"\\x{code:02x}" if code < 0x20 else char


def _class(negated: bool, items: list, fail) -> str:
    """A class of the pattern: its characters JSON holds as they are in a class, the others escaped.

    ``\\d \\w \\s`` mean what Python's ``re`` (the validator's) makes of them, in Unicode, but only their ASCII
    members are offered, spelled out (the token-mask compiler reads the shorthands as ASCII); a class negating
    one (``\\D``, ``[^\\s,]``) offers only the ASCII characters it allows.
    """
    shorthands = [item for item in items if isinstance(item, str)]
    for item in shorthands:
        if not negated and item[1] not in "dws":
            fail(f"{item} inside [...]")
    if shorthands:
        members = re.compile(f"[{'^' * negated}{''.join(map(_class_item, items))}]")
        runs = _runs([code for code in range(0x80) if members.fullmatch(chr(code))])
        items, negated = runs + [item for item in items if not negated and item not in shorthands], False
        if not items:
            fail("a class no ASCII character matches")
    body = "".join(map(_class_item, items))
    if negated:
        plain = "[^" + body + r'"\\\x00-\x1f]'
    else:
        parts = [_class_item((max(lo, item[0]), min(hi, item[1])))
                 for item in items for lo, hi in _JSON_PLAIN if max(lo, item[0]) <= min(hi, item[1])]
        plain = f"[{''.join(parts)}]" if parts else ""
    members = re.compile(f"[{'^' * negated}{body}]")
    escaped = [c for c in _JSON_ESCAPED if members.fullmatch(c)]
    options = [plain] * bool(plain) + [_escapes(escaped)] * bool(escaped)
    return plain if options == [plain] else f"(?:{'|'.join(options)})"


def _runs(codes: list[int]) -> list[tuple[int, int]]:
    """Ascending code points as ranges of consecutive ones."""
    out = []
    for code in codes:
        if out and out[-1][1] == code - 1:
            out[-1] = (out[-1][0], code)
        else:
            out.append((code, code))
    return out


def _escapes(chars: list[str]) -> str:
    """A regex of the JSON escapes of chars (\\" \\n \\u001f ...), the \\u ones grouped by their first digits."""
    escapes = [_json(c)[2:-1] for c in chars]
    short = "".join("\\\\" if e == "\\" else e for e in escapes if len(e) == 1)
    options = [f"[{short}]"] * bool(short)
    for prefix in ("u000", "u001"):
        digits = "".join(e[4] for e in escapes if e.startswith(prefix))
        options += [f"{prefix}[{digits}]"] * bool(digits)
    return r"\\(?:" + "|".join(options) + ")"
