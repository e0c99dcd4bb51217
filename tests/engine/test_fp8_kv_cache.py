"""The FP8 latent cache (`kv_cache_dtype="fp8"`) through the engine, on the HF-oracle checkpoints (CPU,
float32 activations, the reference attention path; the kernels' FP8 reads are held to that path in
test_kernels.py): how far its logits drift from HF's, how long greedy decoding agrees, the prefix cache
over FP8 blocks, FP8 blocks over the KV transfer, and the key that keeps bf16 and FP8 replicas apart."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, model_fingerprint
from engine.kv.transfer import BlockLayout, KVTransferServer, TcpTransport, TransferError
from engine.layers.fp8_latent import FP8LatentLayout
from tests.engine.hf_oracle import YARN, build_hf_model, hf_greedy, hf_logits, prompts, save_hf_checkpoint

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# measured on this checkpoint (docs/engine.md, "KV cache"): a bf16 cache's rounding alone moves the logits
# by 0.0036 on average, the FP8 cache's by 0.074 (e4m3 keeps 3 mantissa bits to bf16's 7: 16x the step).
# These random tiny models (initializer_range 0.15) amplify any perturbation far more than trained ones.
MAX_DRIFT_OVER_BF16 = 30  # mean |logit - HF|, FP8 cache over bf16 cache
MAX_MEAN_DRIFT = 0.1  # mean |logit - HF| as a fraction of the logits' std
MIN_TOP1 = 0.8  # positions whose argmax is HF's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model(seed=1, rope_parameters=YARN)
    return hf, save_hf_checkpoint(hf, tmp_path_factory.mktemp("fp8kv") / "ckpt")


def _llm(path, kv_cache_dtype="fp8", **kw):
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype, **kw)


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens generated alike before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def _drift(llm, hf, batch):
    """(|logit - HF| at every position of every prompt, argmax agreement per position, HF's logits)."""
    pairs = [(ours, hf_logits(hf, ids)) for ids, ours in zip(batch, llm.score(batch))]
    drift = torch.cat([(o - r).abs().flatten() for o, r in pairs])
    top1 = torch.cat([o.argmax(-1) == r.argmax(-1) for o, r in pairs]).float()
    return drift, top1, torch.cat([r.flatten() for _, r in pairs])


def test_fp8_cache_logit_drift_and_greedy_agreement(checkpoint):
    hf, path = checkpoint
    # chunks of 16 over pages of 4: most rows a chunk attends to come back from the cache
    fp8 = _llm(path, block_size=4, max_num_batched_tokens=16)
    bf16 = _llm(path, "bf16", block_size=4, max_num_batched_tokens=16)  # bf16 cache, float32 activations
    assert all(c.dtype == torch.uint8 and c.shape[-1] == FP8LatentLayout(32, 8, torch.float32).token_bytes
               for c in fp8.engine.runner.kv_pool.caches)
    assert all(c.dtype == torch.bfloat16 for c in bf16.engine.runner.kv_pool.caches)
    batch = prompts(0, [5, 17, 33, 64])
    drift, top1, logits = _drift(fp8, hf, batch)
    drift_bf16, top1_bf16, _ = _drift(bf16, hf, batch)
    hf_tokens = [hf_greedy(hf, ids, NEW_TOKENS) for ids in batch]
    alike = lambda llm: sum(_agreement(o.token_ids, h) for o, h in zip(llm.generate(batch, GREEDY), hf_tokens))
    alike_fp8, alike_bf16 = alike(fp8), alike(bf16)
    print(f"mean |logit - HF| fp8 {drift.mean():.4f} (max {drift.max():.3f}) bf16 {drift_bf16.mean():.4f} "
          f"(max {drift_bf16.max():.3f}), logit std {logits.std():.2f}; top-1 fp8 {top1.mean():.3f} bf16 "
          f"{top1_bf16.mean():.3f}; greedy tokens alike before the first difference fp8 {alike_fp8} bf16 "
          f"{alike_bf16} of {NEW_TOKENS * len(batch)}")
    assert drift_bf16.mean() < drift.mean() <= MAX_DRIFT_OVER_BF16 * drift_bf16.mean()
    assert drift.mean() <= MAX_MEAN_DRIFT * logits.std() and top1.mean() >= MIN_TOP1
    assert alike_fp8 >= 4  # the first tokens of most prompts


def test_prefix_cache_over_fp8_blocks(checkpoint):
    _, path = checkpoint
    llm = _llm(path, block_size=4)
    prompt = prompts(3, [40])[0]
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt + [7]], GREEDY)[0]  # the prompt's full blocks come from the cache
    assert again.num_cached_tokens >= 36
    cold = _llm(path, block_size=4, enable_prefix_caching=False).generate([prompt + [7]], GREEDY)[0]
    assert again.token_ids == cold.token_ids and first.token_ids  # the cached FP8 rows read as written


def test_fp8_blocks_move_as_bytes_and_a_bf16_replica_is_refused(checkpoint):
    _, path = checkpoint
    fp8, plain = _llm(path), _llm(path, kv_cache_dtype="auto")
    assert fp8.engine.model_key != plain.engine.model_key
    fp8.generate(prompts(4, [30]), GREEDY)  # blocks with content
    caches = torch.stack(fp8.engine.runner.kv_pool.caches)  # [layers, blocks, block_size, token_bytes] uint8
    layout = BlockLayout((caches.shape[0], *caches.shape[2:]), caches.dtype)
    hashes = [i.to_bytes(16, "big") for i in range(4)]

    def gather(wanted, out):
        for n, h in enumerate(wanted):
            out[n] = caches[:, int.from_bytes(h, "big")]
        return len(wanted)

    server = KVTransferServer("127.0.0.1", 0, fp8.engine.model_key, layout, gather)
    server.start()
    try:
        got = TcpTransport(fp8.engine.model_key, 2.0).pull(f"127.0.0.1:{server.port}", hashes)
        data = got.data
        assert data.dtype == torch.uint8 and torch.equal(data.reshape(4, -1), caches[:, :4].transpose(0, 1).reshape(4, -1))
        got.release()
        with pytest.raises(TransferError, match="model mismatch"):
            TcpTransport(plain.engine.model_key, 2.0).pull(f"127.0.0.1:{server.port}", hashes)
    finally:
        server.stop()


def test_kv_cache_dtype_is_checked_and_keys_the_model(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp16")
    assert model_fingerprint(tmp_path, "torch.bfloat16", 16) == model_fingerprint(tmp_path, "torch.bfloat16", 16,
                                                                                   kv_cache_dtype="bf16")
    assert model_fingerprint(tmp_path, "torch.bfloat16", 16) != model_fingerprint(tmp_path, "torch.bfloat16", 16,
                                                                                   kv_cache_dtype="fp8")


def test_v4_refuses_the_fp8_latent_cache(tmp_path):
    from tests.engine.hf_oracle_v4 import build_v4_model

    path = save_hf_checkpoint(build_v4_model(seed=31), tmp_path / "v4")
    with pytest.raises(ValueError, match="V3-family MLA latent cache"):
        LLM(str(path), dtype="float32", device="cpu", kv_cache_dtype="fp8", block_size=8, max_model_len=256)
