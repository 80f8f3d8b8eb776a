"""Hypothesis strategies of malformed input files, made from small heads of the committed data.

`csv_mutants(spec)` and `json_mutants(spec)` draw a `Mutant`: the bytes of a damaged copy of the
spec's file, what was done to it, and whether it is certainly malformed (`strict`: a required column
gone or repeated, a value that cannot be what its column holds, a row of the wrong width, a file that
is not UTF-8 text, compressed, empty or of another kind) or may be harmless (a byte flipped, a
provenance cell changed, a row duplicated...). `tests/corrupt.py` has the fixed cases these extend.
`near(*valid)` draws words near valid spellings of a grammar (command-line values, API strings).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hypothesis import strategies as st

from .corrupt import COMPRESSIONS, compressed, latin1

# Cell values no column of a results file holds: a number is needed and these are none, or not finite.
NOT_A_NUMBER = ("abc", "", " ", "nan", "NaN", "-nan", "inf", "-inf", "+Infinity", "1e999", "-1e999", "0x10", "--1",
                "1,5", "∞", "١٢x", "1e", "True", "None")
NOT_A_TIME = (*NOT_A_NUMBER, "-1", "0", "-0", "-1e-9", "-5e300")  # times are finite and > 0
NOT_A_COUNT = (*NOT_A_TIME, "1.5", "0.5", "-3")  # sizes and counts are positive integers
# Anything else a cell may be drawn as: numbers at the edges, text, odd characters.
ANY_CELL = (*NOT_A_COUNT, "1e308", "-1e308", "5e-324", "1e-300", "9" * 30, "1_000", "١٢", "0", "1", "2", "4096",
            "1.0", "host", "hbm", "peer", "none", "expert_wave", "lag:4@50:128", "serial:cudnn", "x" * 300,
            "é", "\t7", '"', "a;b", "=1+1")
ZSTD_MAGIC = b"(\xb5/\xfd"


@dataclass(frozen=True)
class CsvSpec:
    """A small valid CSV of one kind: its text, the columns a reader needs (`required`), and the
    values certainly refused in some columns (`strict`, column -> values; not in `loose_rows`)."""

    name: str
    text: str
    required: frozenset
    strict: dict = field(default_factory=dict)
    loose_rows: frozenset = frozenset()  # data rows (1-based) where `strict` does not apply

    @property
    def header(self) -> list[str]:
        return self.text.splitlines()[0].split(",")

    @property
    def rows(self) -> int:
        return len(self.text.splitlines()) - 1


@dataclass(frozen=True)
class JsonSpec:
    """A valid JSON file of one kind: the document, its required paths (deleting one is refused) and
    the paths whose leaves must be finite positive numbers (`numbers`; a path ending in `*` means
    every key of that object)."""

    name: str
    doc: dict
    required: tuple = ()
    numbers: tuple = ()
    nonfinite: bool = False  # the file's writer keeps NaN and infinities, and its reader takes them
    typed: bool = True  # False: a record any JSON object may be (another kind of file is not refused)


class Mutant:
    """A damaged file: its bytes, what was done, and whether it is certainly malformed (`strict`)."""

    __slots__ = ("data", "strict", "what")

    def __init__(self, data: bytes, strict: bool, what: str):
        self.data, self.strict, self.what = data, strict, what

    def __repr__(self) -> str:  # what a failing example prints: the change, and the start of the bytes
        return f"Mutant({self.what!r}, strict={self.strict}, {self.data[:60]!r}... ({len(self.data)} bytes))"


def _lines(text: str) -> list[list[str]]:
    return [line.split(",") for line in text.splitlines()]


def _join(rows: list[list[str]]) -> bytes:
    return ("\n".join(",".join(r) for r in rows) + "\n").encode()


def encoding_mutants(text: str, other_kinds: list[str]):
    """Whole-file changes every loader refuses (or, BOM and CRLF, reads alike)."""
    data = text.encode()
    refused = [Mutant(compressed(text, how), True, f"{how}-compressed") for how in COMPRESSIONS]
    refused += [Mutant(ZSTD_MAGIC + data, True, "zstd magic"), Mutant(text.encode("utf-16"), True, "UTF-16"),
                Mutant(b"", True, "empty"), Mutant(b"\n \n\t\n", True, "blank lines"),
                Mutant(latin1(text, 2), True, "Latin-1 byte"),
                Mutant(data[: len(data) // 2] + b"\x00" + data[len(data) // 2:], True, "NUL byte")]
    refused += [Mutant(o.encode(), True, f"another kind ({o.splitlines()[0][:40]}...)") for o in other_kinds]
    harmless = [Mutant(b"\xef\xbb\xbf" + data, False, "byte-order mark"),
                Mutant(text.replace("\n", "\r\n").encode(), False, "CRLF")]
    return st.sampled_from(refused + harmless)


def _bytes_mutants(data: bytes):
    """Flips, cuts and insertions anywhere: harmless or not, the loader decides."""
    n = len(data)

    @st.composite
    def flip(draw):
        i = draw(st.integers(0, n - 1))
        b = draw(st.integers(0, 255))
        return Mutant(data[:i] + bytes([b]) + data[i + 1:], False, f"byte {i} set to {b:#04x}")

    @st.composite
    def cut(draw):
        i = draw(st.integers(0, n))
        return Mutant(data[:i], False, f"cut at byte {i}")

    @st.composite
    def insert(draw):
        i = draw(st.integers(0, n))
        ins = draw(st.sampled_from([b'"', b"\r", b"\n", b",", b"\x00", b"\xff", b"\\", b"\xe2\x80\xa8", b"{", b"]",
                                    b"9" * 400, b"[" * 5000]))
        return Mutant(data[:i] + ins + data[i:], False, f"{ins[:10]!r} inserted at byte {i}")

    return st.one_of(flip(), cut(), insert())


def csv_mutants(spec: CsvSpec, other_kinds: list[str] = ()):
    rows = _lines(spec.text)
    header = rows[0]
    ncols = len(header)

    @st.composite
    def cell(draw):
        r = draw(st.integers(1, len(rows) - 1))
        c = draw(st.sampled_from(header))
        strict_values = spec.strict.get(c, ()) if r not in spec.loose_rows else ()
        v = draw(st.sampled_from(strict_values) if strict_values and draw(st.booleans())
                 else st.sampled_from(ANY_CELL) | st.text(max_size=8))
        out = [list(x) for x in rows]
        out[r][header.index(c)] = v
        # a value with a comma, quote or line end changes the row's shape: that is a row mutation
        plain = not any(ch in v for ch in ',"\r\n\x00') and "\u2028" not in v and "\x85" not in v
        return Mutant(_join(out), plain and v in strict_values, f"line {r + 1}, column {c} = {v!r}")

    @st.composite
    def column(draw):
        c = draw(st.sampled_from(header))
        i = header.index(c)
        how = draw(st.sampled_from(["repeat", "drop", "rename", "blank"]))
        if how == "repeat":
            out = [r + [r[i]] for r in rows]
            return Mutant(_join(out), True, f"column {c} repeated")
        if how == "drop":
            out = [r[:i] + r[i + 1:] for r in rows]
            return Mutant(_join(out), c in spec.required, f"column {c} dropped")
        if how == "blank":
            out = [list(r) for r in rows]
            out[0][i] = ""
            return Mutant(_join(out), True, f"column {c} unnamed")
        new = draw(st.sampled_from([h for h in header if h != c] + [c.upper(), c + " ", f"{c}_x", "é"]))
        out = [list(r) for r in rows]
        out[0][i] = new
        # a reader strips the names: `c + " "` is `c` again
        strict = new.strip() != c and (c in spec.required or new.strip() in header)
        return Mutant(_join(out), strict, f"column {c} renamed {new!r}")

    @st.composite
    def row(draw):
        r = draw(st.integers(1, len(rows) - 1))
        how = draw(st.sampled_from(["extra", "short", "duplicate", "header only", "repeat header", "swap"]))
        out = [list(x) for x in rows]
        if how == "extra":
            out[r] = out[r] + [draw(st.sampled_from(["", "1", "x"]))]
            return Mutant(_join(out), True, f"line {r + 1} has {ncols + 1} fields")
        if how == "short":
            k = draw(st.integers(1, ncols - 1))
            out[r] = out[r][:k]
            return Mutant(_join(out), True, f"line {r + 1} has {k} fields")
        if how == "duplicate":
            out.insert(r, list(out[r]))
            return Mutant(_join(out), False, f"line {r + 1} twice")
        if how == "header only":
            return Mutant(_join(out[:1]), True, "header only")
        if how == "repeat header":
            out.insert(r, list(header))
            # a header line read as data: its cells are column names, not numbers
            return Mutant(_join(out), bool(spec.strict), f"header again at line {r + 1}")
        s = draw(st.integers(1, len(rows) - 1))
        out[r], out[s] = out[s], out[r]
        return Mutant(_join(out), False, f"lines {r + 1} and {s + 1} swapped")

    return st.one_of(cell(), column(), row(), encoding_mutants(spec.text, list(other_kinds)),
                     _bytes_mutants(spec.text.encode()))


# ---- JSON ------------------------------------------------------------------------------------------

BAD_LEAVES = (float("nan"), float("inf"), -1, 0, -1e-300, 1e308, "abc", "", None, [], {}, True, 10**30, -(10**30),
              [1, 2], {"x": 1}, "inf", "nan")
LITERALS = ("1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1e400")
PLACEHOLDER = "__literal__"


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):  # the first few items of a long table stand for the rest
            yield from _paths(v, (*prefix, i))


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _with(doc, path, value=None, delete=False, rename=None):
    doc = json.loads(json.dumps(doc))
    parent = _get(doc, path[:-1])
    if delete:
        del parent[path[-1]]
    elif rename is not None:
        parent[rename] = parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return doc


def _matches(path, pattern) -> bool:
    return len(path) == len(pattern) and all(p == "*" or p == k for p, k in zip(pattern, path))


def _dump(doc) -> bytes:
    # NaN and infinities written as Python writes them (NaN, Infinity): non-standard JSON, refused
    return (json.dumps(doc, indent=1) + "\n").encode()


def json_mutants(spec: JsonSpec, other_kinds: list[str] = ()):
    doc = spec.doc
    paths = [p for p in _paths(doc) if p]
    text = _dump(doc).decode()

    @st.composite
    def leaf(draw):
        p = draw(st.sampled_from(paths))
        v = draw(st.sampled_from(BAD_LEAVES) | st.text(max_size=6) | st.integers() | st.floats())
        if draw(st.integers(0, 5)) == 0:  # a literal that no finite float holds: refused wherever it is
            lit = draw(st.sampled_from(LITERALS))
            data = _dump(_with(doc, p, PLACEHOLDER)).replace(json.dumps(PLACEHOLDER).encode(), lit.encode())
            return Mutant(data, not spec.nonfinite, f"{'.'.join(map(str, p))} = {lit}")
        number = any(_matches(p, pat) for pat in spec.numbers)
        finite_positive = (isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
                           and abs(v) != float("inf") and v > 0)
        non_finite = isinstance(v, float) and (v != v or abs(v) == float("inf"))
        strict = (non_finite and not spec.nonfinite) or (number and not finite_positive and not isinstance(v, str))
        return Mutant(_dump(_with(doc, p, v)), strict, f"{'.'.join(map(str, p))} = {v!r}")

    @st.composite
    def key(draw):
        p = draw(st.sampled_from([p for p in paths if isinstance(_get(doc, p[:-1]), dict)]))
        how = draw(st.sampled_from(["delete", "rename"]))
        if how == "delete":
            return Mutant(_dump(_with(doc, p, delete=True)), any(_matches(p, r) for r in spec.required),
                          f"{'.'.join(map(str, p))} deleted")
        new = draw(st.sampled_from(["", "x", "é", "1", "kinds", "path"]) | st.text(max_size=6))
        if new in _get(doc, p[:-1]):
            new = new + "_"
        required = any(_matches(p, r) for r in spec.required)
        return Mutant(_dump(_with(doc, p, rename=new)), required, f"{'.'.join(map(str, p))} renamed {new!r}")

    @st.composite
    def root(draw):
        v = draw(st.sampled_from([[], [doc], "text", 1, None, True]))
        return Mutant(_dump(v), True, f"the document is {type(v).__name__}")

    nesting = st.sampled_from([Mutant(b"[" * 100_000 + b"]" * 100_000, True, "arrays nested 100000 deep"),
                               Mutant(b'{"a":' * 50_000 + b"1" + b"}" * 50_000, True, "objects nested 50000 deep"),
                               Mutant(b"1" * 5000, True, "a 5000-digit number")])
    kinds = [o for o in other_kinds if spec.typed or not o.lstrip().startswith("{")]
    return st.one_of(leaf(), key(), root(), nesting, encoding_mutants(text, kinds), _bytes_mutants(text.encode()))


# ---- words of the command line and arguments of the API --------------------------------------------------

# Words no number option takes: past every bound, not finite, not numbers, empty, other digits.
NUMBER_WORDS = ("-1", "0", "-0", "nan", "NaN", "inf", "-inf", "1e999", "99999999999999999999999", str(2**63),
                str(2**64), "1e20", "1.5", "0.5", "-1e-9", "abc", "", " ", "٣", "0x10", "1_0", "4096abc", "+-1", "--1",
                "1,2", "∞", "1e", "e3", "True", "None", "0b1", "１２")
TEXT = st.text(max_size=12) | st.text(alphabet="0123456789.-+eE:@x,=_ ", max_size=12)


def near(*valid: str):
    """Valid spellings with a character replaced, dropped, doubled or inserted, a number swapped for
    an extreme one, or a piece repeated: spellings near the grammar, mostly malformed."""
    chars = "0123456789:@x-,=._ +eE"

    @st.composite
    def mutate(draw):
        v = draw(st.sampled_from(valid))
        how = draw(st.integers(0, 4))
        i = draw(st.integers(0, len(v)))
        if how == 0:
            return v[:i] + draw(st.sampled_from(chars)) + v[i + 1:]
        if how == 1:
            return v[:i] + v[i + 1:]
        if how == 2:
            return v[:i] + draw(st.sampled_from(chars)) + v[i:]
        if how == 3:
            nums = list(re.finditer(r"\d+(\.\d+)?", v))
            if not nums:
                return v + v
            m = draw(st.sampled_from(nums))
            return v[: m.start()] + draw(st.sampled_from(["0", "-1", "1e999", "nan", str(2**70), "1.5", "99999999"])) \
                + v[m.end():]
        return v + draw(st.sampled_from([",", "@", ":", ",,", "@@"])) + draw(st.sampled_from(valid + ("",)))

    return mutate() | st.sampled_from(NUMBER_WORDS) | TEXT
