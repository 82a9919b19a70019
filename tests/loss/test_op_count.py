"""smmd_scale.op_count: the ATen ops, GEMMs and host syncs of a region, in the forward and in a
custom autograd backward, with the place that asked for each sync."""

import pytest
import torch

from smmd_scale import compat
from smmd_scale.op_count import count_ops


class _SyncingBackward(torch.autograd.Function):
    """y = 2 x; its backward reads a value back (tolist) and indexes with a boolean mask, as a
    careless backward would."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.tolist()
        grad = grad.clone()
        grad[grad > 0] *= 1.0
        return grad * 2


def test_ops_gemms_and_each_kind_of_sync_are_counted_where_they_happen():
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    with count_ops() as counted:
        product = a @ b
        torch.addmm(torch.zeros(4, 5), a, b)
    assert counted.gemms == 2 and counted.sync_count == 0 and counted.ops >= 3
    with count_ops() as counted:
        product.sum().item()                  # _local_scalar_dense
        product.tolist()                      # reads memory without an op
        product[product > 0]                  # boolean indexing: a data-dependent size
        (product > 0).nonzero()
        bool((product > 0).any())
    assert counted.syncs["aten._local_scalar_dense.default"] == 2
    assert counted.syncs["Tensor.tolist"] == 1 and counted.syncs["aten.index.Tensor"] == 1
    assert counted.syncs["aten.nonzero.default"] == 1 and counted.sync_count == 5
    assert all(site.startswith("test_op_count.py:") for site in counted.sync_sites), counted.sync_sites


def test_a_custom_backward_is_counted_and_its_syncs_named():
    x = torch.randn(6, requires_grad=True)
    y = _SyncingBackward.apply(x).sum()
    with count_ops() as backward:
        y.backward()
    assert backward.syncs["Tensor.tolist"] == 1 and backward.syncs["aten.index_put_.default"] == 1, backward.syncs
    assert any("in backward" in site for site in backward.sync_sites), backward.sync_sites
    assert torch.Tensor.tolist is not None and torch.randn(2).tolist()  # restored after the block


def test_the_tolist_wrapper_is_restored_after_an_error():
    original = torch.Tensor.tolist
    with pytest.raises(RuntimeError, match="planted"):
        with count_ops():
            raise RuntimeError("planted")
    assert torch.Tensor.tolist is original


def test_the_dispatch_mode_comes_from_the_inventory():
    assert compat.torch_dispatch_mode().__name__ == "TorchDispatchMode"
