"""The storage accounting counts every storage once, frees it when it dies, and tracks peaks."""

import torch
from gem_memory.meter import AccountingMeter, measure_peak, static_bytes


def test_accounting_counts_storages_once_and_releases_them():
    meter = AccountingMeter()
    with meter:
        meter.mark()
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:20]  # same storage: nothing new
        a.add_(1)  # in place: nothing new
        assert meter.live == 4000
        b = a * 2  # a new storage
        assert meter.live == 8000
        del a, view
        assert meter.live == 4000  # a's storage died with its last view
        mark = meter.mark()
        assert (mark.live, mark.peak) == (4000, 8000)
        del b
        assert meter.mark() == type(mark)(0, 4000)


def test_accounting_sees_the_backward():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    meter = AccountingMeter()
    with meter:
        meter.mark()
        y = (x @ w).relu()  # saves x (outside) and the relu output (inside)
        loss = y.sum()
        del y
        saved = meter.mark()
        loss.backward()
        after = meter.mark()
    assert saved.live == 32 * 64 * 4 + 4  # relu output + the scalar loss
    assert after.live == saved.live - 32 * 64 * 4 + 64 * 64 * 4  # relu output freed, w.grad kept
    assert after.peak > saved.live  # the gradient temporaries were counted


def test_measure_peak_adds_static_bytes_and_resets_grads():
    model = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    model(x).sum().backward()
    first = measure_peak(model, x)
    assert first == measure_peak(model, (x,))  # deterministic, grads reset in between
    assert first > static_bytes(model, x) == (16 * 16 + 16 + 8 * 16) * 4
