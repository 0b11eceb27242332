"""fedpa.base_quantization without FederatedScope: the key's values, the loading arguments, the backend check, which
methods write the base, the weight bytes of a quantized layer."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest
import torch

from fs_fedpa import quantization
from fs_fedpa.config import FedPAConfig

BNB_MISSING = importlib.util.find_spec("bitsandbytes") is None
BNB_SKIP = pytest.mark.skipif(
    BNB_MISSING,
    reason="bitsandbytes is not installed: the quantized-layer tests are SKIPPED (pip install 'fs_fedpa[quant]')",
)


def test_the_key_takes_none_int8_nf4_and_names_itself_otherwise():
    assert FedPAConfig().base_quantization == "none"
    assert FedPAConfig(base_quantization="nf4").base_quantization == "nf4"
    with pytest.raises(
        ValueError, match=r"fedpa.base_quantization\(='int4'\) must be one of \('none', 'int8', 'nf4'\)"
    ):
        FedPAConfig(base_quantization="int4")


def test_exactly_the_five_methods_that_write_the_base_say_so():
    from fs_fedpa.methods.base import get_method
    from fs_fedpa.methods.catalog import names

    # Execute
    writers = {name: get_method(name).writes_base() for name in names() if get_method(name).writes_base()}
    # Assert
    assert set(writers) == {"fedex_lora", "flora", "fed_plora", "feddpa_t", "feddpa_f"}
    assert "merges" in writers["flora"] and "folds" in writers["fed_plora"] and "personal" in writers["feddpa_t"]


def test_loading_arguments_keep_the_head_and_compute_in_float32():
    assert quantization.load_kwargs("none") == {}
    nf4 = quantization.load_kwargs("nf4", keep=quantization.HEADS)["quantization_config"]
    assert nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4" and nf4.bnb_4bit_compute_dtype == torch.float32
    assert nf4.llm_int8_skip_modules == ["classifier", "score"]
    int8 = quantization.load_kwargs("int8")["quantization_config"]
    assert int8.load_in_8bit and not int8.load_in_4bit and not int8.llm_int8_skip_modules  # transformers' default
    with pytest.raises(ValueError, match="must be one of"):
        quantization.load_kwargs("fp8")


def test_a_missing_backend_is_named_with_the_extra_that_installs_it(monkeypatch):
    # Prepare: an import of bitsandbytes fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    # Execute
    problem = quantization.backend_problem("int8")
    # Assert
    assert problem.startswith("fedpa.base_quantization 'int8' needs bitsandbytes and accelerate")
    assert "pip install 'fs_fedpa[quant]'" in problem
    assert quantization.backend_problem("none") is None


def test_the_int8_cast_notice_is_dropped_and_nothing_else():
    quantization.quiet_int8_cast_notice()
    quantization.quiet_int8_cast_notice()  # idempotent: one filter
    log = logging.getLogger("bitsandbytes.autograd._functions")
    assert sum(isinstance(f, quantization._DropInt8Cast) for f in log.filters) == 1

    def record(msg):
        return logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, ("torch.float32",), None)

    assert not log.filters[-1].filter(
        record("MatMul8bitLt: inputs will be cast from %s to float16 during quantization")
    )
    assert log.filters[-1].filter(record("something else"))


@BNB_SKIP
@pytest.mark.parametrize(("kind", "bytes_per_weight"), [("int8", 1.0), ("nf4", 0.5)])
def test_weight_bytes_count_codes_and_scales_of_a_quantized_layer(tmp_path, kind, bytes_per_weight):
    import transformers

    # Prepare: a tiny BERT classifier saved in float32, loaded quantized (its head stays float32)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, num_labels=2
    )
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path)
    full = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    # Execute
    model = transformers.BertForSequenceClassification.from_pretrained(
        tmp_path, **quantization.load_kwargs(kind, keep=quantization.HEADS)
    )
    held, ref = quantization.weight_bytes(model), quantization.weight_bytes(full)
    # Assert: the 7 linear layers of the encoder and pooler (64 x 64 x 5 + 64 x 128 x 2) are quantized, the head is not
    linear = 64 * 64 * 5 + 64 * 128 * 2
    assert type(model.classifier).__name__ == "Linear" and model.classifier.weight.dtype == torch.float32
    assert linear * bytes_per_weight < held["quantized"] < linear * bytes_per_weight * 1.2  # codes + scales
    assert ref["quantized"] == 0 and held["full"] == ref["full"] - linear * 4
    assert "7 linear layers quantized" in quantization.describe(model, kind)


@BNB_SKIP
def test_a_4bit_layer_narrower_than_a_block_evaluates_on_the_cpu_and_a_wide_one_is_left_to_bitsandbytes():
    """bitsandbytes repacks a 4-bit weight at its first no-grad eval forward on an AVX512-BF16 CPU, which fails for an
    input width that is not a multiple of the block size; keep_packable_4bit turns it off there only. Checked by the
    flags on any host, and by the forward itself (against the dequantized weight) where the host repacks."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(bnb.nn.Linear4bit(16, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4"),
                                bnb.nn.Linear4bit(64, 16, bias=False, compute_dtype=torch.float32, quant_type="nf4"))
    for layer in model:
        layer.weight = bnb.nn.Params4bit(torch.randn_like(layer.weight.data), requires_grad=False, quant_type="nf4")
        layer.to("cpu")
    if not hasattr(model[0], "support_avx512bf16_for_cpu"):
        pytest.skip("this bitsandbytes never repacks a 4-bit weight on the CPU")
    repacks = bool(model[0].support_avx512bf16_for_cpu)  # bitsandbytes 0.50 keeps it as an int (0) on some hosts
    assert quantization.keep_packable_4bit(model.eval()) == (["0"] if repacks else [])
    assert not model[0].support_avx512bf16_for_cpu and bool(model[1].support_avx512bf16_for_cpu) == repacks
    x = torch.randn(3, 16)
    expected = x @ F.dequantize_4bit(model[0].weight.data, model[0].weight.quant_state).T
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), expected, rtol=1e-4, atol=1e-4)
