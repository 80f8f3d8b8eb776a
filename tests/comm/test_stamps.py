"""Time stamps enqueued on a stream (`xstage.comm.stamps`): host clock on CPU, %globaltimer on the GPU."""

import pytest
import torch

from xstage.comm.stamps import stamp
from xstage.errors import InputError


def test_cpu_stamps_follow_the_host_clock_in_call_order():
    t = torch.zeros(3, dtype=torch.int64)
    for i in range(3):
        stamp(t, i)
    assert bool((t > 0).all()) and t[0] <= t[1] <= t[2]


def test_bad_stamp_buffers_are_refused():
    with pytest.raises(InputError, match="int64"):
        stamp(torch.zeros(2, dtype=torch.int32), 0)
    with pytest.raises(InputError, match="index=2"):
        stamp(torch.zeros(2, dtype=torch.int64), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_stamps_bracket_a_kernel_inside_a_cuda_graph():
    t = torch.zeros(2, dtype=torch.int64, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")

    def work():
        stamp(t, 0)
        a @ a
        stamp(t, 1)

    work()  # compiles the stamp kernel outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        work()
    t.zero_()
    g.replay()
    torch.cuda.synchronize()
    elapsed = int(t[1] - t[0])
    # a 4096^3 float32 matmul takes well over 10 us and well under a second on any GPU xstage targets
    assert 10_000 < elapsed < 1_000_000_000
