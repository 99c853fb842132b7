"""OutputViewGuard: an in-place op on a view output (which drops FSDP2's pre-backward hook) is caught after backward."""

import warnings

import pytest
import torch
from torch import nn

from lightning_llm.parallel.output_views import OutputViewGuard


class ViewHead(nn.Module):
    """Returns a view, as a TP head's gathered logits (``DTensor.to_local()``) are."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x):
        return self.linear(x).view(-1, 6)


def test_an_in_place_op_on_the_view_logits_is_refused_after_backward():
    head = ViewHead()
    guard = OutputViewGuard([head])
    logits = head(torch.randn(3, 4))
    logits.div_(2.0)  # drops every hook registered on the view: FSDP2's and the guard's
    logits.sum().backward()
    with pytest.raises(RuntimeError, match=r"output of ViewHead .* was modified in place before the backward"):
        guard.check()


def test_out_of_place_ops_and_an_unused_extra_forward_pass():
    head = ViewHead()
    guard = OutputViewGuard([head])
    head(torch.randn(3, 4))  # a forward whose output the loss does not use
    logits = head(torch.randn(3, 4))
    (logits / 2.0 + 1.0).sum().backward()
    guard.check()
    with torch.no_grad():
        head(torch.randn(3, 4)).mul_(2)  # evaluation: no gradient, nothing recorded
    guard.check()


def test_the_fsdp_warning_it_replaces_is_filtered():
    OutputViewGuard([])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        OutputViewGuard([])  # installs its filter inside this block too
        warnings.warn(
            "FSDP2-wrapped module (FSDPLlama) returned a view tensor. An in-place op ...", UserWarning, stacklevel=1
        )
    assert not caught
