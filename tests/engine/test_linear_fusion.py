"""fuse_linears: projections of one input as one GEMM, the originals left as views of it."""

import torch

from engine.config import QuantConfig
from engine.layers.fp8 import quantize_fp8_block
from engine.layers.linear import Linear, fuse_linears


def _fp8_linear(out_features: int, in_features: int, g: torch.Generator) -> Linear:
    layer = Linear(in_features, out_features, quant=QuantConfig(weight_block_size=(16, 16)))
    q, s = quantize_fp8_block(torch.randn(out_features, in_features, generator=g), (16, 16))
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    return layer


def test_fused_output_is_the_layers_side_by_side_and_shares_their_storage():
    g = torch.Generator().manual_seed(0)
    a, b = Linear(24, 8), Linear(24, 5)
    for m in (a, b):
        m.weight.data.copy_(torch.randn(m.weight.shape, generator=g))
    x = torch.randn(3, 24, generator=g)
    want = torch.cat([a(x), b(x)], dim=-1)
    fused = fuse_linears(a, b)
    assert torch.equal(fused(x), want)
    b.weight_loader(b.weight, torch.ones(5, 24))  # a later load into a layer lands in the fused weight
    assert torch.equal(fused.weight[8:], torch.ones(5, 24))
    assert a.weight.data_ptr() == fused.weight.data_ptr()


def test_fp8_layers_fuse_with_their_block_scales():
    g = torch.Generator().manual_seed(1)
    a, b = _fp8_linear(32, 48, g), _fp8_linear(40, 48, g)  # b ends in a partial block of rows
    x = torch.randn(4, 48, generator=g)
    want = torch.cat([a(x), b(x)], dim=-1)
    fused = fuse_linears(a, b)
    assert fused.weight_scale_inv.shape == (2 + 3, 3)
    assert torch.equal(fused(x), want)


def test_what_cannot_share_a_gemm_is_left_alone():
    g = torch.Generator().manual_seed(2)
    assert fuse_linears(_fp8_linear(40, 48, g), _fp8_linear(32, 48, g)) is None  # first ends off the block grid
    assert fuse_linears(Linear(24, 8, bias=True), Linear(24, 5)) is None
    assert fuse_linears(Linear(24, 8), Linear(16, 5)) is None


def test_a_fused_attention_follows_the_model_through_to(random_checkpoint):
    from engine import LLM

    model = LLM(str(random_checkpoint), dtype="float32").engine.runner.model
    attn = model.attention_layers()[0]
    attn.fuse()
    model.to(torch.float64)  # a cast (or a device move) copies every parameter
    fused = attn.fused_input_proj
    assert fused.weight.dtype == torch.float64
    kv_a = attn.kv_a_proj_with_mqa.weight
    assert kv_a.data_ptr() == fused.weight[fused.out_features - kv_a.shape[0]:].data_ptr()  # views again
