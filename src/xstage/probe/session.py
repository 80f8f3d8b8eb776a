"""Run sweeps into an output folder: resumable, sliceable, one long-format CSV per sweep.

Layout of `out_dir`:

    raw/<sweep>.csv    long format (`xstage.model.data.LONG_COLUMNS`), one row per CTA per burst
    raw/<sweep>.done   one line per finished configuration: its label and its launch ids
    run.json           environment, SM ids used, the cycles-to-ns ratio, and what was run

A configuration whose label is in the `.done` file is skipped, so an interrupted run continues
where it stopped; `only` (`--only key=v1,v2`, any `BurstConfig` field or `sweep`) runs a slice.
Each configuration runs one untimed warm-up launch (compilation, first touch of host pages), then
`repeats` recorded launches whose rows are written together. Launch ids are unique in the folder.

On path `peer` every rank runs the same plan in step (a barrier before each launch); rank 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from xstage.comm import create_context
from xstage.env import environment
from xstage.errors import InputError
from xstage.model.data import LONG_COLUMNS
from xstage.probe.runner import BurstConfig, dest_elems, launch, rows_from_launch
from xstage.probe.sweeps import IRREGULAR, REPEATS, plan
from xstage.probe.trains import TRACE_FILE, TRACE_ROW_COLUMNS, launch_train, plan_trains, trace_rows
from xstage.results.io import ResultWriter, read_text
from xstage.results.output import write_text
from xstage.results.progress import Progress
from xstage.results.select import select

LOOPBACK_WORLD = 2


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def read_done(path: Path) -> dict[str, list[int]]:
    """A progress record (`raw/<sweep>.done`, `traces/irregular.done`): label -> its launch ids."""
    if not path.exists() and not path.is_symlink():
        return {}
    out = {}
    for n, line in enumerate(read_text(path, "probe progress record").splitlines(), start=1):
        label, _, ids = line.partition(" ")
        if label:
            try:
                out[label] = [int(i) for i in ids.split(",") if i]
            except ValueError:
                raise InputError(f"probe progress record {path}, line {n}: expected a configuration label and "
                                 f"comma-separated launch ids, got {line[:80]!r}") from None
    return out


def _next_launch(raw_dir: Path) -> int:
    ids = [i for f in raw_dir.glob("*.done") for v in read_done(f).values() for i in v]
    for f in raw_dir.glob("*.csv"):
        with f.open("rb") as fh:
            fh.seek(max(0, f.stat().st_size - 4096))
            tail = fh.read().decode(errors="replace").splitlines()
        for line in reversed(tail[1:] if len(tail) > 1 else []):
            parts = line.split(",")
            if len(parts) == len(LONG_COLUMNS):
                try:
                    ids.append(int(parts[LONG_COLUMNS.index("launch")]))
                    break
                except ValueError:
                    continue
    return max(ids, default=-1) + 1


def measure(out_dir, path: str, sweeps: list[str], *, only=None, repeats: int | None = None,
            progress: bool = True, group=None, allow_interpreter: bool = False) -> dict:
    """Run `sweeps` on `path` into `out_dir` (`irregular`: the trains of `xstage.probe.trains`, into
    `traces/`); returns what `run.json` records.

    `allow_interpreter` lets the plumbing run in the CPU interpreter (tests): the kernels then write
    their bytes but every timer reads 0, so the rows are not measurements."""
    out_dir = Path(out_dir)
    if path == "peer":
        ctx = create_context(group, path="peer")
    else:
        ctx = create_context(path=path, loopback_world=LOOPBACK_WORLD, rank=0)
    with ctx:
        if ctx.device.type != "cuda" and not allow_interpreter:
            raise InputError("measuring needs a CUDA GPU (in the CPU interpreter every timer reads 0)")
        sm_count = _sm_count(ctx.device)
        env = dict(environment())
        regular = [s for s in sweeps if s != IRREGULAR]
        info = _measure_sweeps(ctx, out_dir, path, regular, sm_count, env, only, repeats, progress) if regular else {
            "path": path, "sweeps": sweeps, "sm_count": sm_count, "world": ctx.world, "env": env}
        if IRREGULAR in sweeps:
            info["sweeps"] = sweeps
            info["irregular"] = measure_trains(ctx, out_dir, path, sm_count, env, repeats=repeats, progress=progress)
        if ctx.rank == 0 and (info.get("configs_run") or info.get("irregular", {}).get("trains_run")):
            write_text(out_dir / "run.json", json.dumps(info, indent=2, default=str))
        return info


def _measure_sweeps(ctx, out_dir: Path, path: str, sweeps: list[str], sm_count: int, env: dict, only, repeats,
                    progress: bool) -> dict:
    """The regular sweeps of `measure`: one long-format CSV per sweep under `raw/`."""
    raw_dir = out_dir / "raw"
    planned = plan(sweeps, path, sm_count)
    keyed = [{"sweep": s, **c.fields()} for s, c in planned]
    chosen = select(keyed, only)
    chosen_cfgs = [(d["sweep"], BurstConfig(**{k: v for k, v in d.items() if k != "sweep"})) for d in chosen]
    writer_rank = ctx.rank == 0
    raw_dir.mkdir(parents=True, exist_ok=True)
    done = {s: read_done(raw_dir / f"{s}.done") for s in sweeps}
    todo = [(s, c) for s, c in chosen_cfgs if c.label() not in done[s]]
    next_id = _next_launch(raw_dir)
    if ctx.world > 1 and path == "peer":

        # Rank 0's folder decides what is left to run, so that every rank launches in step.
        agreed = [next_id, [(s, c.label()) for s, c in todo]]
        dist.broadcast_object_list(agreed, src=dist.get_global_rank(ctx.group, 0), group=ctx.group)
        next_id, labels = agreed
        by_key = {(s, c.label()): (s, c) for s, c in chosen_cfgs}
        todo = [by_key[tuple(k)] for k in labels]
    info = {"path": path, "sweeps": sweeps, "only": only or [], "sm_count": sm_count, "world": ctx.world,
            "env": env, "configs_run": 0, "configs_skipped": len(chosen) - len(todo),
            "sm_ids_used": {}, "ns_per_cycle_median": None}
    if path == "peer":
        shared = ctx.world > torch.cuda.device_count()
        info["timing"] = "not a timing (ranks share a GPU)" if shared else "timing"
    if not todo:
        return info
    elems = max(dest_elems(c, ctx.world) for _, c in todo)
    dest = ctx.alloc("probe_dst", (elems,), torch.int32)
    writers: dict[str, ResultWriter] = {}
    ratios = []
    with Progress(len(todo), "probe: configurations measured", quiet=not (progress and writer_rank)) as bar:
        for sweep, cfg in todo:
            ctx.barrier()
            launch(ctx, dest, cfg)
            rows, ids = [], []
            for _ in range(repeats or REPEATS[sweep]):
                ctx.barrier()
                raw = launch(ctx, dest, cfg)
                rows += rows_from_launch(cfg, raw, next_id)
                ids.append(next_id)
                next_id += 1
                ratios.append(float(np.median(raw.ns_per_cycle())))
                info["sm_ids_used"][cfg.label()] = len(raw.sm_ids())
            ctx.check()
            if writer_rank:
                if sweep not in writers:
                    writers[sweep] = ResultWriter(raw_dir / f"{sweep}.csv", LONG_COLUMNS,
                                                  ["launch", "cta", "burst_index"], env=env, require_commit=True)
                writers[sweep].write_many(rows)
                with (raw_dir / f"{sweep}.done").open("a") as f:
                    f.write(f"{cfg.label()} {','.join(map(str, ids))}\n")
            info["configs_run"] += 1
            bar.advance()
    info["ns_per_cycle_median"] = float(np.median(ratios))
    return info


TRAIN_REPEATS = 2  # recorded launches per train


def measure_trains(ctx, out_dir, path: str, sm_count: int, env: dict, *, repeats: int | None = None,
                   progress: bool = True) -> dict:
    """Run every train of `plan_trains(path, sm_count)` not yet recorded in `out_dir/traces/` (one
    untimed launch, then `repeats` recorded ones each) and append its rows; resumable like the
    sweeps (`irregular.done` lists finished trains). Returns {"trains_run", "trains_skipped"}."""
    csv_path = Path(out_dir) / TRACE_FILE
    done_path = csv_path.with_suffix(".done")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    trains = plan_trains(path, sm_count)
    done = read_done(done_path)
    todo = [t for t in trains if t.label() not in done]
    info = {"trains_run": 0, "trains_skipped": len(trains) - len(todo)}
    if not todo:
        return info
    writer = ResultWriter(csv_path, TRACE_ROW_COLUMNS, ["launch", "cta", "burst_index"], env=env, require_commit=True)
    next_id = 1 + max((int(r["launch"]) for r in writer.rows()), default=-1)
    dest = ctx.alloc("probe_trains", (max(t.dest_elems(ctx.world) for t in todo),), torch.int32)
    with Progress(len(todo), "probe: irregular trains measured", quiet=not progress) as bar:
        for t in todo:
            launch_train(ctx, dest, t)
            rows, ids = [], []
            for _ in range(repeats or TRAIN_REPEATS):
                rows += trace_rows(t, launch_train(ctx, dest, t), next_id)
                ids.append(next_id)
                next_id += 1
            ctx.check()
            writer.write_many(rows)
            with done_path.open("a") as f:
                f.write(f"{t.label()} {','.join(map(str, ids))}\n")
            info["trains_run"] += 1
            bar.advance()
    return info
