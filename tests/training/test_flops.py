import pytest
from transformers import AutoConfig

from training.flops import flops_per_token, peak_tflops
from training.shape import model_shape


def tiny_llama_shape():
    return model_shape(AutoConfig.from_pretrained("recipes/tiny_llama/config.json"))


def test_model_flops_are_6n_plus_attention():
    shape = tiny_llama_shape()
    # every weight but the (untied) input embedding is multiplied with: 4 layers of attention + MLP, the norms, the head
    assert shape.matmul_parameters == shape.parameters - 4096 * 256
    model, hardware = flops_per_token(shape, seq_len=256, recompute=False)
    assert model == hardware == 6 * shape.matmul_parameters + 12 * 4 * 256 * 256


def test_recomputation_adds_one_forward_of_the_decoder_layers():
    shape = tiny_llama_shape()
    model, hardware = flops_per_token(shape, seq_len=256, recompute=True)
    assert model == flops_per_token(shape, 256, recompute=False)[0]
    assert hardware - model == 2 * sum(shape.layer_parameters) + 4 * 4 * 256 * 256


def test_tied_head_counts_as_a_matmul():
    shape = model_shape(AutoConfig.for_model("gpt2"))
    assert shape.parameters == 124_439_808 and shape.head_parameters == 0
    assert shape.matmul_parameters == shape.parameters - 1024 * 768  # only the position table is a pure lookup


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H20", 148.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA L4", 121.0), ("NVIDIA GeForce GTX 1080", None),
])
def test_gpu_peaks_match_device_names(name, peak):
    assert peak_tflops(name) == peak
