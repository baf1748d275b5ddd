# Hugging Face transformers on mha's attention: one import, then attn_implementation="mha".
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mha.integrations.transformers  # registers "mha" (attention and its mask function)

config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2)   # random weights, no download
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()       # or from_pretrained(..., attn_implementation="mha")
model.set_attn_implementation("mha")
ids = torch.randint(1, 1000, (2, 24))
mask = torch.ones_like(ids)
mask[1, :5] = 0                                # left padding: the mask function keeps it
with torch.no_grad():
    tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                            pad_token_id=0)
    logits = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    want = model(input_ids=ids, attention_mask=mask).logits
print("generated:", tuple(tokens.shape))
print("mha vs sdpa:", float((logits - want)[mask.bool()].abs().max()))
