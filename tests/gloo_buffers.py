"""Run by tests/test_sharding.py under torchrun (two gloo processes): the bytes gloo allocates inside an all-gather
and a reduce-scatter of one tensor, as the CPU allocator reports them, and as GlooWorkspace counts them. Writes
"<measured> <counted>" to OUT/rank<R>.txt."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from lowmem.memory.measure import GlooWorkspace, _peak_of

dist.init_process_group("gloo")
n, ws = dist.get_world_size(), GlooWorkspace()
measured = counted = 0
for numel in (1000, 12345):
    shard, whole = torch.randn(numel), torch.randn(n * numel)
    gathered, reduced = torch.empty(n * numel), torch.empty(numel)
    for op, args, call in [
        (torch.ops.c10d._allgather_base_.default, (gathered, shard), lambda: dist.all_gather_into_tensor(gathered, shard)),
        (torch.ops.c10d._reduce_scatter_base_.default, (reduced, whole), lambda: dist.reduce_scatter_tensor(reduced, whole)),
    ]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
        measured += _peak_of(prof)
        counted += ws(op, args, {})
Path(sys.argv[1], f"rank{dist.get_rank()}.txt").write_text(f"{measured} {counted}")
dist.destroy_process_group()
