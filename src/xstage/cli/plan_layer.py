"""`xstage plan layer` and `xstage plan layer-grid`: the whole Ulysses layer (pre exchange, attention,
post exchange) ranked by the model, with its lower bound; predictions, no GPU."""

from __future__ import annotations

from xstage.bounds import MAX_RANKS
from xstage.cli.args import add_force_option, add_json_option, cli_int, cli_type, path_arg
from xstage.env import environment
from xstage.results import emit, markdown_table
from xstage.results.io import write_csv_atomic
from xstage.results.output import Outputs, with_provenance
from xstage.sched.exchange import MAX_HEADS, MAX_SEQ_TOKENS, check_call_shape, check_head_dim
from xstage.sched.layer import ELEM_BYTES, LAYER_PATHS, MAX_BATCH, LayerConfig, check_measured, prediction_rows
from xstage.sched.measured import load_results
from xstage.sched.policy import choose_exchange, choose_layer
from xstage.spec.ulysses import SUPPORTED_HEAD_DIMS

ULYSSES_FLAGS = ("--heads", "--dim", "--tokens", "--ranks")  # the call shape's flags, in `check_call_shape`'s order

# The diffusion-transformer layers of the whole-layer issue (heads, dim, tokens, P); all in the main grid.
DIT_CONFIGS = ((24, 128, 4608, 4), (24, 128, 32760, 4), (40, 128, 75600, 8))
LAYER_FILES = ("predictions.csv", "measured-check.csv")


def run_plan_layer(args) -> int:
    sizes = dict(zip(ULYSSES_FLAGS, check_call_shape(args.heads, args.dim, args.tokens, args.ranks, ULYSSES_FLAGS)))
    cfg = LayerConfig(*sizes.values(), batch=args.batch, path=args.path, dtype=args.dtype)
    rows = prediction_rows([cfg])
    d = choose_layer(cfg.heads, cfg.dim, cfg.tokens, cfg.ranks, path=cfg.path, dtype=cfg.dtype, batch=cfg.batch)
    table = [{"scheme": r["scheme"], "time_us": r["predicted_ns"] / 1e3, "vs_bound": r["vs_bound"],
              "vs_attention": r["vs_attention"]} for r in rows]
    text = (f"{cfg.heads} heads x {cfg.dim}, {cfg.tokens} tokens, {cfg.ranks} ranks, batch {cfg.batch}, {cfg.path}, "
            f"{cfg.dtype} (rank 0's whole layer; predicted, not measured)\n"
            + markdown_table(table, list(table[0]), floatfmt=".4g")
            + f"\nlower bound {rows[0]['bound_ns'] / 1e3:.4g} us; pick: {d.choice}")
    emit({"rows": rows, "pick": d.choice}, args.json, text)
    return 0


def run_plan_layer_grid(args) -> int:
    """Predictions of the whole layer for the main grid's configurations (host and peer paths, bf16),
    and, with `--measured`, the measured part of the model checked against a benchmark CSV."""
    outs = Outputs("xstage plan layer-grid", force=args.force, inputs=[("--measured", args.measured)])
    out = outs.folder(args.out, "-o", files=LAYER_FILES if args.measured else LAYER_FILES[:1])
    res = load_results(args.measured, kind="ulysses") if args.measured else None
    from xstage.bench.ulysses import grid_configs  # the grid's shapes live with the benchmark

    env = environment()
    configs = [LayerConfig(c["heads"], c["dim"], c["tokens"], c["P"], path=path)
               for path in LAYER_PATHS for c in grid_configs("main")]
    today = {c: choose_exchange(c.heads, c.dim, c.tokens, c.ranks, path=c.path, dtype=c.dtype).choice
             for c in configs}
    rows = [{**r, "dit": int((r["heads"], r["dim"], r["tokens"], r["P"]) in DIT_CONFIGS)}
            for r in prediction_rows(configs, today=today)]
    summary = []
    with outs:
        write_csv_atomic(out / LAYER_FILES[0], with_provenance(rows, env), list(rows[0]) + ["git_commit", "src_hash",
                                                                                             "date"])
        if res is not None:
            checked, summary = check_measured(res.rows)
            write_csv_atomic(out / LAYER_FILES[1], with_provenance(checked, env), list(checked[0])
                             + ["git_commit", "src_hash", "date"])
    best = [r for r in rows if r["scheme"] == r["best_scheme"]]
    table = [{"path": r["path"], "heads": r["heads"], "dim": r["dim"], "tokens": r["tokens"], "P": r["P"],
              "best": r["scheme"], "best_vs_attention": r["vs_attention"], "best_vs_bound": r["vs_bound"],
              "today_auto_vs_attention": r["today_auto_ns"] / r["attention_best_ns"]} for r in best]
    text = markdown_table(table, list(table[0]), floatfmt=".3g")
    if summary:
        text += "\n\nthe measured part (attention, post exchange) against " + str(res.path) + "\n" + markdown_table(
            summary, list(summary[0]), floatfmt=".4g")
    emit({"best": table, "measured": summary}, args.json, text + f"\nwritten to {out}")
    return 0


def add_call_shape(p) -> None:
    """The options of one Ulysses call shape (`ULYSSES_FLAGS`): `plan ulysses` and `plan layer`."""
    p.add_argument("--heads", type=cli_int(1, MAX_HEADS, "attention heads over all ranks"), required=True,
                   help=f"attention heads over all ranks, 1..{MAX_HEADS} (required)")
    p.add_argument("--dim", type=cli_type(check_head_dim), required=True, help="head dim in elements, one of "
                   f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))} (the attention kernel's; required)")
    p.add_argument("--tokens", type=cli_int(1, MAX_SEQ_TOKENS, "sequence length over all ranks"), required=True,
                   help=f"sequence length in tokens over all ranks, 1..{MAX_SEQ_TOKENS} (required)")
    p.add_argument("--ranks", type=cli_int(1, MAX_RANKS, "sequence-parallel ranks"), required=True,
                   help=f"sequence-parallel group size in ranks, 1..{MAX_RANKS} and <= --heads (required)")


def register_layer(kinds) -> None:
    """`plan layer` and `plan layer-grid` under `xstage plan`."""
    y = kinds.add_parser("layer", help="rank the schemes of a whole Ulysses layer (pre exchange, attention, post "
                         "exchange) for one call shape, with its lower bound (a prediction; no GPU)")
    add_call_shape(y)
    y.add_argument("--batch", type=cli_int(1, MAX_BATCH, "sequences per call"), default=1,
                   help=f"sequences per call, 1..{MAX_BATCH} (default: 1)")
    y.add_argument("--path", choices=LAYER_PATHS, default="host", help="where the exchanges go (default: host)")
    y.add_argument("--dtype", choices=tuple(ELEM_BYTES), default="bf16", help="element type (default: bf16)")
    add_json_option(y)
    y.set_defaults(handler=run_plan_layer)

    g = kinds.add_parser("layer-grid", help="predict the whole Ulysses layer for every configuration of the main "
                         "grid on the host and peer paths, bf16 (no GPU)")
    g.add_argument("-o", "--out", required=True, type=path_arg, metavar="DIR",
                   help=f"output folder, created if missing; {LAYER_FILES[0]} (and {LAYER_FILES[1]} with "
                   "--measured) is written in it, replacing only a file this command wrote (required)")
    g.add_argument("--measured", type=path_arg, metavar="CSV", help="ulysses.csv of `xstage bench ulysses` to check "
                   "the measured part of the model against (attention alone, today's post exchanges; default: none)")
    add_force_option(g)
    add_json_option(g)
    g.set_defaults(handler=run_plan_layer_grid)
