"""Reference layer, weight layout, routing layout and schedule tables (pure torch / numpy)."""

import numpy as np
import pytest
import torch

from xstage.errors import InputError
from xstage.moe.layout import routing_layout, transform_weights, unit_experts, untransform_l1
from xstage.moe.reference import loopback_inputs, reference_moe_virtual
from xstage.spec.schedule import DISPATCH, LINEAR1, LINEAR2, make_schedule


def _dense_moe(x, idx, w, l1_all, l2_all):
    """Token by token, no parallelism: the independent check of the reference."""
    inter = l1_all.shape[1] // 2
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = l1_all[e] @ x[t]
            y[t] += w[t, k] * (l2_all[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return y


def _routing(T, E, K, gen):
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])


@pytest.mark.parametrize("R,T,E,K", [pytest.param(1, 5, 4, 2, id="R1"), pytest.param(2, 7, 6, 3, id="R2"),
                                     pytest.param(4, 3, 8, 2, id="R4-T3")])
def test_reference_matches_dense(R, T, E, K):
    gen = torch.Generator().manual_seed(R * 100 + T)
    H, I = 8, 6
    xs = [torch.randn(T, H, dtype=torch.float64, generator=gen) for _ in range(R)]
    idx = [_routing(T, E, K, gen) for _ in range(R)]
    ws = [torch.rand(T, K, dtype=torch.float64, generator=gen) for _ in range(R)]
    l1_all = torch.randn(E, 2 * I, H, dtype=torch.float64, generator=gen)
    l2_all = torch.randn(E, H, I, dtype=torch.float64, generator=gen)
    el = E // R
    ys = reference_moe_virtual(xs, idx, ws, list(l1_all.split(el)), list(l2_all.split(el)), dtype=torch.float64)
    for r in range(R):
        torch.testing.assert_close(ys[r], _dense_moe(xs[r], idx[r], ws[r], l1_all, l2_all), rtol=1e-10, atol=1e-10)


