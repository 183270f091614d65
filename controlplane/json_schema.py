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
"""

from __future__ import annotations

import collections
import functools
import json
import math
import re

from twinplane.controlplane.grammar import regex_literal

MAX_REGEX = 200_000  # characters; a schema needing a larger regex is refused
MAX_COUNT = 1000  # the largest count of a {n,m} quantifier
MAX_OPTIONAL = 64  # optional properties per object
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

_DATE = ("(?:[0-9]{4}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
         "|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)")  # leap days too
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}",
    "email": r"[A-Za-z0-9_%+\-]+(?:\.[A-Za-z0-9_%+\-]+)*@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}",
}

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


def _count(schema: dict, key: str, path: str, default: int | None) -> int | None:
    if key not in schema:
        return default
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise SchemaError(f"{path}.{key}: must be a whole number from 0 to {MAX_COUNT} (larger counts are not "
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
    kinds = [key for key in ("pattern", "format", "minLength", "maxLength") if key in schema]
    if len(kinds) > 1 and kinds[:2] != ["minLength", "maxLength"]:
        raise SchemaError(f"{path}.{kinds[1]}: cannot be combined with {kinds[0]} (a regex cannot intersect them)")
    if "pattern" in schema:
        pattern = schema["pattern"]
        if not isinstance(pattern, str):
            raise SchemaError(f"{path}.pattern: must be a string, got {pattern!r}")
        return f'"(?:{_pattern_regex(pattern, path + ".pattern")})"'
    if "format" in schema:
        regex = _FORMATS.get(schema["format"]) if isinstance(schema["format"], str) else None
        if regex is None:
            raise SchemaError(f"{path}.format: format {schema['format']!r} is not supported; supported: "
                              f"{', '.join(_FORMATS)}")
        return f'"{regex}"'
    low, high = _count(schema, "minLength", path, 0), _count(schema, "maxLength", path, None)
    if high is not None and low > high:
        raise SchemaError(f"{path}.maxLength: {high} is below minLength {low}")
    return f'"{_repeat(_CODE_POINT, low, high)}"' if "minLength" in schema or "maxLength" in schema else _STRING


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


# --- a string's pattern, as the regex of the JSON text of its matches --------------------------------

def _pattern_regex(pattern: str, path: str) -> str:
    """The regex of the JSON text (between the quotes) of the strings that match pattern whole.

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
    out, i, depth, last = [], 0, 0, None  # last: what came before, "atom", "quantifier", "lazy" or None
    while i < len(text):
        quantifier, group = _QUANTIFIER.match(text, i), _GROUP.match(text, i)
        if quantifier and quantifier[0] == "?" and last == "quantifier":  # lazy: the same strings
            i, last = i + 1, "lazy"
        elif quantifier:
            if last != "atom":
                fail(f"a quantifier with nothing to repeat at {i}")
            if quantifier[0] in "*+?":
                out.append(quantifier[0])
            else:
                low = int(quantifier[1] or 0)
                high = (int(quantifier[3]) if quantifier[3] else None) if quantifier[2] else low
                if max(low, high or 0) > MAX_COUNT or (high is not None and high < low):
                    fail(f"the quantifier {quantifier[0]} (counts from 0 to {MAX_COUNT}, in order)")
                out.append(_counts(low, high))
            i, last = quantifier.end(), "quantifier"
        elif text[i] == "(":
            if text.startswith("(?", i) and not group[0].startswith("(?"):
                fail(f"the group {text[i:i + 4]!r}... (lookarounds, flags)")
            out.append("(?:")
            i, depth, last = group.end(), depth + 1, None
        elif text[i] == ")":
            if not depth:
                fail(f"an unbalanced ) at {i}")
            out.append(")")
            i, depth, last = i + 1, depth - 1, "atom"
        elif text[i] == "|":
            out.append("|")
            i, last = i + 1, None
        elif text[i] in "^$":
            fail(f"the anchor {text[i]} at {i}")
        else:
            atom, i = _pattern_atom(text, i, fail)
            out.append(atom)
            last = "atom"
    if depth:
        fail("an unclosed (")
    return "".join(out)


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
