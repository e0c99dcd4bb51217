"""Device -> host copies: a span copied whole into a host buffer taken again step after step."""

import torch

from engine.copies import HostSpan, ToHost


def test_a_span_reuses_its_buffer_once_read_and_takes_a_fresh_one_while_unread():
    device = torch.arange(10)  # kept pieces [0:3] and [5:9] (shape [2, 2]), padding between
    span = HostSpan(device, [3, 2, 4, 1], [(3,), (2, 2)])
    first = ToHost(within=span)
    assert first.lists() == [[0, 1, 2], [[5, 6], [7, 8]]]
    device += 10
    second = ToHost(within=span)  # the first was read: the same buffer again
    assert second.buffer is first.buffer
    device += 10
    third = ToHost(within=span)  # the second is unread: a buffer of its own, which the span keeps
    assert third.buffer is not second.buffer and span.host is third.buffer
    assert second.lists() == [[10, 11, 12], [[15, 16], [17, 18]]]  # not overwritten by the third copy
    assert third.lists() == [[20, 21, 22], [[25, 26], [27, 28]]]
    fourth = ToHost(within=span)  # the third was read: its buffer is taken again, no more fresh ones
    assert fourth.buffer is third.buffer
