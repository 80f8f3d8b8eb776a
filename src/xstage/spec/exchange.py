"""How a Ulysses layer moves its tensors between the ranks: one type, one parser.

Spellings (API `exchange=`, `xstage bench ulysses --exchange`, `xstage plan ulysses --candidates`,
`xstage plan validate --exchange`, the `variant` column of the CSVs):

- `serial[:CORE]`: attention, then the group's all-to-all (the copy engine on a loopback group);
- `overlap[:CORE[:BLOCKS[:CUT]]]`: attention over blocks of query rows; the copy engine sends each
  finished block while the next one computes;
- `stores[:burst | :paced[:R]]`: the Triton kernel stores each finished tile from its epilogue,
  whole (`burst`) or in chunks of R rows during the next tile's key loop (`paced`, the default);
- `tma`: the Triton kernel sends each tile with bulk (TMA) stores from shared memory;
- `heads:CORE:C`: both exchanges pipelined by head chunks: every rank's heads in C chunks, each
  chunk's Q, K and V sent as its own all-to-all, and each chunk's attention run once they arrived
  while later chunks' Q, K, V and earlier chunks' O cross the link (`xstage.attention.pipeline`; on a
  torch.distributed group). The others above move the output only, after one all-to-all of Q, K, V;
- `auto`: the planner's pick for the call's shape, group size, path and dtype (`serial` when some rank
  owns no head, H < P, which the planner does not model): `xstage.sched.policy.choose_exchange`.

`CORE` is the attention kernel: `triton` (`xstage.attention.flash`, the default) or `cudnn` (torch's
scaled_dot_product_attention with the cuDNN backend; on a machine without a GPU torch's own SDPA
stands in, for correctness only). `BLOCKS` is how many blocks of rows `overlap` cuts the sequence
into (0 or absent: chosen from the shape, see `overlap_blocks`). `CUT` is how the remote rows are
cut into those blocks: `even` (the default) or `waves` (a small last remote block holding only the
tiles that the own rows leave to the kernel's last, partial wave; see `overlap_blocks`).

Example:
    >>> str(parse_exchange("stores"))
    'stores:paced'
    >>> parse_exchange("overlap:cudnn:4").blocks
    4
"""

from __future__ import annotations

from dataclasses import dataclass

from xstage.errors import InputError

MECHANISMS = ("serial", "overlap", "stores", "tma", "heads", "auto")
CORES = ("triton", "cudnn")
CUTS = ("even", "waves")  # how `overlap` cuts the remote rows into blocks; the first is the default
# mechanisms that wait on per-tile or per-block signals from their peers (the watchdog applies)
SIGNALLED = ("overlap", "stores", "tma")


@dataclass(frozen=True)
class Exchange:
    """A parsed exchange (see the module docstring); `str()` gives its canonical spelling."""

    mechanism: str
    core: str = "triton"
    burst: bool = False
    chunk_rows: int = 0
    blocks: int = 0
    cut: str = CUTS[0]
    chunks: int = 0  # `heads`: head chunks per rank

    def __str__(self) -> str:
        if self.mechanism == "heads":
            return f"heads:{self.core}:{self.chunks}"
        if self.mechanism in ("serial", "overlap"):
            if self.cut != CUTS[0]:
                return f"{self.mechanism}:{self.core}:{self.blocks}:{self.cut}"
            text = f"{self.mechanism}:{self.core}" if self.core != "triton" or self.blocks else self.mechanism
            return f"{self.mechanism}:{self.core}:{self.blocks}" if self.blocks else text
        if self.mechanism == "stores":
            if self.burst:
                return "stores:burst"
            return f"stores:paced:{self.chunk_rows}" if self.chunk_rows else "stores:paced"
        return self.mechanism

    @property
    def in_kernel(self) -> bool:
        """True when the Triton kernel itself sends the rows (SMs spend time on stores)."""
        return self.mechanism in ("stores", "tma")


_FORMS = ("serial[:triton|cudnn], overlap[:triton|cudnn[:BLOCKS[:even|waves]]], stores[:burst|:paced[:R]], tma, "
          "heads:triton|cudnn:C, auto (R rows per chunk, a power of two; BLOCKS >= 2; C >= 1 head chunks)")
MAX_CHUNKS = 1024  # head chunks of `heads`: at most one per head of the largest head count a call takes


def parse_exchange(spec) -> Exchange:
    """`spec` (a string or an `Exchange`) as an `Exchange`; anything else is an `InputError`."""
    if isinstance(spec, Exchange):
        return spec
    if not isinstance(spec, str):
        raise InputError(f"exchange {spec!r}: expected a string, one of {_FORMS}")
    parts = spec.strip().split(":")
    kind, rest = parts[0], parts[1:]

    def bad() -> InputError:
        return InputError(f"exchange {spec!r}: expected one of {_FORMS}")

    if kind in ("serial", "overlap"):
        if len(rest) > (3 if kind == "overlap" else 1):
            raise bad()
        core = rest[0] if rest else "triton"
        if core not in CORES:
            raise InputError(f"exchange {spec!r}: attention core {core!r} must be one of {', '.join(CORES)}")
        blocks = 0
        if len(rest) >= 2:
            blocks = _int(rest[1])
            if blocks is None or blocks < 2:
                raise InputError(f"exchange {spec!r}: BLOCKS must be an integer >= 2, got {rest[1]!r}")
        cut = rest[2] if len(rest) == 3 else CUTS[0]
        if cut not in CUTS:
            raise InputError(f"exchange {spec!r}: CUT {cut!r} must be one of {', '.join(CUTS)}")
        return Exchange(kind, core=core, blocks=blocks, cut=cut)
    if kind == "stores":
        if not rest or rest == ["paced"]:
            return Exchange("stores")
        if rest == ["burst"]:
            return Exchange("stores", burst=True)
        if len(rest) == 2 and rest[0] == "paced":
            rows = _int(rest[1])
            if rows is None or rows < 1 or rows & (rows - 1):
                raise InputError(f"exchange {spec!r}: R (rows per chunk) must be a power of two, got {rest[1]!r}")
            return Exchange("stores", chunk_rows=rows)
        raise bad()
    if kind == "heads":
        if len(rest) != 2:
            raise bad()
        if rest[0] not in CORES:
            raise InputError(f"exchange {spec!r}: attention core {rest[0]!r} must be one of {', '.join(CORES)}")
        chunks = _int(rest[1])
        if chunks is None or not 1 <= chunks <= MAX_CHUNKS:
            raise InputError(f"exchange {spec!r}: C (head chunks) must be an integer in [1, {MAX_CHUNKS}], got "
                             f"{rest[1]!r}")
        return Exchange("heads", core=rest[0], chunks=chunks)
    if kind in ("tma", "auto") and not rest:
        return Exchange(kind)
    raise bad()


def _int(text: str):
    try:
        return int(text)
    except ValueError:
        return None


__all__ = ["CORES", "CUTS", "Exchange", "MAX_CHUNKS", "MECHANISMS", "SIGNALLED", "parse_exchange"]
