"""BatchNorm's running statistics updated once per step from the global batch (pipeline/train/step_norm.py):
the statistics of the step's micro batches combined are those of the whole batch in one forward, and a step
leaves the buffers as PyTorch's own update from that forward would. The 2 -> 1 rank resume of a CNN student:
tests/integration/test_distill.py."""

import copy

import torch
from torch import nn

from pipeline.train.step_norm import StepNormStats, batch_norms


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(5),
                        nn.BatchNorm1d(5, momentum=None))  # the cumulative average too
    net(torch.randn(2, 3, 6, 6))  # the lazy layer's shape; the buffers moved once
    return net


def step(net: nn.Module, stats: StepNormStats, micro_batches: list[torch.Tensor]) -> None:
    stats.before_step()
    for x in micro_batches:
        stats.micro_batch()
        net(x).sum().backward()
    stats.after_step()


def test_a_step_of_micro_batches_updates_the_buffers_once_as_one_forward_of_the_whole_batch():
    x = torch.randn(8, 3, 6, 6) * 3 + 1
    whole = model().train()
    whole(x)  # PyTorch's update from the whole batch, once
    net = model().train()
    stats = StepNormStats(net, accum=4, rank=0, world_size=1)
    step(net, stats, list(x.chunk(4)))
    for ours, theirs in zip(batch_norms(net), batch_norms(whole)):
        assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == 2  # one step: one update
    # The first norm's input is the same images' (the second's follows micro batch normalisation: not the same)
    ours, theirs = batch_norms(net)[0], batch_norms(whole)[0]
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours.running_var, model().state_dict()["1.running_var"])  # it moved


def test_forwards_outside_a_step_and_in_evaluation_leave_the_buffers():
    net = model().train()
    stats = StepNormStats(net, accum=1, rank=0, world_size=1)
    before = copy.deepcopy(net.state_dict())
    step(net, stats, [])  # no training forward in the step: nothing moves, num_batches_tracked neither
    net.eval()
    stats.before_step()
    stats.micro_batch()
    net(torch.randn(4, 3, 6, 6))
    stats.after_step()
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    stats.remove()
    net.train()(torch.randn(4, 3, 6, 6))  # hooks removed: PyTorch's own update again
    assert batch_norms(net)[0].num_batches_tracked.item() == 2


def test_the_same_micro_batches_give_the_same_buffers_bit_for_bit_on_any_accumulation_order():
    """Rank r's micro batch a is slot r x accum + a: 2 ranks of 1 micro batch each fill the slots a rank of 2
    fills (the all-reduce adds zeros), combined in one order: the same buffers."""
    xs = list((torch.randn(8, 3, 6, 6) * 2).chunk(2))
    one = model().train()
    step(one, StepNormStats(one, accum=2, rank=0, world_size=1), xs)
    # Two ranks by hand: each fills its slot, the sum of the slots is what the all-reduce gives.
    ranks = [model().train() for _ in range(2)]
    stats = [StepNormStats(net, accum=1, rank=r, world_size=2) for r, net in enumerate(ranks)]
    for r, (net, s) in enumerate(zip(ranks, stats)):
        s.before_step()
        s.micro_batch()
        net(xs[r])
    summed = [a + b for a, b in zip(stats[0].slots, stats[1].slots)]
    for s in stats:
        s.slots = [t.clone() for t in summed]
        s.after_step()
    for ours in ranks:
        for k, v in ours.state_dict().items():
            if "running" in k or "num_batches" in k:
                assert torch.equal(v, one.state_dict()[k]), k
