"""The plugin's wire encoding through FederatedScope's own gRPC message code (no network needed): tensors travel
as plain strings and ints, FS's pickle serializer is never reached, and what arrives decodes bit for bit."""

from __future__ import annotations

import pytest
import torch

from fs_fedpa.plugin.payload import decode_factors, decode_tensors, encode_factors, encode_tensors

pytestmark = pytest.mark.integration


def test_an_encoded_payload_crosses_fs_grpc_messages_without_pickle(monkeypatch):
    from federatedscope.core.message import Message

    def refuse(*args, **kwargs):
        raise AssertionError("FS's pickle-based param_serializer was called")

    monkeypatch.setattr(Message, "param_serializer", refuse, raising=False)
    g = torch.Generator().manual_seed(0)
    B, A, head = torch.randn(8, 2, generator=g), torch.randn(2, 5, generator=g), torch.randn(3, generator=g)
    payload = {
        "lora": encode_factors({"layer.q": (B, A.to(torch.bfloat16))}, wire=True),
        "shared": encode_tensors({"classifier.bias": head}, wire=True),
        "stats": {"lam": 0.5},
    }
    sent = Message(msg_type="model_para", sender=1, receiver=[0], state=3, content=payload)
    received = Message()
    received.parse(sent.transform(to_list=True).msg)
    factors = decode_factors(received.content["lora"])
    assert torch.equal(factors["layer.q"][0], B) and factors["layer.q"][1].dtype == torch.bfloat16
    assert torch.equal(factors["layer.q"][1], A.to(torch.bfloat16))
    assert torch.equal(decode_tensors(received.content["shared"])["classifier.bias"], head)
    assert received.content["stats"]["lam"] == pytest.approx(0.5)


@pytest.mark.parametrize("dense", [False, True])
def test_a_downlink_with_a_merge_and_no_reference_crosses_fs_grpc_messages(monkeypatch, dense):
    from federatedscope.core.message import Message

    from fs_fedpa.plugin.payload import decode_merge, encode_merge

    monkeypatch.setattr(Message, "param_serializer", lambda *a, **k: pytest.fail("pickle"), raising=False)
    g = torch.Generator().manual_seed(1)
    B, A = torch.randn(8, 6, generator=g), torch.randn(6, 5, generator=g)
    merge = {"layer.q": B @ A if dense else (B, A)}  # FedEx-LoRA's dense residual, FLoRA's stacked factors
    payload = {"zero_reference": 1, "base": encode_merge([merge], wire=True)}
    sent = Message(msg_type="model_para", sender=0, receiver=[1], state=2, content=payload)
    received = Message()
    received.parse(sent.transform(to_list=True).msg)
    assert "lora" not in received.content
    torch.testing.assert_close(decode_merge(received.content["base"])[0]["layer.q"], B @ A)
