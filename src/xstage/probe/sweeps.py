"""Named sweeps: which configurations each experiment runs (burst size and issuing SMs vary
independently in each).

| sweep      | what it measures                                              | bursts | completion |
|------------|---------------------------------------------------------------|--------|------------|
| first      | first-burst issue time vs burst bytes x issuing SMs           | 1      | none       |
| periodic   | bursts every gap: onset burst index and steady issue time     | 16     | none       |
| twoburst   | second-burst issue time vs gap (the slope -1 check)            | 2      | none       |
| completion | remote-visible completion vs bytes (drain rate and latency)   | 1      | fence      |
| knobs      | warps, store width and CTAs per SM at fixed bytes             | 1      | none       |
| peers      | one peer vs all peers (path `peer` only)                      | 1, 16  | none       |
| irregular  | a train per CTA (`xstage.probe.trains`), recorded as a trace   | 1-24   | none       |

`irregular` (paths `hbm` and `host`) is not part of `all`: it writes `traces/irregular.csv`, which the
regular analysis does not read, and is scored instead (`xstage model score`).

`plan(names, path, sm_count)` lists `(sweep, BurstConfig)` pairs; `--only` filters them on any
`BurstConfig` field. SM counts are clipped to the GPU's (`sm_count`), so the same sweep runs on any
GPU; the largest count is always the whole GPU.
"""

from __future__ import annotations

from xstage.bounds import MAX_SMS, check_int
from xstage.errors import InputError
from xstage.probe.runner import BurstConfig
from xstage.probe.trains import TRAIN_PATHS

KIB = 1024
MIB = 1024 * 1024
SWEEPS = ("first", "periodic", "twoburst", "completion", "knobs", "peers")
PATH_SWEEPS = {
    "hbm": ("first", "periodic", "twoburst", "completion", "knobs"),
    "host": ("first", "periodic", "twoburst", "completion", "knobs"),
    "peer": ("first", "periodic", "twoburst", "completion", "peers"),
}
IRREGULAR = "irregular"
REPEATS = {"first": 3, "periodic": 2, "twoburst": 3, "completion": 3, "knobs": 3, "peers": 3}


def _sms(counts, sm_count: int) -> list[int]:
    return sorted({min(c, sm_count) for c in counts} | {sm_count})


def _first(path, sm_count, mode):
    sizes = [4 * KIB * 2**i for i in range(10)]                           # 4 KiB .. 2 MiB
    return [BurstConfig(path=path, peer_mode=mode, n_sm=n, burst_bytes=b)
            for n in _sms([1, 2, 4, 8, 16, 32, 64], sm_count) for b in sizes]


def _periodic(path, sm_count, mode):
    return [BurstConfig(path=path, peer_mode=mode, n_sm=n, burst_bytes=b, gap_iters=g, n_bursts=16)
            for n in _sms([8, 32], sm_count) for b in (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB)
            for g in (0, 1000, 4000, 10000, 25000, 100000)]


def _twoburst(path, sm_count, mode):
    gaps = (0, 500, 1000, 2000, 3000, 4000, 6000, 8000, 12000, 16000, 24000, 32000, 48000, 64000, 100000)
    return [BurstConfig(path=path, peer_mode=mode, n_sm=n, burst_bytes=b, gap_iters=g, n_bursts=2)
            for n in _sms([32], sm_count) for b in (64 * KIB, 256 * KIB) for g in gaps]


def _completion(path, sm_count, mode):
    return [BurstConfig(path=path, peer_mode=mode, n_sm=n, burst_bytes=b, completion="fence")
            for n in _sms([1, 8, 32], sm_count) for b in (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB)]


def _knobs(path, sm_count, mode):
    variants = [(4, 16, 1), (16, 16, 1), (8, 8, 1), (8, 4, 1)]
    cfgs = [BurstConfig(path=path, peer_mode=mode, n_sm=n, warps=w, vector_bytes=v, ctas_per_sm=c,
                        burst_bytes=b)
            for n in _sms([8], sm_count) for b in (16 * KIB, 256 * KIB) for w, v, c in variants]
    # Several CTAs per SM only on the whole GPU: a smaller grid would spread them over more SMs.
    cfgs += [BurstConfig(path=path, peer_mode=mode, n_sm=sm_count, ctas_per_sm=2, burst_bytes=b)
             for b in (16 * KIB, 256 * KIB)]
    return cfgs


def _peers(path, sm_count, mode):
    return [BurstConfig(path=path, peer_mode=m, n_sm=n, burst_bytes=b, n_bursts=nb)
            for m in (mode, "all") for n in _sms([8, 32], sm_count) for b in (64 * KIB, 256 * KIB)
            for nb in (1, 16)]


_PLANNERS = {"first": _first, "periodic": _periodic, "twoburst": _twoburst, "completion": _completion,
             "knobs": _knobs, "peers": _peers}


def parse_sweeps(spec: str, path: str) -> list[str]:
    """`all` or a comma list of sweep names -> the sweeps that apply to `path`."""
    if not isinstance(spec, str):
        raise InputError(f"--sweep {spec!r}: expected a string, 'all' or names from {list(SWEEPS)}")
    if not isinstance(path, str) or path not in PATH_SWEEPS:
        raise InputError(f"--path {path!r}: must be one of {sorted(PATH_SWEEPS)}")
    names = list(PATH_SWEEPS[path]) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in (*SWEEPS, IRREGULAR)]
    if bad or not names:
        raise InputError(f"--sweep {spec!r}: must be 'all' or names from {[*SWEEPS, IRREGULAR]}")
    has = [*PATH_SWEEPS[path], *([IRREGULAR] if path in TRAIN_PATHS else [])]
    wrong = [s for s in names if s not in has]
    if wrong:
        raise InputError(f"--sweep {wrong}: not available on path {path} (has {has})")
    return names


def plan(names, path: str, sm_count: int) -> list[tuple[str, BurstConfig]]:
    """The configurations of sweeps `names` on `path` for a GPU of `sm_count` SMs, validated."""
    sm_count = check_int(sm_count, "sm_count", 1, MAX_SMS, "SMs of the GPU to plan for")
    out = []
    for name in names:
        if name == IRREGULAR:  # trains, not configurations: `xstage.probe.trains.plan_trains`
            continue
        if name not in _PLANNERS:
            raise InputError(f"sweep {name!r}: must be one of {list(SWEEPS)}")
        mode = "one" if path == "peer" else "none"
        out += [(name, cfg.validate(sm_count)) for cfg in _PLANNERS[name](path, sm_count, mode)]
    return out
