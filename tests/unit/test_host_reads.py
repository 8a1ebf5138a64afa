"""The host-read counter (pipeline/train/host_reads.py): it sees each kind of read planted in a step, tells
reads of host tensors by design from device reads, and a host tensor mixed with device values is the device's."""

import torch

from pipeline.train.host_reads import HostReads, host_tensor
from pipeline.train.preemption import Preemption


def test_each_kind_of_read_is_counted_where_it_is_made():
    x = torch.randn(6, 3, requires_grad=True)
    with HostReads() as reads:
        loss = (x * 2).sum()
        assert reads.device == 0  # arithmetic reads nothing
        loss.item()
        if loss > 0:  # bool(tensor)
            pass
        x[x[:, 0] > 0]  # a boolean mask: nonzero inside
        torch.nonzero(x > 0)
        x.detach().tolist()
        torch.unique(x.detach())
        x.detach()[torch.tensor([0, 2])]  # an integer index reads nothing
    assert reads.device == 6, reads.ops
    assert reads.host == 0
    assert {"_local_scalar_dense.default", "index.Tensor (bool mask)", "nonzero.default", "tolist"} <= set(reads.ops)
    assert all(site.startswith("tests/unit/test_host_reads.py:") for site in reads.sites), reads.sites


def test_host_tensors_by_design_are_host_reads_until_device_values_reach_them():
    loss = torch.randn(()) ** 2
    with HostReads() as reads:
        flags = host_tensor(torch.tensor([0, 1], dtype=torch.int32))
        bool(flags[0].item())  # a view of a host tensor is one
        both = flags.clone()
        both.add_(loss.to(torch.int32))  # device values written into it: now the device's
        both[1].item()
        assert not Preemption().should_stop()  # the preemption agreement: one host read per flag
        host_tensor(torch.zeros(1))
    assert (reads.device, reads.host) == (1, 3), (reads.ops, reads.sites)
    with HostReads() as reads:  # outside(): the loader's work in a run, neither counted nor tracked
        with reads.outside():
            torch.ones(2).sum().item()
    assert (reads.device, reads.host) == (0, 0)