def test_loopback_inputs_rank0_equals_tiled_weights():
    gen = torch.Generator().manual_seed(1)
    R, T, E, K, H, I = 4, 6, 8, 2, 8, 4
    x = torch.randn(T, H, dtype=torch.float64, generator=gen)
    idx = _routing(T, E, K, gen)
    w = torch.rand(T, K, dtype=torch.float64, generator=gen)
    l1 = torch.randn(E // R, 2 * I, H, dtype=torch.float64, generator=gen)
    l2 = torch.randn(E // R, H, I, dtype=torch.float64, generator=gen)
    y0 = reference_moe_virtual(*loopback_inputs(x, idx, w, l1, l2, R), dtype=torch.float64)[0]
    torch.testing.assert_close(y0, _dense_moe(x, idx, w, l1.repeat(R, 1, 1), l2.repeat(R, 1, 1)))


def test_transform_weights_roundtrip_and_blocks():
    l1 = torch.randn(3, 16, 5)
    l2 = torch.randn(3, 5, 8)
    w1t, w2 = transform_weights(l1, l2, block_n1=4)
    assert torch.equal(untransform_l1(w1t, 4), l1)
    assert torch.equal(w1t[1, 4:8], l1[1, 8:12])  # first up block follows the first gate block
    assert torch.equal(w2, l2)
    with pytest.raises(InputError, match="block_n1"):
        transform_weights(l1, l2, block_n1=3)
    with pytest.raises(InputError, match="l2"):
        transform_weights(l1, l2[:, :, :4], block_n1=4)


def test_routing_layout_covers_every_local_row_once():
    gen = torch.Generator().manual_seed(3)
    R, T, E, K, bm = 3, 9, 6, 2, 4
    idx = torch.stack([_routing(T, E, K, gen) for _ in range(R)])
    el = E // R
    for rank in range(R):
        local = (idx // el) == rank
        counts = torch.bincount((idx[local] % el).reshape(-1), minlength=el)
        experts = unit_experts(counts.tolist(), bm)
        lay = routing_layout(idx, rank, el, bm, rows_cap=64, units_cap=len(experts) + 2, token_stride=16)
        seen = set()
        for u, (e, row0, n, _) in enumerate(lay.unit_info.tolist()):
            if u >= len(experts):
                assert n == 0
                continue
            assert e == experts[u] and row0 % bm == 0 and 0 < n <= bm
            for r in range(row0, row0 + n):
                src, k = int(lay.row_src[r]), int(lay.row_slot[r])
                s, t = divmod(src, 16)
                assert int(idx[s, t, k]) == rank * el + e
                seen.add((s, t, k))
        assert len(seen) == int(local.sum())


UNITS = [0, 0, 1, 2, 2, 2, 3, 5]


@pytest.mark.parametrize("name", ["expert_wave", "interleaved", "lag:0", "lag:1", "lag:5", "lag:100"])
@pytest.mark.parametrize("ctas", [1, 3, 7])
def test_schedule_covers_tasks_and_respects_dependencies(name, ctas):
    n1, n2 = 3, 2
    s = make_schedule(name, UNITS, ctas, n1, n2, unit_rows=[4, 1, 4, 4, 4, 2, 3, 4])
    assert s.num_tasks == len(UNITS) * (1 + n1 + n2)
    keys = {(int(k), int(u), int(n)) for k, u, n in s.tasks[:, :3]}
    assert len(keys) == s.num_tasks
    for c in range(ctas):
        g = s.cta_tasks(c)[:, 6]
        assert np.all(np.diff(g) > 0) and np.all(g % ctas == c)
    done = {}
    for kind, u, _nb, e, _mb, wait, _g, rows in s.global_order():
        assert e == UNITS[u] and wait == {DISPATCH: 0, LINEAR1: 1, LINEAR2: 1 + n1}[kind]
        assert done.get(u, 0) >= wait
        assert rows == ([4, 1, 4, 4, 4, 2, 3, 4][u] if kind == LINEAR2 else 0)
        if kind != LINEAR2:
            done[u] = done.get(u, 0) + 1


def _order(name, ctas=1):
    s = make_schedule(name, UNITS, ctas, 2, 1, dispatch_lead=0)
    return [(int(k), int(u)) for k, u in s.global_order()[:, :2]]


@pytest.mark.parametrize("name", ["expert_wave", "interleaved", "lag:2"])
@pytest.mark.parametrize("lead", [1, 4, 100])
def test_dispatch_hoisted_ahead_of_its_linear1(name, lead):
    def tasks(d):
        table = make_schedule(name, UNITS, 2, 3, 2, dispatch_lead=d).global_order()
        return [tuple(int(v) for v in t[:3]) for t in table]

    plain, order = tasks(0), tasks(lead)
    assert [t for t in order if t[0] != DISPATCH] == [t for t in plain if t[0] != DISPATCH]
    for u in range(len(UNITS)):
        rest_before = [t for t in order[: order.index((DISPATCH, u, 0))] if t[0] != DISPATCH]
        first_l1 = [t for t in plain if t[0] != DISPATCH].index((LINEAR1, u, 0))
        assert len(rest_before) == max(0, first_l1 - lead)


def test_expert_wave_groups_whole_experts():
    # 2 x ctas = 4 LINEAR1 tasks per wave at least, closed at expert boundaries: {0,0}, {1,2,2,2}, {3,5}.
    order = _order("expert_wave", ctas=2)
    l2_units = [u for k, u in order if k == LINEAR2]
    assert l2_units == [0, 1, 2, 3, 4, 5, 6, 7]
    first_l2 = order.index((LINEAR2, 0))
    assert {u for k, u in order[:first_l2]} == {0, 1}
    assert order.index((LINEAR2, 2)) > max(i for i, (k, u) in enumerate(order) if u == 5 and k == LINEAR1)


def test_lag_places_linear2_after_linear1_of_unit_plus_k():
    for k in (0, 2):
        order = _order(f"lag:{k}")
        for i in range(len(UNITS) - k):
            last_l1 = max(j for j, (kind, u) in enumerate(order) if kind == LINEAR1 and u == i + k)
            assert order.index((LINEAR2, i)) > last_l1
            if i + k + 1 < len(UNITS):
                first_next = order.index((DISPATCH, i + k + 1))
                assert order.index((LINEAR2, i)) < first_next


def test_interleaved_alternates_after_warmup():
    order = _order("interleaved", ctas=1)
    kinds = [k for k, _ in order if k != DISPATCH]
    first_l2 = kinds.index(LINEAR2)
    assert all(k == LINEAR1 for k in kinds[:first_l2])
    assert LINEAR1 in kinds[first_l2:] and kinds[first_l2 + 1] == LINEAR1


@pytest.mark.parametrize("name,match", [("wave", "unknown"), ("lag", "lag needs"), ("lag:x", "lag needs"),
                                        ("interleaved:2", "takes no argument")])
def test_schedule_bad_names(name, match):
    with pytest.raises(InputError, match=match):
        make_schedule(name, UNITS, 2, 2, 1)


def test_schedule_bad_sizes():
    with pytest.raises(InputError, match="num_ctas"):
        make_schedule("lag:1", UNITS, 0, 2, 1)


def test_dest_rows_and_store_bytes():
    dest = [[3, 1], [0, 4], [2, 2], [4, 0], [1, 1], [2, 0], [0, 3], [4, 0]]
    s = make_schedule("interleaved", UNITS, 3, 2, 2, unit_rows=[sum(d) for d in dest], unit_dest_rows=dest)
    for row, d in zip(s.tasks, s.dest_rows):
        expect = dest[row[1]] if row[0] == LINEAR2 else [0, 0]
        assert list(d) == expect and d.sum() == row[7]
    b = s.store_bytes(block_n2=32, elem_bytes=2)
    assert b.shape == (s.num_tasks, 2) and int(b.sum()) == sum(map(sum, dest)) * 2 * 32 * 2
