"""Property: any subcommand given one malformed option value, the rest a valid cheap command, exits 2
with one line on standard error that names the option or the value, writes and changes nothing, and
ends within the watchdog.

Every option of every subcommand is found by walking `xstage.cli.build_parser()`, so a new option is
fuzzed as soon as it exists; an option without a value grammar here (`GRAMMARS`, or a validating
argparse `type=`) fails `test_every_option_has_a_grammar`, and a new subcommand without a base command
fails `test_every_subcommand_has_a_base`. Values are drawn as numbers past every bound (negative, zero,
NaN, infinities, past int64, fractions), text, unicode and empty words, mutations of valid spellings
(shapes, pacings, schedules, variants, blocks, exchanges, dtypes, sweeps, sizes, times, `--only`), and
paths that are a user's file, a file's child, a folder, a FIFO, a device, missing or the command's
input. The project's own parsers decide (`assume`) that a drawn value is malformed: what is tested is
how the command answers it.

CI replays a fixed set of examples (the `ci` profile of `tests/conftest.py`); to explore, run
    HYPOTHESIS_PROFILE=dev PYTHONPATH=src python -m pytest -p no:cacheprovider tests/test_fuzz_args.py
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from xstage.cli import build_parser
from xstage.env import has_gpu
from xstage.errors import InputError

from .corrupt import CORE_CSV, COSTS_JSON, MOE_CSV, PROFILE_JSON, committed
from .fuzzing import check_refused, examples, one_line_refusal, run_cli, snapshot
from .mutations import NUMBER_WORDS, TEXT, near
from .test_fuzz_files import MOE, PROBE_SUMMARY_FILE, REFERENCE, ULY

# ---- the subcommands, from the parser ------------------------------------------------------------------


def _leaves(parser, words=()):
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None or parser._defaults.get("handler"):  # a command of its own, its subcommands optional
        yield words, parser
    if sub is None:
        return
    for name, child in sub.choices.items():
        yield from _leaves(child, (*words, name))


LEAVES = dict(_leaves(build_parser()))


def _valued(parser) -> list[argparse.Action]:
    """The options that take a value (and positionals): what a malformed value can be given to."""
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                                            argparse._StoreTrueAction, argparse._StoreFalseAction,
                                                            argparse._StoreConstAction, argparse._CountAction,
                                                            argparse._SubParsersAction))]


def _flag(a: argparse.Action) -> str:
    return max(a.option_strings, key=len) if a.option_strings else a.dest


# ---- the folder every example runs in --------------------------------------------------------------------

def _calls_text() -> str:
    """A valid `moe-calls.csv` of one (model, tokens) pair: both sides, machine columns included."""
    from xstage.bench.moe_calls import COLUMNS
    from xstage.results.io import ENV_COLUMNS

    side = dict(model="qwen3-30b-a3b", shape="H2048-I768-E128-K8", H=2048, I=768, E=128, K=8, tokens=64,
                dtype="bf16", kernel_ns=400000, call_ns=500000, host_ns=30000, host_p10_ns=20000, host_p90_ns=40000,
                launches=3, syncs=0, graph_ns=410000, call_note="", max_err=0.001, gpu="NVIDIA H200", driver="1",
                torch="2", triton="3", git_commit="abc1234", src_hash="", date="2026-01-01")
    cols = [*COLUMNS, *ENV_COLUMNS]
    rows = [dict(side, side="xstage", impl="interleaved"), dict(side, side="transformers", impl="grouped_mm")]
    return "\n".join([",".join(cols)] + [",".join(str(r[c]) for c in cols) for r in rows]) + "\n"


def _experts_text() -> str:
    """A valid `experts.csv` of one configuration: both sides, machine columns included."""
    from xstage.integrations.transformers.bench import COLUMNS
    from xstage.results.io import ENV_COLUMNS

    side = dict(arch="qwen3-30b-a3b", shape="H2048-I768-E128-K8", tokens=64, routing="uniform", dtype="bf16",
                call_ns=500000, host_ns=30000, host_p10_ns=20000, host_p90_ns=40000, launches=3, syncs=0,
                graph_ns=410000, call_note="", max_err=0.001, gpu="NVIDIA H200", driver="1", torch="2", triton="3",
                git_commit="abc1234", src_hash="", date="2026-01-01")
    cols = [*COLUMNS, *ENV_COLUMNS]
    rows = [dict(side, side="xstage", kernel="fused"), dict(side, side="grouped_mm", kernel="grouped_mm")]
    return "\n".join([",".join(cols)] + [",".join(str(r[c]) for c in cols) for r in rows]) + "\n"


FILES = {"moe.csv": MOE.text, "calls/moe-calls.csv": _calls_text(), "experts/experts.csv": _experts_text(),
         "uly.csv": ULY.text, "data.csv": REFERENCE.text, "profile.json": PROFILE_JSON.read_text(),
         "costs.json": COSTS_JSON.read_text(),
         "grid/moe.csv": committed(MOE_CSV, 4), "grid/ulysses.csv": ULY.text, "grid/core.csv": committed(CORE_CSV, 4),
         "probe/summary.csv": PROBE_SUMMARY_FILE.text, "afile": "made by the user\n", "notes.png": "a user's file\n",
         "empty.csv": "", "trace.csv": "launch,cta,burst_index,burst_bytes,start_ns,issue_ns\n0,0,0,4096,0,900\n"
                                         "0,0,1,65536,2000,1500\n0,1,0,4096,10,900\n"}


def _make(d: Path) -> None:
    for rel, text in FILES.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    (d / "folder").mkdir()
    os.mkfifo(d / "fifo")


# ---- a valid base command per subcommand --------------------------------------------------------------------

GPU = "needs a CUDA GPU"  # where measuring would start on this machine: the base's own refusal


@dataclass(frozen=True)
class Base:
    argv: tuple
    refusal: str | None = None  # the base's own one-line refusal (None: it runs, exit 0)
    costly: bool = False  # seconds of work: its validity is left to its own tests


PLAN_MOE = ("plan", "moe", "--shape", "H512-I256-E16-K2", "--tokens", "64", "--ep", "4", "--candidates",
            "expert_wave,lag:4", "--pacing", "default", "--json")
BASES = {
    ("env",): [Base(("env", "--json"))],
    ("probe",): [Base(("probe", "--plan", "--sweep", "first", "--json")),
                 Base(("probe", "--analyse-only", "--no-fit", "-o", "probe", "--json")),
                 Base(("probe", "-o", "new", "--json"), GPU)],
    ("bench", "ulysses"): [Base(("bench", "ulysses", "-o", "grid", "--summarize-only", "--json")),
                           Base(("bench", "ulysses", "-o", "new", "--json"), GPU),
                           Base(("bench", "ulysses", "-o", "new", "--core", "--json"), GPU)],
    ("bench", "moe"): [Base(("bench", "moe", "-o", "grid", "--summarize-only", "--json")),
                       Base(("bench", "moe", "-o", "new", "--json"), GPU)],
    ("bench", "moe-calls"): [Base(("bench", "moe-calls", "-o", "calls", "--summarize-only", "--json")),
                             Base(("bench", "moe-calls", "-o", "new", "--json"), GPU)],
    ("bench", "experts"): [Base(("bench", "experts", "-o", "experts", "--summarize-only", "--json")),
                           Base(("bench", "experts", "-o", "new", "--json"), GPU)],
    ("model",): [Base(("model", "--burst", "64KiB", "--json")), Base(("model", "--plot", "plots", "--json"))],
    ("model", "score"): [Base(("model", "score", "trace.csv", "--json"))],
    ("fit",): [Base(("fit", "data.csv", "-o", "p.json", "--bootstrap", "0", "--structure", "base", "--json"))],
    ("plan", "moe"): [Base(PLAN_MOE)],
    ("plan", "ulysses"): [Base(("plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "4096", "--ranks",
                                "4", "--json"))],
    ("plan", "layer"): [Base(("plan", "layer", "--heads", "24", "--dim", "128", "--tokens", "4096", "--ranks", "4",
                              "--json"))],
    ("plan", "layer-grid"): [Base(("plan", "layer-grid", "-o", "g", "--json")),
                             Base(("plan", "layer-grid", "-o", "g", "--measured", "uly.csv", "--json"))],
    ("plan", "exchange-costs"): [Base(("plan", "exchange-costs", "-o", "x", "--json"), costly=True)],
    ("plan", "attention-costs"): [Base(("plan", "attention-costs", "uly.csv", "-o", "a", "--json"))],
    ("plan", "calibrate"): [Base(("plan", "calibrate", "-o", "new", "--json"), GPU)],
    ("plan", "validate"): [Base(("plan", "validate", "moe.csv", "-o", "v", "--json")),
                           Base(("plan", "validate", "uly.csv", "-o", "v", "--json"))],
    ("demo",): [Base(("demo", "-o", "new", "--json"), costly=True)],
}


def _with(argv: tuple, flag: tuple, value: str, positional: int | None) -> list[str]:
    """`argv` with the option's value replaced (or `flag value` added; `flag`: its spellings); a
    positional replaced in place."""
    out = list(argv)
    if positional is not None:
        out[positional] = value
        return out
    for spelling in flag:
        if spelling in out:
            out[out.index(spelling) + 1] = value
            return out
    return [*out, flag[0], value]


def _positional_index(words: tuple, parser, action) -> int | None:
    """Where a positional's value stands in a base command line (after the subcommand's words)."""
    if action.option_strings:
        return None
    order = [a.dest for a in parser._actions if not a.option_strings]
    return len(words) + order.index(action.dest)


# ---- value grammars -----------------------------------------------------------------------------------------

def _refused(check: Callable) -> Callable[[str], bool]:
    """An oracle from a project parser: True when `check(value)` refuses the value."""
    def bad(value: str) -> bool:
        try:
            check(value)
        except (InputError, argparse.ArgumentTypeError):
            return True
        return False

    return bad


def _items(check: Callable, sep: str = ",") -> Callable:
    def run(text):
        items = [t.strip() for t in str(text).split(sep) if t.strip()]
        if not items:
            raise InputError("no items")
        for t in items:
            check(t)

    return run


def _core_shapes(text: str) -> None:
    from xstage.sched.exchange import check_call_shape

    try:
        shapes = [tuple(int(x) for x in spec.split("x")) for spec in text.split(",")]
    except ValueError:
        raise InputError("not TxHxD") from None
    if not shapes or any(len(s) != 3 for s in shapes):
        raise InputError("not TxHxD")
    for t, h, dim in shapes:
        check_call_shape(h, dim, t, 1)


@functools.cache
def _grammars() -> dict:
    """Per option (flag, or `words flag` where subcommands differ): (values, oracle saying a value is
    malformed). Paths have the roles of `PATHS`."""
    from xstage.cli import plan as sc
    from xstage.cli.model import parse_count, parse_size, parse_time
    from xstage.probe.sweeps import parse_sweeps
    from xstage.results.select import parse_spec
    from xstage.spec.moe import MoeShape, parse_block
    from xstage.spec.schedule import check_schedule
    from xstage.spec.variant import Variant, parse_variants

    def dtype(allowed):
        from xstage.dtypes import parse_dtype

        return lambda v: parse_dtype(v, allowed=allowed)

    def bench_block(v):
        from xstage.bench.moe import block_per_dtype

        block_per_dtype(v, ["bf16"])

    def pacing(v):
        if v != "auto":
            sc._pacing("--pacing", v, "host", 4)

    shape = ("H512-I256-E16-K2", "H4096-I2048-E256-K6", "H7168-I3072-E384-K6")
    return {
        "--shape": (near(*shape), _refused(MoeShape.parse)),
        "plan calibrate --shapes": (near(*shape, ",".join(shape)), _refused(_items(MoeShape.parse))),
        "--model-shapes": (near(*shape), _refused(_items(MoeShape.parse))),
        "--pacing": (near("auto", "default", "off", "50:128", "25.5:64"), _refused(pacing)),
        "--default-pacing": (near("default", "off", "50:128"), _refused(lambda v: Variant("expert_wave", v))),
        "plan moe --candidates": (near("expert_wave,lag:4", "interleaved", "lag:16"), _refused(sc.schedule_list)),
        "plan validate --candidates": (near("expert_wave,lag:4", "interleaved"), _refused(sc.schedule_list)),
        "plan ulysses --candidates": (near("serial:cudnn,stores:paced:16", "overlap:cudnn:3"),
                                      _refused(sc.exchange_list)),
        "plan validate --exchange": (near("serial:cudnn", "overlap:cudnn:3:waves"),
                                     _refused(lambda v: sc.exchange_list(v, default=(), flag="--exchange"))),
        "plan moe --block-m": (near("64,128", "16"), _refused(sc.block_m_list)),
        "plan moe --dtype": (near("bf16", "fp8"), _refused(dtype(("bf16", "fp8")))),
        "plan calibrate --dtype": (near("bf16", "fp8"), _refused(dtype(("bf16", "fp8")))),
        "bench moe --dtype": (near("bf16", "fp8", "bf16,fp8"), _refused(_items(dtype(("bf16", "fp8"))))),
        "bench moe --schedules": (near("expert_wave,lag:4@50:128", "interleaved@off"),
                                  _refused(parse_variants)),
        "plan calibrate --schedules": (near("expert_wave,interleaved", "expert_wave,lag:4"),
                                       _refused(lambda v: sc._checked_list(v, [], check_schedule, "", "--schedules")
                                                if "expert_wave" in v else (_ for _ in ()).throw(InputError("")))),
        "bench moe --block": (near("128:128:256:64:8:4", "bf16=64:128:256:64:4:3"), _refused(bench_block)),
        "plan calibrate --block": (near("128:128:256:64:8:4", "64:128:256:64:4:3"),
                                   _refused(lambda v: parse_block(v, 512))),
        "--core-shapes": (near("16384x24x128", "4096x8x64,1024x2x128"), _refused(_core_shapes)),
        "--sweep": (near("all", "first,periodic", "twoburst"), _refused(lambda v: parse_sweeps(v, "host"))),
        "--burst": (near("64KiB", "65536", "4MiB", "1.5M", "10MB"), _refused(lambda v: parse_size(v))),
        "--gap": (near("2000", "20us", "1.5ms", "1s"), _refused(lambda v: parse_time(v))),
        "model --sms": (near("8", "132", "1"), _refused(lambda v: parse_count(v, "--sms", 1, 4096, ""))),
        "fit --bootstrap": (near("20", "0"), _refused(lambda v: parse_count(v, "", 0, 10_000, ""))),
        "fit --seed": (near("0", "7"), _refused(lambda v: parse_count(v, "", 0, 2**32 - 1, ""))),
        "fit --workers": (near("1", "2"), _refused(lambda v: parse_count(v, "", 1, 256, ""))),
        # an --only that parses may still select nothing (refused) or something (done): either answer
        "--only": (near("P=2,4", "tokens=4096", "path=host", "sweep=first"), lambda v: _refused(parse_spec)(v)),
        "bench ulysses --block-m": (near("128", "64", "0"), None),
        "bench ulysses --block-n": (near("128", "64"), None),
        "bench ulysses --num-warps": (near("8", "4"), None),
        "bench ulysses --num-stages": (near("3", "2"), None),
    }


# What each path option is: an output folder, an output file, or an input file (and which base file is
# its valid value). Values drawn for each role are all malformed for it.
PATHS = {
    "-o": "out-folder", "--out": "out-folder", "--plot": "out-folder",
    "fit --output": "out-file", "model score --output": "out-file", "plan moe --plot": "out-png",
    "--profile": "in", "--costs": "in", "--calibration": "in", "--data": "in", "--tuned-from": "in",
    "fit data": "in", "model score trace": "in", "results": "in", "--measured": "in",
}
BAD_PATHS = {
    "out-folder": ["afile", "afile/sub", "fifo", "/dev/null", "", "moe.csv", "notes.png/x", "/proc/1/x"],
    "out-file": ["afile", "afile/x.json", "fifo", "/dev/null", "", "folder", "no/such/p.json", "notes.png",
                 "data.csv", "moe.csv"],
    # a .png file or an existing folder (where it writes plan_timeline.png)
    "out-png": ["afile", "afile/x.png", "fifo", "/dev/null", "", "no/such/t.png", "notes.png", "x.jpg"],
    "in": ["missing.csv", "folder", "fifo", "/dev/null", "", "afile", "afile/x.csv", "empty.csv", "notes.png"],
}


def _key(words: tuple, flag: str, table: dict):
    for k in (f"{' '.join(words)} {flag}", flag):
        if k in table:
            return k
    return None


def _typed(action) -> bool:
    """A value checked by argparse itself: choices, or a `type=` that validates (not a bare `int`/`str`)."""
    return bool(action.choices) or (action.type not in (None, int, str, float))


def _flash(action, field: str):
    """The option's own type (its bounds), then the kernel's config (powers of two) where it applies."""
    from xstage.attention.flash import FlashConfig

    def check(v):
        n = action.type(v)
        if field != "block_m" or n:
            FlashConfig(**{field: n})

    return _refused(check)


# Options that only some bases of their subcommand read (the others do not reach them); default: every base.
ONLY_IN = {
    ("probe", "--out"): (1, 2), ("probe", "--only"): (0, 2),  # --plan lists configurations, writes nothing
    ("model", "--gap"): (0,), ("model", "--sms"): (0,), ("model", "--data"): (1,),  # each needs the other flag
}


def _cases():
    for words, parser in LEAVES.items():
        for action in _valued(parser):
            flag = _flag(action)
            bases = ONLY_IN.get((" ".join(words), flag), range(len(BASES[words])))
            for b in bases:
                if BASES[words][b].refusal == GPU and has_gpu():
                    continue  # there it would measure
                yield pytest.param(words, flag, b, id=f"{' '.join(words)} {flag} [{b}]")


CASES = list(_cases())


def test_every_subcommand_has_a_base():
    assert set(BASES) == set(LEAVES), f"give these subcommands a base command: {set(LEAVES) - set(BASES)}"


@pytest.mark.parametrize("words, b", [pytest.param(w, b, id=f"{' '.join(w)} [{b}]") for w, bases in BASES.items()
                                      for b, base in enumerate(bases)
                                      if not base.costly and not (base.refusal == GPU and has_gpu())])
def test_the_bases_run_or_refuse_as_declared(words, b):
    """A base command is valid (exit 0), or refused for the one reason it declares (no GPU here): the
    malformed value is then all that can make it refuse otherwise."""
    base = BASES[words][b]
    with tempfile.TemporaryDirectory() as tmp:
        _make(Path(tmp))
        outcome = run_cli(list(base.argv), cwd=tmp)
    if base.refusal is None:
        assert outcome.code == 0 and not outcome.raised, str(outcome)
    else:
        assert one_line_refusal(outcome) is None and base.refusal in outcome.err, str(outcome)


def test_every_option_has_a_grammar():
    grammars = _grammars()
    missing = []
    for words, parser in LEAVES.items():
        for action in _valued(parser):
            flag = _flag(action)
            if not (_typed(action) or _key(words, flag, grammars) or _key(words, flag, PATHS)):
                missing.append(f"{' '.join(words)} {flag}")
    assert not missing, f"give these options a value grammar or a validating type=: {missing}"


def _oracle(words: tuple, action):
    """(values, malformed(value) -> True / False / None for "either answer") of one option."""
    flag = _flag(action)
    grammars = _grammars()
    path = _key(words, flag, PATHS)
    if path:
        return st.sampled_from(BAD_PATHS[PATHS[path]]), lambda v: True
    g = _key(words, flag, grammars)
    if g:
        values, bad = grammars[g]
        if bad is None:  # the kernel's config is the judge
            bad = _flash(action, {"--block-m": "block_m", "--block-n": "block_n", "--num-warps": "num_warps",
                          "--num-stages": "num_stages"}[flag])
        if flag == "--only":
            return values, lambda v: True if bad(v) else None
        return values, bad
    if action.choices:
        return TEXT | st.sampled_from(NUMBER_WORDS), lambda v: v not in action.choices

    def typed_bad(v):
        try:
            action.type(v)
        except (argparse.ArgumentTypeError, ValueError, TypeError, InputError):
            return True
        return False

    numbers = st.sampled_from(NUMBER_WORDS) | st.integers(-(2**80), 2**80).map(str) | st.floats().map(repr)
    return numbers | TEXT, typed_bad


def _names(action, value: str) -> list[str]:
    names = [*action.option_strings, action.dest, action.dest.replace("_", "-")]
    if value.strip():
        names += [value.strip(), repr(value.strip())[1:-1]]
    return names


@pytest.mark.parametrize("words, flag, b", CASES)
@examples(12)
@given(data=st.data())
def test_a_malformed_option_value_is_one_line_and_status_2(words, flag, b, data):
    parser = LEAVES[words]
    action = next(a for a in _valued(parser) if _flag(a) == flag)
    base = BASES[words][b]
    values, malformed = _oracle(words, action)
    value = data.draw(values, label="value")
    verdict = malformed(value)
    assume(verdict is not False)
    argv = _with(base.argv, tuple(action.option_strings), value, _positional_index(words, parser, action))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _make(d)
        before = snapshot(d)
        outcome = run_cli(argv, cwd=d)
        after = snapshot(d)
    if verdict is None and (outcome.code == 0 and not outcome.raised or base.refusal and base.refusal in outcome.err):
        return  # a well-formed --only that selects something: the command runs, or says what the base says
    check_refused(outcome, before, after)
    line = outcome.err.strip()
    if base.refusal:
        assert base.refusal not in line, f"the malformed {flag} {value!r} was not seen before the GPU check:\n{outcome}"
    assert any(n in line for n in _names(action, value)), f"the line names neither {flag} nor its value:\n{outcome}"
