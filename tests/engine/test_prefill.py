"""Long prompts: the prefill runs in chunks of whole blocks and must equal the no-cache decoder."""
from __future__ import annotations

import torch
from checkpoints import write_checkpoint
from oracle import literal_decode

import compiledllm
from compiledllm.engine import generate


def test_chunked_prefill_matches_literal_decode(tmp_path):
    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "sdar", 4, max_position_embeddings=4096))
    prompt = torch.randint(2, model.config.vocab_size, (1, 1100), generator=torch.Generator().manual_seed(0))[0].tolist()
    policy = {"name": "threshold", "block_size": 8, "threshold": 0.5}
    out = generate(model, [prompt], policy, max_new_tokens=10)[0].output_ids  # 1096 prefilled: two chunks
    ref = literal_decode(lambda ids, bs: model.reference_forward(ids, bs), prompt, policy="threshold", block_size=8,
                         max_new_tokens=10, mask_id=model.mask_token_id, eos_id=model.eos_token_id, threshold=0.5)
    assert out == ref
