"""The model architectures the engine serves, by the name in a checkpoint's config.json."""

from torch import nn


def model_class(architecture: str) -> type[nn.Module]:
    if architecture == "DeepseekV4ForCausalLM":
        from engine.models.deepseek_v4 import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM
    if architecture == "DeepseekV41ForCausalLM":
        from engine.models.deepseek_v41 import DeepseekV41ForCausalLM

        return DeepseekV41ForCausalLM
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM  # V3, and V2 (the same modules)
