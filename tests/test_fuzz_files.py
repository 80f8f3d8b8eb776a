"""Property: every loader and every command that reads a file answers a malformed copy of a committed
file with one `InputError` line (API) or exit status 2 and one line (CLI), writes and changes nothing,
and never runs past the watchdog; a copy that may be harmless is either refused so or read, and then
no NaN or infinity takes the place of a number in what comes out.

The copies (`tests/mutations.py`) are drawn from small heads of the committed data: byte flips, cuts
and insertions; a cell set to NaN, inf, -1, 0, 1e308, text or nothing; columns repeated, dropped,
renamed or unnamed; rows too wide, too short, repeated or swapped; a byte-order mark, CRLF, UTF-16,
Latin-1, NUL bytes, compression, no rows, a file of another kind; for JSON, any leaf replaced, keys
deleted or renamed, another root, deep nesting and numbers past a float. The fixed cases of
`tests/loader_cases.py` and `tests/corrupt.py` stay as they are; this is the net under them.

CI replays a fixed set of examples (the `ci` profile of `tests/conftest.py`); to explore, run
    HYPOTHESIS_PROFILE=dev PYTHONPATH=src python -m pytest -p no:cacheprovider tests/test_fuzz_files.py
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xstage.errors import InputError

from .corrupt import (
    CORE_CSV,
    COSTS_JSON,
    MOE_CSV,
    PROBE_SUMMARY_CSV,
    PROFILE_JSON,
    REFERENCE_CSV,
    ROOT,
    ULYSSES_CSV,
    committed,
)
from .fuzzing import check_done_or_refused, check_refused, examples, run_cli, snapshot, watchdog
from .mutations import NOT_A_COUNT, NOT_A_NUMBER, NOT_A_TIME, CsvSpec, JsonSpec, Mutant, csv_mutants, json_mutants

# ---- the files: small valid heads of the committed data, and what in them is certainly refused --------

EMPTY_OK = ("", " ")  # an optional cell may be empty
MAYBE = tuple(v for v in NOT_A_TIME if v not in EMPTY_OK)  # refused in an optional time column
NOT_POSITIVE = (*[v for v in NOT_A_NUMBER if v not in EMPTY_OK], "-1", "0")
COUNTS = dict.fromkeys(("H", "I", "E", "K", "tokens", "ep"), NOT_A_COUNT)


def _moe_text() -> str:
    return committed(MOE_CSV, 4)


def _uly_text() -> str:
    lines = ULYSSES_CSV.read_text().splitlines(keepends=True)
    cells = [line.split(",") for line in lines]
    # one head count at 3072 tokens, every group size: enough for every fit, in 40 rows
    return lines[0] + "".join(line for line, c in zip(lines[1:], cells[1:]) if c[0] == "16" and c[2] == "3072")


def _reference_text() -> str:
    lines = REFERENCE_CSV.read_text().splitlines(keepends=True)
    return lines[0] + "".join([line for line in lines[1:] if line.startswith("host")][:16])


def _long_text() -> str:
    from .probe.synthetic import write_folder

    with tempfile.TemporaryDirectory() as d:
        write_folder(Path(d), ["first"], sm_count=2, repeats=1)
        return (Path(d) / "raw" / "first.csv").read_text()


MOE_STRICT = {**COUNTS, "ctas": NOT_A_COUNT, "time_ns": NOT_A_TIME,
              "variant": ("", "wave_of_doom", "lag:x", "lag:4@fast", "expert_wave@", "lag:-1"),
              "path": ("", "nvlink", "HOST"), "shape": EMPTY_OK,
              "block": ("", "128x128", "axbxcxd", "0x128x256x64", "128x128x256x64x1", "-128x128x256x64"),
              **dict.fromkeys(("time_p10_ns", "time_p90_ns", "reduce_ns"), MAYBE),
              **dict.fromkeys(("tflops", "speedup"), NOT_POSITIVE),
              "max_err": ("abc", "--1", "0x10", "∞", "1e", "True")}
ULY_STRICT = {**dict.fromkeys(("heads", "dim", "tokens", "P", "grid"), NOT_A_COUNT), "time_ns": NOT_A_TIME,
              "variant": ("", "attention:flash", "serial:tpu", "stores:paced:0", "overlap:cudnn:x"),
              **dict.fromkeys(("p10_ns", "p90_ns"), MAYBE), "tflops": NOT_POSITIVE,
              **dict.fromkeys(("block_m", "block_n"), tuple(v for v in NOT_A_COUNT if v not in EMPTY_OK))}
SUMMARY_STRICT = {**dict.fromkeys(("n_sm", "burst_bytes", "n_bursts"), NOT_A_COUNT),
                  "issue_median_ns": NOT_A_TIME, "gap_ns": (*NOT_A_NUMBER, "-1"), "path": ("", "nvlink", "HOST"),
                  **dict.fromkeys(("burst_index", "launch"), ("abc", "", "nan", "inf", "1.5")),
                  **dict.fromkeys(("issue_p10_ns", "issue_p90_ns", "issue_max_ns"), ("abc", "inf", "-1", "0")),
                  "completion_median_ns": ("abc", "inf", "-1")}

MOE = CsvSpec("moe.csv", _moe_text(), frozenset(("shape", "H", "I", "E", "K", "tokens", "ep", "path", "variant",
                                                  "time_ns", "block", "ctas")), MOE_STRICT)
MOE_SUMMARY = CsvSpec("moe.csv", MOE.text, MOE.required | {"reduce_ns", "tflops"},
                      {**MOE_STRICT, "tflops": (*NOT_POSITIVE, *EMPTY_OK)})
ULY = CsvSpec("ulysses.csv", _uly_text(), frozenset(("heads", "dim", "tokens", "P", "variant", "grid", "time_ns")),
              ULY_STRICT)
ULY_GRID = CsvSpec("ulysses.csv", ULY.text, ULY.required | {"path"}, ULY_STRICT)
CORE = CsvSpec("core.csv", committed(CORE_CSV, 4), frozenset(("tokens", "heads", "dim", "layout", "impl", "time_ns",
                                                                "tflops")),
               {**dict.fromkeys(("tokens", "heads", "dim"), NOT_A_COUNT), "time_ns": NOT_A_TIME,
                "tflops": NOT_POSITIVE, **dict.fromkeys(("block_m", "block_n", "num_warps", "num_stages"), NOT_A_COUNT),
                "tma": ("2", "-1", "abc", "", "0.5")},
               loose_rows=frozenset({1}))  # row 1 is cuDNN's: no Triton configuration to check
REFERENCE = CsvSpec("reference.csv", _reference_text(),
                    frozenset(("dst", "nblocks", "burst_bytes", "gap_iters", "issue_first", "issue_2",
                               "issue_steady", "issue_max", "gap_cycles")),
                    {**dict.fromkeys(("nblocks", "burst_bytes"), NOT_A_COUNT),
                     **dict.fromkeys(("issue_first", "issue_2", "issue_steady"), NOT_A_TIME),
                     "gap_cycles": (*NOT_A_NUMBER, "-1"), "dst": ("", "peer", "nvlink", "HOST")})
PROBE_SUMMARY = CsvSpec("summary.csv", committed(PROBE_SUMMARY_CSV, 40),
                        frozenset(("path", "n_sm", "burst_bytes", "gap_ns", "launch", "n_bursts", "burst_index",
                                   "issue_median_ns")), SUMMARY_STRICT)
PROBE_SUMMARY_FILE = CsvSpec("summary.csv", PROBE_SUMMARY.text,
                             PROBE_SUMMARY.required | {"sweep", "peer_mode", "ctas_per_sm", "warps", "vector_bytes",
                                                       "gap_iters", "burst_last", "n_cta", "issue_p10_ns",
                                                       "issue_p90_ns", "issue_max_ns", "completion_median_ns"},
                             {**SUMMARY_STRICT, **dict.fromkeys(("warps", "vector_bytes"), NOT_A_COUNT),
                              "peer_mode": ("", "some", "NONE")})
LONG = CsvSpec("first.csv", _long_text(),
               frozenset(("path", "peer_mode", "n_sm", "ctas_per_sm", "warps", "vector_bytes", "burst_bytes",
                          "gap_iters", "gap_ns", "launch", "cta", "burst_index", "issue_ns", "completion_ns", "gpu",
                          "driver", "torch", "triton", "git_commit", "date")),
               {**dict.fromkeys(("n_sm", "ctas_per_sm", "warps", "vector_bytes", "burst_bytes"), NOT_A_COUNT),
                "issue_ns": NOT_A_TIME, "path": ("", "nvlink"), "peer_mode": ("", "some"),
                **dict.fromkeys(("cta", "burst_index", "gap_iters"), ("abc", "", "nan", "inf", "-1", "1.5"))})

PARAM_NUMBERS = tuple(("params", k) for k in ("r0", "drain", "c_sm", "capacity", "spread"))
PROFILE = JsonSpec("profile.json", json.loads(PROFILE_JSON.read_text()),
                   required=(("format",), ("path",), ("params",), *PARAM_NUMBERS[:4]), numbers=PARAM_NUMBERS)


def _costs_doc() -> dict:
    d = json.loads(COSTS_JSON.read_text())
    return {**d, "table": d["table"][:6]}


COSTS = JsonSpec("costs.json", _costs_doc(), required=(("kernel",), ("kinds",), ("kinds", "*", "rate"),
                                                          ("kinds", "*", "overhead_ns")),
                 numbers=(("kinds", "*", "rate"), ("table", "*", "median_ns"), ("table", "*", "rows_per_expert")))
ATTENTION_COSTS = JsonSpec("attention-costs.json", json.loads((ROOT / "src/xstage/data/h200-attention-task-costs.json")
                                                              .read_text()),
                           required=COSTS.required, numbers=(("kinds", "*", "rate"),))
RUN = JsonSpec("run.json", {"path": "host", "sweeps": ["first"], "only": [], "sm_count": 132, "world": 1,
                            "env": {"gpu": "NVIDIA H200", "git_commit": "ce78205", "date": "2026-11-29"},
                            "configs_run": 15, "configs_skipped": 0, "timing": "none"}, nonfinite=True, typed=False)

CSV_TEXTS = {"moe": MOE.text, "ulysses": ULY.text, "core": CORE.text, "reference": REFERENCE.text,
             "summary": PROBE_SUMMARY.text, "long": LONG.text, "profile": PROFILE_JSON.read_text()}


def others(*accepted: str) -> list[str]:
    """Files of the other kinds (a loader reading several kinds lists those it accepts)."""
    return [t for k, t in CSV_TEXTS.items() if k not in accepted]


def mutants(spec, *accepted: str):
    if isinstance(spec, CsvSpec):
        return csv_mutants(spec, others(*accepted))
    return json_mutants(spec, [t for t in others(*accepted) if not _same_json(t, spec.doc)])


def _same_json(text: str, doc) -> bool:
    try:
        return json.loads(text) == doc
    except ValueError:
        return False


# ---- the API loaders ---------------------------------------------------------------------------------

def _finite_obs(obs) -> None:
    assert len(obs) > 0
    for name in ("n_sm", "burst_bytes", "issue_med", "gap_ns", "n_bursts"):
        values = getattr(obs, name)
        assert all(math.isfinite(v) and v >= 0 for v in values), f"{name}: {values}"
    assert all(v > 0 for v in obs.issue_med)


def _load_results(kind):
    def load(p):
        from xstage.sched.measured import load_results

        return load_results(p, kind=kind)

    return load


def _read_moe_csv(p):
    from xstage.bench.moe_summary import read_moe_csv

    return read_moe_csv(p)


def _read_grid(p):
    from xstage.bench.ulysses_report import read_grid

    return read_grid(p)


def _tuned(p):
    from xstage.bench.ulysses import tuned_configs
    from xstage.bench.ulysses_report import read_core

    read_core(p)
    return tuned_configs(p)


def _attention_costs(p):
    from xstage.sched.measured import load_results
    from xstage.sched.ulysses import attention_costs

    res = load_results(p, kind="ulysses")
    costs = attention_costs(res.rows, source=str(res.path), lines=res.lines)
    assert all(math.isfinite(c.overhead_ns) and c.rate > 0 for c in costs.kinds.values())


def _exchange_costs(p):
    from xstage.calibrate.exchange import fit_exchange_costs
    from xstage.model import load_default_profile
    from xstage.sched.exchange import plan_exchange
    from xstage.sched.measured import load_results

    res = load_results(p, kind="ulysses")
    costs = fit_exchange_costs(res.rows, drain=load_default_profile("host").params.drain, source=str(res.path))
    for plan in plan_exchange(24, 128, 4096, 4, costs, ["serial:cudnn", "overlap:cudnn:3"]):
        assert math.isfinite(plan.time_ns) and plan.time_ns > 0, plan


def _observations(p):
    from xstage.model.data import read_observations

    _finite_obs(read_observations(p))


def _reference(p):
    from xstage.model.data import load_reference_data

    _finite_obs(load_reference_data(p))


def _read_summary(p):
    from xstage.probe.analysis import read_summary

    rows = read_summary(p)
    assert all(math.isfinite(r["issue_median_ns"]) and r["issue_median_ns"] > 0 for r in rows)


def _probe_dir(p):
    from xstage.probe.report import load_probe_dir

    return load_probe_dir(next(a for a in p.parents if a.name == "grid"))


def _profile(p):
    from xstage.model.closed_form import issue_time
    from xstage.model.profile import Profile

    prof = Profile.load(p)
    t = issue_time(prof.params, 65536)
    assert math.isfinite(t) and t > 0, t


def _costs(kernel: str):
    def load(p):
        from xstage.sched.costs import TaskCosts

        costs = TaskCosts.load(p)
        for key, c in costs.kinds.items():
            assert math.isfinite(c.rate) and c.rate > 0 and math.isfinite(c.overhead_ns), (key, c)
        if kernel == "moe" and costs.kernel == "moe":
            # what the planner asks of MoE costs: a tile's time for a shape, block and row count
            for kind in ("dispatch", "linear1", "linear2"):
                t = costs.tile_ns(kind, "128x128x256x64", "H4096-I2048-E256-K6", 24.0, 1e6)
                assert math.isfinite(t) and t > 0, (kind, t)
        return costs

    return load


@dataclass(frozen=True)
class Loader:
    id: str
    spec: object
    load: Callable
    layout: str  # where the file goes in the example's folder (its name may matter)
    accepted: tuple = ()  # kinds of `CSV_TEXTS` the loader also reads
    extra: dict = field(default_factory=dict)  # other valid files of the folder


SUMMARY_FOR_RUN = {"grid/summary.csv": PROBE_SUMMARY_FILE.text}
LOADERS = [
    Loader("load_results", MOE, _load_results(None), "moe.csv", ("moe", "ulysses")),
    Loader("load_results-moe", MOE, _load_results("moe"), "moe.csv", ("moe",)),
    Loader("read_moe_csv", MOE_SUMMARY, _read_moe_csv, "moe.csv", ("moe",)),
    Loader("load_results-ulysses", ULY, _load_results("ulysses"), "ulysses.csv", ("ulysses",)),
    Loader("read_grid", ULY_GRID, _read_grid, "ulysses.csv", ("ulysses",)),
    Loader("attention_costs", ULY, _attention_costs, "ulysses.csv", ("ulysses",)),
    Loader("fit_exchange_costs", ULY, _exchange_costs, "ulysses.csv", ("ulysses",)),
    Loader("read_core-tuned_configs", CORE, _tuned, "core.csv", ("core",)),
    Loader("read_observations-reference", REFERENCE, _observations, "data.csv", ("reference", "summary", "long")),
    Loader("load_reference_data", REFERENCE, _reference, "data.csv", ("reference", "summary", "long")),
    Loader("read_observations-summary", PROBE_SUMMARY, _observations, "data.csv", ("reference", "summary", "long")),
    Loader("read_observations-long", LONG, _observations, "data.csv", ("reference", "summary", "long")),
    Loader("read_summary", PROBE_SUMMARY_FILE, _read_summary, "summary.csv", ("summary",)),
    Loader("load_probe_dir-summary", PROBE_SUMMARY_FILE, _probe_dir, "grid/summary.csv",
           ("summary",)),
    Loader("load_probe_dir-raw", LONG, _probe_dir, "grid/raw/first.csv", ("long",)),
    Loader("load_probe_dir-run", RUN, _probe_dir, "grid/run.json", extra=SUMMARY_FOR_RUN),
    Loader("Profile.load", PROFILE, _profile, "profile.json"),
    Loader("TaskCosts.load-moe", COSTS, _costs("moe"), "costs.json"),
    Loader("TaskCosts.load-attention", ATTENTION_COSTS, _costs("attention"), "costs.json"),
]


def _place(d: Path, layout: str, data: bytes, extra: dict) -> Path:
    for rel, text in extra.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    p = d / layout
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def _text_of(spec) -> bytes:
    return spec.text.encode() if isinstance(spec, CsvSpec) else (json.dumps(spec.doc, indent=1) + "\n").encode()


@pytest.mark.parametrize("loader", LOADERS, ids=lambda x: x.id)
def test_the_committed_heads_load(loader, tmp_path):
    """The unmutated files are valid: what the property refuses is the mutation, not the base."""
    loader.load(_place(tmp_path, loader.layout, _text_of(loader.spec), loader.extra))


@pytest.mark.parametrize("loader", LOADERS, ids=lambda x: x.id)
@examples(40)
@given(data=st.data())
def test_every_loader_reads_or_refuses_in_one_line(loader, data):
    mutant: Mutant = data.draw(mutants(loader.spec, *loader.accepted), label="mutant")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        p = _place(d, loader.layout, mutant.data, loader.extra)
        before = snapshot(d)
        try:
            with watchdog(f"{loader.id} on {mutant.what}"):
                loader.load(p)
        except InputError as exc:
            text = str(exc)
            assert text and "\n" not in text and "Traceback" not in text, f"{mutant.what}: {text!r}"
        else:
            assert not mutant.strict, f"{loader.id} read a malformed file: {mutant.what}"
        assert snapshot(d) == before, f"{loader.id} changed its folder reading {mutant.what}"


# ---- the commands that read a file -------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    id: str
    spec: object
    layout: str
    argv: Callable  # folder -> the command line, reading the file at `layout`
    accepted: tuple = ()
    extra: dict = field(default_factory=dict)  # other valid files the command reads or needs
    # keys of its JSON where null (NaN) or "inf" is an answer, not garbage: e.g. a drain fitted to fewer
    # than two points, a parameter the data do not identify
    undetermined: tuple = ()
    costly: bool = False  # a harmless input runs a fit, simulations or plots: fewer examples in CI


def _p(d: Path, rel: str) -> str:
    return str(d / rel)


PLAN_MOE = ["plan", "moe", "--shape", "H512-I256-E16-K2", "--tokens", "64", "--ep", "4", "--candidates",
            "expert_wave,lag:4", "--pacing", "default", "--json"]
PLAN_ULYSSES = ["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "4096", "--ranks", "4", "--json"]
FIT = ["--bootstrap", "0", "--structure", "base", "--json"]
DATA = ("reference", "summary", "long")
FITTED = ("rel_se",)  # inf: a parameter the data do not identify
PROBED = ("drain_Bps", "latency_ns")  # null: a completion line through fewer than two points
COMMANDS = [
    Command("plan-validate-moe", MOE, "moe.csv", lambda d: ["plan", "validate", _p(d, "moe.csv"), "-o", _p(d, "v"),
                                                            "--json"], ("moe", "ulysses"), costly=True),
    Command("plan-validate-ulysses", ULY, "ulysses.csv", lambda d: ["plan", "validate", _p(d, "ulysses.csv"), "-o",
                                                                    _p(d, "v"), "--json"], ("moe", "ulysses")),
    Command("plan-validate-profile", PROFILE, "profile.json", lambda d: [
        "plan", "validate", _p(d, "moe.csv"), "-o", _p(d, "v"), "--profile", _p(d, "profile.json"), "--json"],
        extra={"moe.csv": MOE.text}, costly=True),
    Command("plan-validate-costs", COSTS, "costs.json", lambda d: [
        "plan", "validate", _p(d, "moe.csv"), "-o", _p(d, "v"), "--costs", _p(d, "costs.json"), "--json"],
        extra={"moe.csv": MOE.text}, costly=True),
    Command("plan-validate-calibration", ULY, "cal.csv", lambda d: [
        "plan", "validate", _p(d, "ulysses.csv"), "-o", _p(d, "v"), "--calibration", _p(d, "cal.csv"), "--json"],
        ("ulysses",), {"ulysses.csv": ULY.text}, costly=True),
    Command("plan-attention-costs", ULY, "ulysses.csv", lambda d: [
        "plan", "attention-costs", _p(d, "ulysses.csv"), "-o", _p(d, "a"), "--json"], ("ulysses",)),
    Command("plan-ulysses-calibration", ULY, "cal.csv", lambda d: [*PLAN_ULYSSES, "--calibration", _p(d, "cal.csv")],
            ("ulysses",), costly=True),
    Command("plan-moe-profile", PROFILE, "profile.json", lambda d: [*PLAN_MOE, "--profile", _p(d, "profile.json")]),
    Command("plan-moe-costs", COSTS, "costs.json", lambda d: [*PLAN_MOE, "--costs", _p(d, "costs.json")]),
    Command("model-profile", PROFILE, "profile.json", lambda d: [
        "model", "--profile", _p(d, "profile.json"), "--burst", "64KiB", "--gap", "2us", "--sms", "8", "--json"],
        undetermined=("profile",)),  # the profile as read: a null the file holds is echoed, not computed
    Command("model-data-reference", REFERENCE, "data.csv", lambda d: [
        "model", "--plot", _p(d, "plots"), "--data", _p(d, "data.csv"), "--json"], DATA, costly=True),
    Command("model-data-summary", PROBE_SUMMARY, "data.csv", lambda d: [
        "model", "--plot", _p(d, "plots"), "--data", _p(d, "data.csv"), "--json"], DATA, costly=True),
    Command("fit-reference", REFERENCE, "data.csv", lambda d: ["fit", _p(d, "data.csv"), "-o", _p(d, "p.json"), *FIT],
            DATA, undetermined=FITTED, costly=True),
    Command("fit-long", LONG, "data.csv", lambda d: ["fit", _p(d, "data.csv"), "-o", _p(d, "p.json"), *FIT], DATA,
            undetermined=FITTED, costly=True),
    Command("bench-moe-summarize", MOE_SUMMARY, "grid/moe.csv", lambda d: [
        "bench", "moe", "-o", _p(d, "grid"), "--summarize-only", "--json"], ("moe",), costly=True),
    Command("bench-ulysses-summarize", ULY_GRID, "grid/ulysses.csv", lambda d: [
        "bench", "ulysses", "-o", _p(d, "grid"), "--summarize-only", "--json"], ("ulysses",)),
    Command("bench-ulysses-summarize-core", CORE, "grid/core.csv", lambda d: [
        "bench", "ulysses", "-o", _p(d, "grid"), "--summarize-only", "--json"], ("core",)),
    Command("bench-ulysses-tuned-from", CORE, "core.csv", lambda d: [
        "bench", "ulysses", "-o", _p(d, "grid"), "--summarize-only", "--tuned-from", _p(d, "core.csv"), "--json"],
        ("core",), {"grid/ulysses.csv": ULY.text}),
    Command("probe-analyse-summary", PROBE_SUMMARY_FILE, "grid/summary.csv", lambda d: [
        "probe", "--analyse-only", "--no-fit", "-o", _p(d, "grid"), "--json"], ("summary",), undetermined=PROBED,
        costly=True),
    Command("probe-analyse-raw", LONG, "grid/raw/first.csv", lambda d: [
        "probe", "--analyse-only", "--no-fit", "-o", _p(d, "grid"), "--json"], ("long",), undetermined=PROBED,
        costly=True),
    Command("probe-analyse-run", RUN, "grid/run.json", lambda d: [
        "probe", "--analyse-only", "--no-fit", "-o", _p(d, "grid"), "--json"], extra=SUMMARY_FOR_RUN,
        undetermined=PROBED, costly=True),
]


def _run_command(cmd: Command, data: bytes):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _place(d, cmd.layout, data, cmd.extra)
        before = snapshot(d)
        outcome = run_cli(cmd.argv(d))
        return outcome, before, snapshot(d)


@functools.cache
def _baseline(cmd_id: str):
    """The command's JSON on the unmutated files (it must succeed: the base is valid)."""
    cmd = next(c for c in COMMANDS if c.id == cmd_id)
    outcome, _, _ = _run_command(cmd, _text_of(cmd.spec))
    assert outcome.code == 0 and not outcome.raised, str(outcome)
    return json.loads(outcome.out)


def _property(cmd: Command, data) -> None:
    baseline = _baseline(cmd.id)
    mutant: Mutant = data.draw(mutants(cmd.spec, *cmd.accepted), label="mutant")
    outcome, before, after = _run_command(cmd, mutant.data)
    if mutant.strict:
        check_refused(outcome, before, after)
    else:
        check_done_or_refused(outcome, before, after, [cmd.layout, *cmd.extra], baseline, cmd.undetermined)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if not c.costly], ids=lambda c: c.id)
@examples(40)
@given(data=st.data())
def test_every_command_reading_a_file_is_done_or_refuses_in_one_line(cmd, data):
    _property(cmd, data)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.costly], ids=lambda c: c.id)
@examples(10)
@given(data=st.data())
def test_every_command_that_fits_simulates_or_plots_is_done_or_refuses_in_one_line(cmd, data):
    _property(cmd, data)
