"""The head refit against scikit-learn's logistic regression (an independent solver of the same objective)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fs_fedpa.core.head_refit import fit_softmax_head, head_inputs, head_of, swapped

pytest.importorskip("sklearn")


def _objective(W, b, X, y, c: float) -> float:
    """(1/n) Σ CE + ‖W‖²/(2 C n), written out with numpy."""
    z = X @ W.T + b
    z = z - z.max(1, keepdims=True)
    ce = -(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(1))).mean()
    return float(ce + (W * W).sum() / (2 * c * len(y)))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(20, 120), h=st.integers(2, 12), classes=st.integers(2, 4), c=st.floats(0.05, 5.0),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_refit_reaches_sklearns_minimum(n, h, classes, c, seed):
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    y[:classes] = np.arange(classes)  # every class present
    X = rng.normal(size=(n, h)) + 0.8 * np.eye(classes, h)[y]
    W, b = fit_softmax_head(torch.tensor(X), torch.tensor(y), classes, c=c)
    # scikit-learn fits two classes with one coefficient vector w = w_1 - w_0, whose penalty is twice the softmax
    # rows' at their optimum (w_0 = -w_1): its C = 2c there is the same problem
    sk = LogisticRegression(C=2 * c if classes == 2 else c, max_iter=20_000, tol=1e-12).fit(X, y)
    coef, bias = sk.coef_, sk.intercept_
    if classes == 2:
        coef, bias = np.vstack([-coef / 2, coef / 2]), np.array([-bias[0] / 2, bias[0] / 2])
    ours, theirs = _objective(W.numpy(), b.numpy(), X, y, c), _objective(coef, bias, X, y, c)
    assert ours <= theirs + 1e-9 * max(1.0, abs(theirs))
    p = torch.softmax(torch.tensor(X) @ W.T + b, 1).numpy()
    assert np.abs(p - sk.predict_proba(X)).max() < 1e-3


def test_one_label_predicts_it_and_the_head_comes_back():
    X, y = torch.randn(10, 3), torch.full((10,), 1)
    W, b = fit_softmax_head(X, y, 3)
    assert (torch.argmax(X.double() @ W.T + b, 1) == 1).all()
    head = nn.Linear(3, 3)
    before = head.weight.detach().clone(), head.bias.detach().clone()
    with swapped(head, W, b):
        assert torch.equal(head.weight, torch.zeros(3, 3)) and head.bias.argmax() == 1
    assert torch.equal(head.weight, before[0]) and torch.equal(head.bias, before[1])
    with pytest.raises(RuntimeError), swapped(head, W, b):
        raise RuntimeError("the evaluation failed")
    assert torch.equal(head.weight, before[0])  # restored on the way out of a failure too


def test_head_is_the_active_classifier_and_its_inputs_are_recorded():
    class Model(nn.Module):  # PEFT's layout: the trained copy under modules_to_save, the original beside it
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 5)
            trained = nn.ModuleDict({"default": nn.Linear(5, 2)})
            self.classifier = nn.ModuleDict({"original_module": nn.Linear(5, 2), "modules_to_save": trained})

        def forward(self, x):
            return self.classifier["modules_to_save"]["default"](torch.tanh(self.body(x)))

    model = Model()
    head = head_of(model, ["classifier"])
    assert head is model.classifier["modules_to_save"]["default"]
    batches = [(torch.randn(3, 4), torch.tensor([0, 1, 0])), (torch.randn(2, 4), torch.tensor([1, 1]))]
    X, y = head_inputs(head, batches, lambda features, labels: model(features))
    want = torch.cat([torch.tanh(model.body(f)) for f, _ in batches]).detach()
    assert torch.equal(X, want) and y.tolist() == [0, 1, 0, 1, 1]
    assert not head._forward_pre_hooks  # the hook is gone
    with pytest.raises(ValueError, match="no linear classifier head"):
        head_of(model, ["score"])
