"""Our base configs build the model they say (no training: the ablation benchmark trains llama3_narrow)."""

import torch

from low_bits_training.titan.launch.bases import llama3_narrow


def test_narrow_is_the_debug_model_at_width_128_with_two_blocks():
    model = llama3_narrow().model_spec.model
    assert model.dim == 128 and len(model.layers) == 2 and model.vocab_size == 2048
    block = model.layers[0]
    wqkv, ffn = block.attention.qkv_linear.wqkv, block.feed_forward
    assert (wqkv.in_features, wqkv.out_features) == (128, 3 * 128)  # 8 heads of 16
    assert (ffn.w1.in_features, ffn.w1.out_features, ffn.w2.in_features) == (128, 512, 512)
    assert block.attention.rope.dim == 16 and model.lm_head.in_features == 128
    with torch.device("meta"):
        built = model.build()
    n = sum(p.numel() for p in built.parameters())
    # embeddings + head 2 x 2048 x 128, per block 128 x (384 + 128 + 3 x 512) + 2 norms, final norm
    assert n == 2 * 2048 * 128 + 2 * (128 * (384 + 128 + 3 * 512) + 2 * 128) + 128
