"""The fast path (Triton kernels, FP8 blocks kept, CUDA graphs on a GPU) against the reference path on
the HF-oracle checkpoints: same logits within tolerance, same greedy tokens wherever the reference's
choice is clear (its top-2 logit margin is above what the path difference can move)."""

import functools
import inspect
import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # see test_kernels_interpreted.py: Triton was imported compiled, so this runs in a fresh process
        pytest.skip("Triton was imported without its interpreter; see test_kernels_interpreted.py",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model_runner import resolve_backend
from engine.tools.make_random_checkpoint import quantize_checkpoint
from tests.engine.hf_oracle import YARN, build_hf_model, prompts, save_hf_checkpoint
from tests.engine.hf_oracle_v4 import VOCAB as V4_VOCAB
from tests.engine.hf_oracle_v4 import build_v4_model, quantize_v4_checkpoint

ON_GPU = torch.cuda.is_available()
NEW_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
gpu = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
# two layers: the dense one and an MoE one, each kind of layer and every kernel of the path once (a third
# layer would only run the MoE layer's kernels again)
LAYERS = 2


def v3_model(seed: int, **overrides):
    return build_hf_model(seed=seed, num_hidden_layers=LAYERS, **overrides)


@pytest.fixture(params=["float32", "bfloat16"] if ON_GPU else ["float32"])
def dtype(request) -> str:
    """Float32 shows whether the two paths compute the same function (the kernels multiply float32 in
    full float32); bf16 is what serves, where the fast path must be as close to the float32 truth as
    the reference path in bf16 is, and agree with it wherever its choice is clear."""
    return request.param


# on the interpreter every program of a grid runs in turn, and the decode kernels' default slice counts
# fill 132 SMs: 8-128 slices a row, where these short contexts fill the first (a slice holds at least one
# tile: 64 tokens of the latent cache, 16 rows of V4's key list) and the others exit empty. Capped at
# two, the live slice is the same and an empty one still follows it into the merge; a count of 1 (no
# merge) stays 1.
INTERPRETED_SLICES = 2


@pytest.fixture(autouse=True)
def few_decode_slices(monkeypatch):
    if ON_GPU:
        return
    from engine.kernels import compressed_decode, mla_decode

    for module in (mla_decode, compressed_decode):
        choose = module.default_num_splits
        capped = functools.wraps(choose)(lambda *args, choose=choose, **kwargs: min(INTERPRETED_SLICES,
                                                                                   choose(*args, **kwargs)))
        monkeypatch.setattr(module, "default_num_splits", capped)


# float32: logits within LOGIT_TOL of the reference's, identical greedy tokens wherever the
# reference's top-2 margin exceeds it. bf16: see assert_bf16_as_good.
LOGIT_TOL = 1e-3


def pair(path, dtype="float32", **engine_args) -> tuple[LLM, LLM]:
    # no prefix cache: LLM.score returns logits only for the tokens it computes, and the checks below
    # score the same prompts more than once
    engine_args.setdefault("enable_prefix_caching", False)
    ref = LLM(str(path), dtype=dtype, attention_backend="torch", **engine_args)
    fast = LLM(str(path), dtype=dtype, attention_backend="triton", **engine_args)
    assert fast.engine.runner.backend == "triton" and all(a.use_kernels for a in fast.engine.runner.model.attention_layers())
    return ref, fast


def assert_same_where_clear(ref: LLM, fast: LLM, batch: list[list[int]], dtype: str) -> list[torch.Tensor]:
    """Returns the fast path's logits for the batch (what fast.score(batch) gives)."""
    if dtype == "bfloat16":
        return assert_bf16_as_good(ref, fast, batch)
    by_fast = fast.score(batch)
    for ids, want, got in zip(batch, ref.score(batch), by_fast):
        diff = (want - got).abs().max().item()
        print(f"logits: max |diff| {diff:.3g}, max |ref| {want.abs().max().item():.3g}")
        assert diff <= LOGIT_TOL, f"max |logit diff| {diff:.3g} > {LOGIT_TOL}"
    assert_tokens_where_clear(ref, fast, batch, LOGIT_TOL)
    return by_fast


def assert_tokens_where_clear(ref: LLM, fast: LLM, batch: list[list[int]], margin: float, truth: LLM | None = None) -> None:
    """Greedy tokens part only where the reference's choice was not clear: where they part, the reference's
    token is not above the fast path's by more than `margin` in the teacher-forced logits of `truth`
    (default: the reference itself, where that is its top-2 margin)."""
    ref_outs, fast_outs = ref.generate(batch, GREEDY), fast.generate(batch, GREEDY)
    for ids, r, f in zip(batch, ref_outs, fast_outs):
        if r.token_ids == f.token_ids:
            continue
        # they part at step j: the reference must have been torn there (teacher-forced logits)
        j = next(i for i, (a, b) in enumerate(zip(r.token_ids, f.token_ids)) if a != b)
        logits = (truth or ref).score([ids + r.token_ids[:j]])[0][-1]
        lead = (logits[r.token_ids[j]] - logits[f.token_ids[j]]).item()
        print(f"paths part at step {j}: the reference's token leads the fast path's by {lead:.3g}")
        assert lead < margin, f"fast path chose {f.token_ids[j]} over a clear {r.token_ids[j]}"


def assert_bf16_as_good(ref: LLM, fast: LLM, batch: list[list[int]]) -> list[torch.Tensor]:
    """bf16 rounds at different points on the two paths: the fast path rounds the absorbed query and
    the attention's latent output to bf16 (as production MLA kernels do) where the reference path keeps
    float32, and on these small random models (weights of std 0.15, near-tied experts) rounding alone
    moves logits a lot. So the float32 reference path is the truth: the fast path's relative error
    against it must stay within half again the bf16 reference path's, or within 0.2 (measured on an
    H200: 0.07-0.15 where the reference path's is 0.02; a wrong kernel lands near 1). Tokens must
    agree wherever the reference's top-2 margin exceeds twice what bf16 moved either path's logits.

    What bf16 moved is measured over the prompt AND the positions the greedy tokens come from (the
    truth's own continuation, teacher-forced): one rounding that flips a near-tied expert there moves a
    logit by up to ~1 (HF transformers in bf16 does it too: seed 22's second prompt at step 3 picks a
    token float32 ranks sixth), and a bound taken from the prompt alone would call that a wrong kernel.
    Where the paths part, the float32 truth judges: the fast path's token may not trail the reference
    path's by more than that bound."""
    truth = LLM(str(ref.engine.model_path), dtype="float32", attention_backend="torch", enable_prefix_caching=False)
    continued = [ids + out.token_ids for ids, out in zip(batch, truth.generate(batch, GREEDY))]
    want, by_ref, by_fast = truth.score(continued), ref.score(continued), fast.score(continued)
    prompt = lambda logits: [l[:len(ids)] for ids, l in zip(batch, logits)]
    rel = lambda got: (sum(((g.float() - w) ** 2).sum() for g, w in zip(prompt(got), prompt(want)))
                       / sum((w ** 2).sum() for w in prompt(want))).sqrt().item()
    move = lambda got: max((g.float() - w).abs().max().item() for g, w in zip(got, want))
    err_ref, err_fast = rel(by_ref), rel(by_fast)
    noise = max(move(by_ref), move(by_fast))
    print(f"bf16 vs float32 truth: reference path {err_ref:.3g}, fast path {err_fast:.3g}; "
          f"max |logit move| {noise:.3g}")
    assert err_fast <= max(1.5 * err_ref, 0.2), f"fast path error {err_fast:.3g} vs reference path {err_ref:.3g}"
    # where the paths part, each is judged by the float32 truth: the fast path may take the truth's choice
    # where bf16 flipped the reference path's (seed 22 at step 3 on an H200)
    assert_tokens_where_clear(ref, fast, batch, max(2 * noise, 0.1), truth)
    return prompt(by_fast)


def test_fast_path_matches_reference(tmp_path, dtype):
    hf = v3_model(21, rope_parameters=YARN)
    ref, fast = pair(save_hf_checkpoint(hf, tmp_path / "ckpt"), dtype)
    assert_same_where_clear(ref, fast, prompts(21, [7, 21]), dtype)


def test_v4_fast_path_matches_reference(tmp_path, dtype):
    """DeepSeek-V4: the Triton projections and MoE kernels (V4's SwiGLU limit in them), decode steps on
    the path without host lists (CUDA graphs on a GPU), against the reference path."""
    hf = build_v4_model(seed=31)
    ref, fast = pair(save_hf_checkpoint(hf, tmp_path / "ckpt"), dtype, block_size=8, max_model_len=256)
    assert (fast.engine.runner.graphs is not None) == ON_GPU
    assert_same_where_clear(ref, fast, prompts(31, [9, 40], V4_VOCAB), dtype)


@gpu  # on a CPU the reference's PyTorch paths over the pages: tests/engine/test_v4_window_pages.py
def test_v4_fast_path_through_few_window_pages_matches_reference(tmp_path, dtype):
    """The window in 8 pages of its own for 2 sequences of 5-9 blocks: the decode graphs and kernels read
    it through the block -> page map the plans rewrite as pages move between blocks."""
    hf = build_v4_model(seed=32)
    ref, fast = pair(save_hf_checkpoint(hf, tmp_path / "ckpt"), dtype, block_size=8, max_model_len=256,
                     num_window_pages=8, max_num_batched_tokens=32)
    pool = fast.engine.runner.kv_pool
    assert pool.has_window_pages and pool.cache(0, "window").shape[0] == 9
    assert_same_where_clear(ref, fast, prompts(32, [40, 70], V4_VOCAB), dtype)
    assert fast.engine.block_manager.num_held_pages == 0


def test_v4_fp8_and_mxfp4_checkpoint_keeps_them_and_matches_reference(tmp_path, dtype):
    """DeepSeek-V4 as it ships: FP8 blocks (attention projections, the indexer's wq_b, the shared expert)
    and MXFP4 routed experts stay quantized on the fast path (FP8 GEMV / GEMM, the grouped wo_a, the FP4
    MoE GEMV at decode and the FP4 grouped GEMM at prefill), against the same math in PyTorch: FP8
    activations per token group, the MXFP4 experts dequantized (kernels off for the quantized layers)."""
    from engine.kernels.fp8_gemm import FP8

    # two layers, a hash-routed window one and a CSA one (its indexer's wq_b): every quantized kind once.
    # (Seed 33 has two indexer scores within float32 noise: its top-k pick, a discrete choice, flips.)
    hf = build_v4_model(seed=34, num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"],
                        layer_types=["sliding_attention", "compressed_sparse_attention"])
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    quantize_v4_checkpoint(hf, path, (16, 16))
    dequantized, fast = pair(path, dtype, block_size=8, max_model_len=256)
    model = fast.engine.runner.model
    attn, experts = model.layers[1].attn, model.layers[1].ffn.experts
    assert attn.wq_a.weight.dtype == attn.wo_a.weight.dtype == attn.indexer.wq_b.weight.dtype == FP8
    assert model.layers[1].ffn.shared_experts.w2.weight.dtype == FP8
    assert experts.w13.dtype == torch.int8 and experts.w13_scale_inv.dtype == torch.float8_e8m0fnu
    assert dequantized.engine.runner.model.layers[1].ffn.experts.w13.dtype != torch.int8
    # decode steps (2 tokens) take the FP4 GEMV, prefills the grouped GEMMs (by default the GEMV takes up to
    # 128 tokens): layer 0's experts dequantized first (the engine's choice from one pair an expert on),
    # layer 1's decoded tile by tile in the FP4 grouped GEMM
    for layer in model.layers:
        layer.ffn.experts.gemv_max_tokens = 2
    model.layers[1].ffn.experts.dequantize_pairs_per_expert = float("inf")
    emulated = LLM(str(path), dtype=dtype, attention_backend="triton", enable_prefix_caching=False, block_size=8,
                   max_model_len=256)
    for module in emulated.engine.runner.model.modules():
        if getattr(module, "block", None) is not None or getattr(module, "fp4", False):
            module.use_kernels = False
    batch = prompts(34, [7, 18], V4_VOCAB)  # decode rows (GEMVs) and prefill chunks (GEMMs)
    by_fast = assert_same_where_clear(emulated, fast, batch, dtype)
    # against the dequantized weights (what HF runs) only the FP8 activation rounding differs: it shows on
    # these small random models (0.18 measured), but stays bounded
    for want, got in zip(dequantized.score(batch), by_fast):
        assert ((want - got.float()).norm() / want.norm()).item() < 0.5


@pytest.mark.skipif(ON_GPU, reason="two ranks need two GPUs; without a GPU they run interpreted, on the CPU")
def test_fast_path_over_two_ranks_matches_one_rank_reference(tmp_path):
    """The kernels on each rank's slice (split heads; whole experts, the pairs routed elsewhere weighing
    0; the split experts' kernels are the one-rank kernels at other shapes), gloo collectives between the
    two processes (interpreted: the one parallel fast-path case the suite's time allows)."""
    hf = v3_model(27, rope_parameters=YARN)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    ref = LLM(str(path), dtype="float32", attention_backend="torch", enable_prefix_caching=False)
    fast = LLM(str(path), dtype="float32", attention_backend="triton", enable_prefix_caching=False, device="cpu",
               tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert_same_where_clear(ref, fast, prompts(27, [6, 13]), "float32")
    finally:
        fast.engine.shutdown()


def test_small_batch_experts_as_gemvs_match_reference(tmp_path, dtype):
    hf = v3_model(25)
    ref, fast = pair(save_hf_checkpoint(hf, tmp_path / "ckpt"), dtype)
    experts = [m for m in fast.engine.runner.model.modules() if type(m).__name__ == "FusedExperts"]
    for m in experts:
        m.gemv_max_tokens = 4  # decode steps of up to 4 sequences take the GEMV path, prefills do not
    assert_same_where_clear(ref, fast, prompts(25, [6, 11]), dtype)


def test_fast_path_chunked_prefill_over_cached_prefix(tmp_path, dtype):
    hf = v3_model(22, rope_parameters=YARN)
    # a 3-token budget splits every prompt into chunks that attend to their cached prefix (the 7-token
    # prompt into three, the later two starting mid-block)
    ref, fast = pair(save_hf_checkpoint(hf, tmp_path / "ckpt"), dtype, max_num_batched_tokens=3, block_size=4)
    assert_same_where_clear(ref, fast, prompts(22, [7, 4]), dtype)


def test_fp8_kv_cache_fast_path_matches_reference(tmp_path, dtype):
    """The FP8 latent cache on both paths (the writer kernel quantizes as the reference does; the decode
    kernel dequantizes in its loads). A 24-token budget: the first step's 21-token prompt and 3 tokens of
    the other take the plain prefill; the other's last token, a 1-token chunk over its cached prefix, the
    absorbed kernel beside the first one's decode; then decode steps."""
    path = save_hf_checkpoint(v3_model(23, rope_parameters=YARN), tmp_path / "ckpt")
    ref, fast = pair(path, dtype, kv_cache_dtype="fp8", max_num_batched_tokens=24, block_size=4)
    assert fast.engine.runner.kv_pool.caches[0].dtype == torch.uint8
    assert_same_where_clear(ref, fast, prompts(23, [21, 4]), dtype)


def save_fp8_checkpoint(hf, path, block: tuple[int, int]):
    """The HF model saved with its weights as FP8 e4m3 blocks (DeepSeek's checkpoint format) -> its directory."""
    path = save_hf_checkpoint(hf, path)
    save_file(quantize_checkpoint(load_file(str(path / "model.safetensors")), block), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_fp8_checkpoint_keeps_blocks_and_matches_reference(tmp_path, dtype):
    path = save_fp8_checkpoint(v3_model(23, rope_parameters=YARN), tmp_path / "ckpt", (16, 16))
    dequantized, fast = pair(path, dtype)
    layer = fast.engine.runner.model.model.layers[1]
    assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn and layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.kv_b_proj.weight.dtype != torch.float8_e4m3fn  # absorbed at decode: kept dequantized
    assert dequantized.engine.runner.model.model.layers[1].mlp.experts.w13.dtype != torch.float8_e4m3fn
    # the FP8 kernels quantize activations per token group as DeepSeek's inference does; their
    # reference is that math in PyTorch (same FP8 blocks, kernels switched off for FP8 layers)
    emulated = LLM(str(path), dtype=dtype, attention_backend="triton", enable_prefix_caching=False)
    for module in emulated.engine.runner.model.modules():
        if getattr(module, "block", None) is not None:
            module.use_kernels = False
    batch = prompts(23, [9, 8])  # prefill chunks of at most 16 tokens: the absorbed attention path
    by_fast = assert_same_where_clear(emulated, fast, batch, dtype)
    # against bf16-style dequantized weights the activation rounding shows, but stays bounded
    for want, got in zip(dequantized.score(batch), by_fast):
        assert ((want - got).norm() / want.norm()).item() < 0.5


@gpu
def test_cuda_graph_decode_matches_eager(tmp_path, dtype):
    hf = build_hf_model(seed=24)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    graphs = LLM(str(path), dtype=dtype)
    assert graphs.engine.runner.graphs is not None
    batch = prompts(24, [7, 12, 30])
    outs = graphs.generate(batch, GREEDY)
    assert graphs.engine.runner.graphs.graphs  # decode steps were replayed from graphs
    ref = LLM(str(path), dtype=dtype, attention_backend="torch")
    assert_same_where_clear(ref, graphs, batch, dtype)
    assert [o.token_ids for o in outs] == [o.token_ids for o in graphs.generate(batch, GREEDY)]


class UncapturedGraphs:
    """What a decode graph computes (`DecodeGraphs._step` over its static buffers), run eagerly: the
    graph steps' semantics (a prefill chunk's tokens as rows) checked where no GPU captures them."""

    @staticmethod
    def install(runner) -> None:
        from engine.model_runner import DecodeGraphs

        graphs = DecodeGraphs(runner)

        def replay(batch: int):
            hidden, logits, tokens = graphs._step(graphs.padded(batch))
            return hidden[:batch], logits[:batch], tokens[:batch]

        graphs.replay = replay
        runner.graphs = graphs


def test_graph_steps_prefill_and_decode_as_eager_steps_do(tmp_path):
    path = save_hf_checkpoint(v3_model(28), tmp_path / "ckpt")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    batch = prompts(28, [3, 4])  # 7 prefill rows: a graph step of 8, one of them padding
    eager = LLM(str(path), dtype="float32", attention_backend="triton", block_size=4,
                extra={"enforce_eager": True, "capture_graphs_at_start": False})
    graphed = LLM(str(path), dtype="float32", attention_backend="triton", block_size=4,
                  extra={"capture_graphs_at_start": False})
    UncapturedGraphs.install(graphed.engine.runner)
    eager_steps = []
    run_eager = graphed.engine.runner._run_eager
    graphed.engine.runner._run_eager = lambda *args: eager_steps.append(1) or run_eager(*args)
    want, got = eager.generate(batch, params), graphed.generate(batch, params)
    turn = batch[1] + got[1].token_ids + [7, 8]  # a next turn: its new tokens over a cached prefix
    want += eager.generate([turn], params)
    got += graphed.generate([turn], params)
    assert not eager_steps and got[-1].num_cached_tokens > 0  # prefills and decodes took the graph rows
    assert_same_outputs(want, got)


def eager_and_graphed(path, max_num_seqs: int) -> tuple[LLM, LLM]:
    """The fast path eager, and with its graphs' bodies run eagerly (`UncapturedGraphs`): float32, blocks of
    four tokens, steps of up to 48 tokens, nothing captured at start."""
    args = dict(dtype="float32", attention_backend="triton", block_size=4, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=48)
    eager = LLM(str(path), **args, extra={"enforce_eager": True, "capture_graphs_at_start": False})
    graphed = LLM(str(path), **args, extra={"capture_graphs_at_start": False})
    UncapturedGraphs.install(graphed.engine.runner)
    return eager, graphed


def fill_caches(*llms: LLM) -> None:
    """Every latent cache row set to 7.0: rows no step writes keep it (`assert_same_caches`)."""
    for llm in llms:
        for layer in llm.engine.runner.model.attention_layers():
            layer.kv_cache.fill_(7.0)


def assert_same_caches(eager: LLM, graphed: LLM) -> None:
    """Every block but the scratch one holds what the eager engine wrote there, or nothing: the graphs'
    padding rows wrote the scratch block only."""
    scratch = graphed.engine.runner.kv_pool.scratch_block
    layers = zip(graphed.engine.runner.model.attention_layers(), eager.engine.runner.model.attention_layers())
    for mine, theirs in layers:
        assert torch.allclose(mine.kv_cache[:scratch], theirs.kv_cache[:scratch], atol=1e-5)


def assert_same_outputs(want, got) -> None:
    """Same tokens, and top log-probs within LOGIT_TOL at every step."""
    for w, g in zip(want, got):
        assert w.token_ids == g.token_ids
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert lw.keys() == lg.keys() and all(abs(lw[t] - lg[t]) < LOGIT_TOL for t in lw)


class UncapturedPrefillGraphs:
    """What a prefill graph computes (`PrefillGraphs._step` over its static buffers), run eagerly, with
    lengths padded to multiples of `multiple` rows; `sizes_run` records the padded length of each step it ran."""

    @staticmethod
    def install(runner, max_tokens: int, multiple: int):
        from engine.model_runner import PrefillGraphs

        smallest = runner.graphs.max_batch + 1
        graphs = PrefillGraphs(runner, PrefillGraphs.lengths(smallest, max_tokens, multiple), None, smallest)
        graphs.sizes_run = []
        graphs.replay = lambda size: graphs.sizes_run.append(size) or graphs._step(size)
        runner.prefill_graphs = graphs
        return graphs


def test_prefill_graph_steps_prefill_as_eager_steps_do(tmp_path):
    """One fresh prompt a step, padded to its graph's length (or not padded at all), or a long prompt's
    first chunk: the prompts' first tokens' distributions and their cache rows are the eager step's; the
    padding rows touch the scratch block only; the chunk after a first one (over its cached prefix) and
    a scored prompt stay eager."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=3)
    eager, graphed = eager_and_graphed(save_hf_checkpoint(v3_model(29), tmp_path / "ckpt"), max_num_seqs=2)
    runner = graphed.engine.runner
    graphs = UncapturedPrefillGraphs.install(runner, max_tokens=48, multiple=24)
    assert graphs.sizes == [24, 48]  # from 3 rows (the decode graphs take 2) to the step budget
    fill_caches(eager, graphed)
    eager_steps, run_eager = [], runner._run_eager
    runner._run_eager = lambda *a: eager_steps.append(a[0].num_tokens) or run_eager(*a)
    batch = prompts(29, [21, 24, 60])
    want, got = [], []
    for ids in batch:  # one prompt a step
        want += eager.generate([ids], params)
        got += graphed.generate([ids], params)
    # 24 tokens: no padding rows (an empty second sequence); 60: a first chunk of 48, then 12 eagerly over
    # the cached 48
    assert graphs.sizes_run == [24, 24, 48] and eager_steps == [12]
    scored = prompts(32, [30])
    assert torch.allclose(eager.score(scored)[0], graphed.score(scored)[0], atol=LOGIT_TOL)
    assert graphs.sizes_run == [24, 24, 48] and eager_steps == [12, 30]  # every position's logits: eager
    assert_same_outputs(want, got)
    scratch = runner.kv_pool.scratch_block
    assert all((layer.kv_cache[:scratch] != 7.0).any() for layer in eager.engine.runner.model.attention_layers())
    assert_same_caches(eager, graphed)


class HostAccess:
    """Records what a CUDA graph cannot capture, as the operators run on the CPU: item(), int(t) and
    bool(t); data-dependent shapes (nonzero, masked_select, unique, an index by a boolean mask,
    repeat_interleave without its output size); torch.tensor(data) (a copy from the host); tolist()
    (which reads a CPU tensor without dispatching)."""

    FORBIDDEN = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default,
                 torch.ops.aten.unique_consecutive.default, torch.ops.aten.lift_fresh.default,
                 torch.ops.aten.lift_fresh_copy.default}

    @staticmethod
    def data_dependent(func, args, kwargs) -> bool:
        if func is torch.ops.aten.index.Tensor:
            return any(i is not None and i.dtype == torch.bool for i in args[1])
        if func is torch.ops.aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        return func in HostAccess.FORBIDDEN

    def __init__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if HostAccess.data_dependent(func, args, kwargs or {}):
                    seen.append(str(func))
                return func(*args, **(kwargs or {}))

        class Lists(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.tolist:
                    seen.append("tolist")
                return func(*args, **(kwargs or {}))

        self.modes = (Ops(), Lists())

    def __enter__(self):
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


def test_graph_bodies_never_wait_for_the_device(tmp_path):
    """The prefill graph's body and every piece of the piecewise graphs read nothing back to the host
    and copy nothing from it (`HostAccess`), checked on the CPU where they run eagerly."""
    path = save_hf_checkpoint(v3_model(30), tmp_path / "ckpt")
    llm = LLM(str(path), dtype="float32", attention_backend="triton", block_size=4, max_num_seqs=2,
              extra={"capture_graphs_at_start": False})
    runner = llm.engine.runner
    UncapturedGraphs.install(runner)
    graphs = UncapturedPrefillGraphs.install(runner, max_tokens=48, multiple=24)
    pieces = UncapturedPiecewise.install(runner, max_tokens=48, multiple=24)
    graphs.length.fill_(11)
    with HostAccess() as access:
        logits = graphs._step(24)
        for i in range(len(pieces.layers) + 1):
            pieces._piece(24, i)
    assert logits.shape == (1, runner.model_config.vocab_size) and torch.isfinite(logits).all()
    assert torch.isfinite(pieces.hidden[:24]).all()
    assert not access.seen, f"a graph's body reads or copies on the host: {sorted(set(access.seen))}"


class UncapturedPiecewise:
    """What the piecewise graphs compute (`PiecewiseGraphs._piece` over their static buffers), run eagerly;
    `sizes_run` records each step's padded length."""

    @staticmethod
    def install(runner, max_tokens: int, multiple: int):
        from engine.model_runner import PiecewiseGraphs

        smallest = runner.graphs.max_batch + 1
        pieces = PiecewiseGraphs(runner, PiecewiseGraphs.lengths(smallest, max_tokens, multiple), None, smallest)
        pieces.sizes_run = []

        def replay(size: int, i: int) -> None:
            if i == 0:
                pieces.sizes_run.append(size)
            pieces._piece(size, i)

        pieces._capture = lambda size: pieces.graphs.setdefault(size, [])
        pieces.replay = replay
        runner.piecewise = pieces
        return pieces


def test_piecewise_steps_run_as_eager_steps_do(tmp_path):
    """Steps of a prompt and part of another, of that one's last chunk beside a third prompt and a decode
    row, of a chunk over a cached prefix, and a scored prompt, in pieces around their eager attention: the
    same log-probs, tokens, scores and cache as the eager engine's, and the model's whole forward never
    runs for them."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=3)
    eager, graphed = eager_and_graphed(save_hf_checkpoint(v3_model(34), tmp_path / "ckpt"), max_num_seqs=4)
    runner = graphed.engine.runner
    pieces = UncapturedPiecewise.install(runner, max_tokens=48, multiple=24)
    assert pieces.sizes == [24, 48]  # from 5 rows (the decode graphs take 4) to the step budget
    fill_caches(eager, graphed)
    whole, forward = [], runner.model.forward
    runner.model.forward = lambda ids, *a, **k: (len(ids) > 4 and whole.append(len(ids))) or forward(ids, *a, **k)
    batch = prompts(34, [21, 40, 10])
    # 48 tokens (the first prompt, 27 of the second); 24 (the second's 13, the third's 10, a decode row)
    want, got = eager.generate(batch, params), graphed.generate(batch, params)
    assert pieces.sizes_run[:2] == [48, 24]
    turn = batch[1] + got[1].token_ids + list(range(5, 25))  # a chunk over a cached prefix
    want += eager.generate([turn], params)
    got += graphed.generate([turn], params)
    assert pieces.sizes_run[2:] == [24] and not whole
    assert_same_outputs(want, got)
    scored = prompts(35, [30])
    assert torch.allclose(eager.score(scored)[0], graphed.score(scored)[0], atol=LOGIT_TOL)
    assert pieces.sizes_run[3:] == [48] and not whole
    assert_same_caches(eager, graphed)


@gpu
def test_fresh_prompts_replay_the_prefill_graphs(tmp_path, dtype):
    path = save_hf_checkpoint(build_hf_model(seed=32), tmp_path / "ckpt")
    fast = LLM(str(path), dtype=dtype, block_size=4, prefill_graph_tokens=512)
    assert_prefill_graphs_as_eager(path, fast, dtype, [100, 512, 300], [256, 512, 512], [256, 512], block_size=4)


def production_tiles_model(seed: int):
    """A small model of DeepSeek's head widths whose projections and experts fill 128 x 128 FP8 blocks."""
    return build_hf_model(seed=seed, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256,
                          q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, num_experts_per_tok=4, max_position_embeddings=2048,
                          initializer_range=0.02)


@gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fp8_prefill_graphs_at_production_tiles(tmp_path, kv_cache_dtype):
    """The prefill graphs over the paths a small model does not reach: FP8 128 x 128 blocks (cuBLAS's
    block-scaled GEMM from 256 rows, the persistent TMA expert GEMMs), the TMA prefill attention (192-wide
    keys), the two-kernel expert alignment (more than 4,096 pairs), and the FP8 latent cache."""
    path = save_fp8_checkpoint(production_tiles_model(33), tmp_path / "ckpt", (128, 128))
    args = dict(block_size=64, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=1280)
    fast = LLM(str(path), dtype="bfloat16", **args, prefill_graph_tokens=1280)
    assert fast.engine.runner.model.model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert_prefill_graphs_as_eager(path, fast, "bfloat16", [100, 1100, 300], [256, 1280, 512],
                                   [256, 512, 768, 1024, 1280], **args)
    # steps of 1280 rows (two prompts), then 321 (a chunk, a prompt, a decode row: the one-row GEMV path
    # over the queries' buffer), then the next turn's chunk
    assert_piecewise_as_eager(path, fast, "bfloat16", [600, 900, 100], **args)


@gpu
def test_fp8_projections_of_a_few_rows_on_the_tensor_cores_match_reference(tmp_path, monkeypatch):
    """FP8 128 x 128 blocks, which the projections' tensor-core GEMV takes (`gemv.DOT`, the default): prefill
    chunks and decode steps of 2 to 16 rows read each projection's weight once for all of their rows (K
    split into slices for the small ones), against the same FP8 math in PyTorch (kernels off for the FP8
    layers)."""
    from engine.kernels import gemv as gemv_module

    path = save_fp8_checkpoint(production_tiles_model(35), tmp_path / "ckpt", (128, 128))
    rows, real = [], gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw))
    fast = LLM(str(path), dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=16)
    emulated = LLM(str(path), dtype="bfloat16", attention_backend="triton", enable_prefix_caching=False,
                   max_num_batched_tokens=16)
    for module in emulated.engine.runner.model.modules():
        if getattr(module, "block", None) is not None:
            module.use_kernels = False
    assert_same_where_clear(emulated, fast, prompts(35, [11, 30, 5]), "bfloat16")
    assert gemv_module.DOT and any(1 < r <= 16 for r in rows)


@gpu
def test_gluon_prefill_in_the_engine_keeps_its_outputs(tmp_path, monkeypatch):
    """`mla_prefill.GLUON` and `fused_moe.GLUON` (Hopper's default) on a Hopper card: a model of
    DeepSeek's head widths with FP8 128 x 128 experts prefills through both Gluon kernels (inside the
    prefill graphs captured at start, and eagerly over a cached prefix), its first tokens' distributions
    within bf16 noise of the Triton kernels' and the same tokens where clear."""
    from engine.kernels import fused_moe, fused_moe_gluon, mla_prefill, mla_prefill_gluon

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are built for Hopper")
    hf = build_hf_model(seed=39, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256,
                        q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, num_experts_per_tok=4, max_position_embeddings=4096, initializer_range=0.02)
    path = save_fp8_checkpoint(hf, tmp_path / "ckpt", (128, 128))
    args = dict(dtype="bfloat16", block_size=64, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    batch = prompts(39, [100, 1100, 2500])
    turn = batch[1] + prompts(40, [600])[0]  # a next turn: a chunk over 1,100 cached tokens
    monkeypatch.setattr(mla_prefill, "GLUON", False)
    monkeypatch.setattr(fused_moe, "GLUON", False)
    triton_path = LLM(str(path), **args)
    want = [triton_path.generate([ids], params)[0] for ids in batch + [turn]]
    calls = []
    for module, name in ((mla_prefill_gluon, "ws_prefill"), (fused_moe_gluon, "ws_fused_experts")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    monkeypatch.setattr(mla_prefill, "GLUON", True)
    monkeypatch.setattr(fused_moe, "GLUON", True)
    gluon = LLM(str(path), **args)
    got = [gluon.generate([ids], params)[0] for ids in batch + [turn]]
    assert {"ws_prefill", "ws_fused_experts"} <= set(calls) and got[-1].num_cached_tokens >= 1024
    for w, g in zip(want, got):
        common = [t for t in w.logprobs[0] if t in g.logprobs[0]]
        assert len(common) >= 4 and all(abs(w.logprobs[0][t] - g.logprobs[0][t]) < 0.1 for t in common)
        first, second = sorted(w.logprobs[0].values(), reverse=True)[:2]
        if first - second > 0.1:
            assert g.token_ids[0] == w.token_ids[0]


def assert_same_tokens_within_bf16_noise(want, got) -> None:
    """Two greedy outputs of one prompt through two kernel paths: each step's top log-probs within 0.05, the
    same tokens up to the first that differs, and that one a near tie bf16 rounding may break either way."""
    for i, (w, g) in enumerate(zip(want.logprobs, got.logprobs)):
        common = [t for t in w if t in g]
        assert len(common) >= 4 and all(abs(w[t] - g[t]) < 0.05 for t in common)
        if got.token_ids[i] != want.token_ids[i]:
            first, second = sorted(w.values(), reverse=True)[:2]
            assert first - second < 0.1
            break


@gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gluon_decode_in_the_engine_keeps_its_tokens(tmp_path, monkeypatch, kv_cache_dtype):
    """`mla_decode.GLUON` on a Hopper card: decode steps (CUDA graphs, the engine's 16-token pages) through
    the Gluon split kernel give the Triton kernel's tokens and log-probs within bf16 noise, one stream at a
    context spanning many slices and three streams at once, over bf16 rows and the FP8 cache."""
    from engine.kernels import mla_decode, mla_decode_gluon

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is built for Hopper")
    hf = build_hf_model(seed=42, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096,
                        initializer_range=0.02)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    batch = prompts(42, [2000, 300, 900])
    args = dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setattr(mla_decode, "GLUON", False)
    triton_path = LLM(str(path), **args)
    want = [triton_path.generate([batch[0]], params)[0]] + triton_path.generate(batch, params)
    del triton_path
    calls, split = [], mla_decode_gluon.split
    monkeypatch.setattr(mla_decode_gluon, "split", lambda *a, **k: calls.append(1) or split(*a, **k))
    monkeypatch.setattr(mla_decode, "GLUON", True)
    gluon = LLM(str(path), **args)
    got = [gluon.generate([batch[0]], params)[0]] + gluon.generate(batch, params)
    assert calls and gluon.engine.runner.graphs is not None
    for w, g in zip(want, got):
        assert_same_tokens_within_bf16_noise(w, g)


@gpu
def test_folded_chunks_keep_a_next_turns_tokens(tmp_path, monkeypatch):
    """`attention.FOLD_CHUNKS`: a conversation's next turn (a short chunk over a cached prefix of ~2k
    tokens, absorbed) with its tokens folded into the decode kernel's heads gives the unfolded path's
    tokens and log-probs within bf16 noise."""
    from engine.kernels import mla_decode
    from engine.layers import attention

    hf = build_hf_model(seed=43, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        max_position_embeddings=4096, initializer_range=0.02)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    first = prompts(43, [2000])[0]
    turn = first + prompts(44, [9])[0]  # nine new tokens over the first turn's cached blocks
    args = dict(dtype="bfloat16", enable_prefix_caching=True)
    plain = LLM(str(path), **args)
    plain.generate([first], params)
    want = plain.generate([turn], params)[0]
    del plain
    folds, attend = [], mla_decode.mla_decode_attention
    monkeypatch.setattr(mla_decode, "mla_decode_attention",
                        lambda *a, **k: folds.append(k.get("queries_per_seq", 1)) or attend(*a, **k))
    monkeypatch.setattr(attention, "FOLD_CHUNKS", True)
    folded = LLM(str(path), **args)
    folded.generate([first], params)
    got = folded.generate([turn], params)[0]
    assert got.num_cached_tokens >= 1024 and max(folds) > 1
    assert_same_tokens_within_bf16_noise(want, got)


@gpu
def test_mixed_steps_replay_the_piecewise_graphs(tmp_path, dtype):
    path = save_hf_checkpoint(build_hf_model(seed=36), tmp_path / "ckpt")
    args = dict(block_size=4, max_num_batched_tokens=512)
    fast = LLM(str(path), dtype=dtype, **args, prefill_graph_tokens=512)
    assert sorted(fast.engine.runner.piecewise.graphs) == [256, 512]  # captured at start
    assert_piecewise_as_eager(path, fast, dtype, [300, 400, 90], **args)


def assert_piecewise_as_eager(path, fast: LLM, dtype: str, lengths: list[int], **engine_args) -> None:
    """Prompts of `lengths` sent together (steps of several prompts, then one's last chunk beside the
    others' decode rows), then a next turn over the first one's cached prefix, through `fast`'s piecewise
    graphs: the log-probs of every step against the eager engine's, and no step of more rows than the
    decode graphs take ran the model's whole forward."""
    runner = fast.engine.runner
    pieces, limit = runner.piecewise, runner.graphs.max_batch
    replayed, replay = [], pieces.replay
    pieces.replay = lambda size, i: (replayed.append(size) if i == 0 else None, replay(size, i))[1]
    whole, forward = [], runner.model.forward
    runner.model.forward = lambda ids, *a, **k: (whole.append(len(ids)) if len(ids) > limit else None,
                                                 forward(ids, *a, **k))[1]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    batch = prompts(37, lengths)
    outs = fast.generate(batch, params)
    turn = batch[0] + outs[0].token_ids + prompts(38, [150])[0]
    outs += fast.generate([turn], params)
    assert len(replayed) >= 3 and not whole
    eager = LLM(str(path), dtype=dtype, **engine_args, extra={"enforce_eager": True})
    want = eager.generate(batch, params) + eager.generate([turn], params)
    tol = LOGIT_TOL if dtype == "float32" else 0.1
    for w, g in zip(want, outs):
        for j, (lw, lg) in enumerate(zip(w.logprobs, g.logprobs)):  # up to where the tokens part
            common = [t for t in lw if t in lg]
            assert len(common) >= 3 and all(abs(lw[t] - lg[t]) < tol for t in common)
            if w.token_ids[j] != g.token_ids[j]:  # only where the eager engine's choice was not clear
                first, second = sorted(lw.values(), reverse=True)[:2]
                assert first - second <= tol
                break


def assert_prefill_graphs_as_eager(path, fast: LLM, dtype: str, lengths: list[int], padded: list[int],
                                   sizes: list[int], **engine_args) -> None:
    """Prompts of `lengths` one a step through `fast`'s captured prefill graphs (of `sizes`, replayed at
    `padded`, a longer prompt's tail left in the buffers before a shorter one), their first tokens'
    distributions against the eager engine's."""
    graphs = fast.engine.runner.prefill_graphs
    assert sorted(graphs.graphs) == graphs.sizes == sizes  # captured at start
    replayed, replay = [], graphs.replay
    graphs.replay = lambda size: replayed.append(size) or replay(size)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    batch = prompts(32, lengths)
    outs = [fast.generate([ids], params)[0] for ids in batch]  # one prompt a step
    assert replayed == padded
    eager = LLM(str(path), dtype=dtype, **engine_args, extra={"enforce_eager": True})
    tol = LOGIT_TOL if dtype == "float32" else 0.1
    for w, g in zip(eager.generate(batch, params), outs):
        common = [t for t in w.logprobs[0] if t in g.logprobs[0]]
        assert len(common) >= 4 and all(abs(w.logprobs[0][t] - g.logprobs[0][t]) < tol for t in common)
        first, second = sorted(w.logprobs[0].values(), reverse=True)[:2]
        if first - second > tol:  # a clear choice: the same first token
            assert g.token_ids[0] == w.token_ids[0]


@gpu
def test_short_prefill_steps_replay_the_decode_graphs(tmp_path, dtype):
    path = save_hf_checkpoint(build_hf_model(seed=27), tmp_path / "ckpt")
    fast = LLM(str(path), dtype=dtype, block_size=4)
    model = fast.engine.runner.model
    eager, forward = [], model.forward
    model.forward = lambda *args, **kwargs: eager.append(1) or forward(*args, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    batch = prompts(27, [7, 12, 30])
    outs = fast.generate(batch, params)
    turn = batch[2] + outs[2].token_ids + [5, 6, 7]  # a next turn: a chunk over a cached prefix
    outs += fast.generate([turn], params)
    assert not eager and outs[-1].num_cached_tokens > 0  # every step replayed a graph
    # the prefill steps' distributions (each request's first logprobs) match the eager fast path's
    eager_path = LLM(str(path), dtype=dtype, block_size=4, extra={"enforce_eager": True})
    want = eager_path.generate(batch + [turn], params)
    tol = LOGIT_TOL if dtype == "float32" else 0.1
    for w, g in zip(want, outs):
        common = w.logprobs[0].keys() & g.logprobs[0].keys()
        assert len(common) >= 4 and all(abs(w.logprobs[0][t] - g.logprobs[0][t]) < tol for t in common)


def test_warm_up_runs_the_fast_path_and_every_decode_slice_count(tmp_path):
    from engine.kernels.mla_decode import SPLIT_CHOICES, default_num_splits

    hf = v3_model(26)
    llm = LLM(str(save_hf_checkpoint(hf, tmp_path / "ckpt")), dtype="float32", attention_backend="triton",
              max_num_batched_tokens=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    for layer in runner.model.attention_layers():
        layer.kv_cache[-1].zero_()  # graph capture at start may have written the scratch block already
    before = [layer.kv_cache.clone() for layer in runner.model.attention_layers()]
    runner.warm_up()
    for layer, old in zip(runner.model.attention_layers(), before):
        assert torch.equal(layer.kv_cache[:-1], old[:-1]) and not torch.equal(layer.kv_cache[-1], old[-1])
    # serving can only meet the slice counts warmed up (the engine's own choice, not the cap above)
    choose = inspect.unwrap(default_num_splits)
    assert {choose(b, h) for b in range(1, 300) for h in (16, 128)} <= set(SPLIT_CHOICES)


def test_backend_choice_is_checked(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch" and resolve_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="invalid attention_backend"):
        resolve_backend("flash", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", cpu)
