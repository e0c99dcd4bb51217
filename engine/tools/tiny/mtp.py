"""The multi-token-prediction (MTP) layer of DeepSeek-V3, for training and export in the published layout.

Position i combines the main model's final hidden state h_i (after its last norm, as vLLM, SGLang and
transformers feed it) with the embedding of token i+1, runs one more decoder block and predicts token i+2:
    logits_i = head(shared_head.norm(block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))))
Embedding and head are the main model's (shared, as in the V3 paper); the checkpoint stores copies of them
under the MTP layer's prefix, as DeepSeek does.
"""

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm


class MTPLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # Its index is num_hidden_layers, past first_k_dense_replace: an MoE block, like V3's layer 61.
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head_norm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings) -> torch.Tensor:
        """hidden, next_embeds: [B, S, H] -> normed hidden states for the token after next, [B, S, H]."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        # No mask: SDPA then runs causal attention over the whole (unpadded) window.
        x = self.block(x, attention_mask=None, position_embeddings=position_embeddings)
        return self.shared_head_norm(x)


def mtp_logits(model, mtp: MTPLayer, hidden: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor):
    """Logits for tokens i+2 from the main model's final hidden states at i and the ids at i+1."""
    embeds = model.model.embed_tokens(next_ids)
    position_embeddings = model.model.rotary_emb(embeds, position_ids=position_ids)
    return model.lm_head(mtp(hidden, embeds, position_embeddings))


def published_mtp_tensors(model, mtp: MTPLayer, layer_idx: int) -> dict[str, torch.Tensor]:
    """The MTP layer under DeepSeek's names: model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,...}."""
    from .export import published_layer_tensors

    prefix = f"model.layers.{layer_idx}."
    tensors = {
        prefix + "enorm.weight": mtp.enorm.weight,
        prefix + "hnorm.weight": mtp.hnorm.weight,
        prefix + "eh_proj.weight": mtp.eh_proj.weight,
        prefix + "shared_head.norm.weight": mtp.shared_head_norm.weight,
        prefix + "shared_head.head.weight": model.lm_head.weight,
        prefix + "embed_tokens.weight": model.model.embed_tokens.weight,
    }
    tensors.update(published_layer_tensors(mtp.block.state_dict(), prefix))
    return tensors
