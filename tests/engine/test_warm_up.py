"""ModelRunner.warm_up: prefill steps of every power-of-two size run through the model at start-up
(so kernel variants compile before serving) and touch nothing but the scratch cache block."""

import logging

import pytest
import torch

from engine import LLM, SamplingParams


def test_warm_up_runs_every_step_size_into_the_scratch_block_only(random_checkpoint, monkeypatch, caplog):
    llm = LLM(str(random_checkpoint), dtype="float32", max_num_batched_tokens=100, enable_prefix_caching=False)
    runner = llm.engine.runner
    for layer in runner.model.attention_layers():
        layer.kv_cache[-1].zero_()  # graph capture at start may have written the scratch block already
    before = [layer.kv_cache.clone() for layer in runner.model.attention_layers()]
    sizes = []
    run = runner._run_eager  # warm-up runs eagerly: the steps the graphs do not take need these kernels
    monkeypatch.setattr(runner, "_run_eager", lambda plan, **kw: (sizes.append(plan.query_lens[0]), run(plan, **kw))[1])
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        runner.warm_up()
    assert sorted(set(sizes)) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert len(sizes) == 16  # each size fresh and over a cached prefix
    for layer, old in zip(runner.model.attention_layers(), before):
        assert torch.equal(layer.kv_cache[:-1], old[:-1])  # the blocks sequences own are untouched
        assert not torch.equal(layer.kv_cache[-1], old[-1])  # the scratch block took the writes
    assert "warmed up the prefill kernels" in caplog.text
    monkeypatch.undo()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].token_ids) == 2  # the engine serves on after it


def test_on_compile_reports_each_kernel_build_and_never_skips_it():
    import triton

    from engine.kernels._util import on_compile

    built = []
    on_compile(built.append)
    try:
        hook = triton.knobs.runtime.jit_cache_hook
        # as Triton calls it before building a variant (runtime/jit.py `_call_hook`); a true return
        # value would skip the build
        spec = '{"name": "_rms_norm_kernel", "signature": {"X": "*bf16"}, "attrs": [[[0], [["tt.divisibility", 16]]]]}'
        assert not hook(key="k", repr="_rms_norm_kernel[num_warps=4](X: (", fn=None,
                        compile={"key": "k", "specialization_data": spec, "num_warps": 4},
                        is_manual_warmup=False, already_compiled=False)
        assert not hook(key="k", repr="_rms_norm_kernel[num_warps=4](X: (", fn=None, compile={},
                        is_manual_warmup=False, already_compiled=False)
        assert built == [spec, "_rms_norm_kernel[num_warps=4](X: ("]
    finally:
        on_compile(None)
    assert triton.knobs.runtime.jit_cache_hook is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel variants are compiled on a GPU only")
def test_serving_builds_no_kernel_variant_after_warm_up(random_checkpoint, caplog):
    """Steps of every kind a server meets (prefill chunks alone and beside decodes, over cached prefixes,
    batch sizes and context lengths that vary step by step) run on the variants built at start-up."""
    llm = LLM(str(random_checkpoint), dtype="bfloat16", max_num_batched_tokens=64, block_size=16)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 200, (40,), generator=g).tolist()
    caplog.clear()  # only what serving builds counts, not this engine's own start-up
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        for batch in (1, 3, 7, 13, 20, 33):
            prompts = [shared[: int(torch.randint(1, 40, (1,), generator=g))]
                       + torch.randint(3, 200, (int(torch.randint(1, 300, (1,), generator=g)),), generator=g).tolist()
                       for _ in range(batch)]
            params = [SamplingParams(max_tokens=int(torch.randint(1, 40, (1,), generator=g)),
                                     temperature=float(torch.rand(1, generator=g)), seed=i) for i in range(batch)]
            llm.generate(prompts, params)
    assert "after warm-up" not in caplog.text
