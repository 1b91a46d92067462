"""A random Clef release in Hugging Face format, for testing the pipeline without downloading anything.

``build_release(out_dir, preset="tiny", seed=0)`` writes what a real ``Cloudflare/clef-flash`` checkout
holds, at toy size: ``config.json`` (``Qwen3_5ForConditionalGeneration`` with text and vision
sub-configs), bf16 ``model*.safetensors`` with the exact Hugging Face tensor names (a tiny vision
tower and an MTP block included, so the converter has something to skip), a byte-level BPE
``tokenizer.json`` trained here on a built-in corpus, ``tokenizer_config.json``, the image and video
processor files sized for the tiny tower, and the joint head files. Transformers is deliberately not
imported: this must run after a plain ``pip install``.

The weights are seeded noise scaled so that every block contributes O(1) to the residual stream;
a converter bug in any tensor (a wrong V-head order, a missing ``+1`` on a norm) then shows up as
an O(1) difference in the hidden states rather than hiding under numerical noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from clef_gguf.convert.synthetic.corpus import CORPUS
from clef_gguf.formats import files

# Qwen's pre-tokenizer regex (Qwen3.5 adds \p{M} so combining marks stay with their letters).
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens in Qwen's order. Control tokens are "special"; the tool/think tags are not, which is
# what makes llama.cpp type them USER_DEFINED and HF split them even with special handling off.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
PLAIN_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                      "<think>", "</think>")

_TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 16, "in_channels": 3}

# The processor files a Hub release ships, sized for the tiny tower: one merged token covers 8x8 pixels
# (patch 4, merge 2); images keep 16x16 (4 tokens) to 64x64 pixels (64 tokens), so a 100x100 image
# resizes; video bounds count all frames (4 frames of 64x64 at most).
_TINY_PROCESSOR = {"patch_size": _TINY_VISION["patch_size"], "temporal_patch_size": _TINY_VISION["temporal_patch_size"],
                   "merge_size": _TINY_VISION["spatial_merge_size"], "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"}
TINY_IMAGE_PROCESSOR = {**_TINY_PROCESSOR, "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
                        "image_processor_type": "Qwen2VLImageProcessorFast"}
TINY_VIDEO_PROCESSOR = {**_TINY_PROCESSOR, "size": {"shortest_edge": 2 * 16 * 16, "longest_edge": 4 * 64 * 64},
                        "video_processor_type": "Qwen3VLVideoProcessor"}

PRESETS: dict[str, dict] = {
    # Everything small; 3 linear-attention layers + 1 full-attention layer; 4 value heads over 2 key
    # heads so the V-head reordering is exercised; partial rotary 8 of 32 dims -> 4 rope pairs.
    "tiny": dict(hidden=64, layers=4, interval=4, ffn=128, heads=4, kv_heads=2, head_dim=32,
                 lin_k_heads=2, lin_v_heads=4, lin_head_dim=16, bpe_vocab=512, vocab_size=640,
                 mrope=[2, 1, 1], rope_theta=10_000_000.0, max_pos=32768, shards=1,
                 head=dict(hidden_size=64, width=32, routing_layers=2, layers=2, heads=2,
                           feedforward=64)),
    # Every matmul row is a multiple of 256, so all K- and IQ-quant block sizes fit.
    "tiny256": dict(hidden=256, layers=4, interval=4, ffn=512, heads=4, kv_heads=2, head_dim=64,
                    lin_k_heads=2, lin_v_heads=4, lin_head_dim=64, bpe_vocab=512, vocab_size=768,
                    mrope=[3, 3, 2], rope_theta=10_000_000.0, max_pos=32768, shards=1,
                    head=dict(hidden_size=256, width=64, routing_layers=2, layers=2, heads=2,
                              feedforward=128)),
    # ~120M parameters (hidden 512, 12 layers 3:1, a 65,536-token vocab): big enough that the
    # tower dominates a decision as it does for Clef-Flash, small enough to build in seconds.
    "small": dict(hidden=512, layers=12, interval=4, ffn=1536, heads=8, kv_heads=2, head_dim=128,
                  lin_k_heads=4, lin_v_heads=8, lin_head_dim=64, bpe_vocab=512, vocab_size=65536,
                  mrope=[6, 5, 5], rope_theta=10_000_000.0, max_pos=262144, shards=1,
                  head=dict(hidden_size=512, width=128, routing_layers=2, layers=2, heads=4,
                            feedforward=512)),
    # Qwen3.5-9B proportions at hidden 1024 (~0.66B parameters): 24 layers 3:1, ffn 3x, head_dim
    # 256 with partial rotary 64 and the real [11, 11, 10] sections, 8 value heads over 4 key heads.
    # Only for timing measurements: building it writes ~1.3 GB.
    "medium": dict(hidden=1024, layers=24, interval=4, ffn=3072, heads=8, kv_heads=2, head_dim=256,
                   lin_k_heads=4, lin_v_heads=8, lin_head_dim=128, bpe_vocab=512, vocab_size=151936,
                   mrope=[11, 11, 10], rope_theta=10_000_000.0, max_pos=262144, shards=2,
                   head=dict(hidden_size=1024, width=256, routing_layers=2, layers=4, heads=4,
                             feedforward=1024)),
    # Qwen3.5-0.8B's shape (hidden 1024, 24 layers 3:1, ffn 3584, 16/16 linear heads of 128, the
    # full 248,320 vocab): the GPU check's latency model for the nvfp4 backend. Writes ~1.7 GB.
    "qwen08b": dict(hidden=1024, layers=24, interval=4, ffn=3584, heads=8, kv_heads=2, head_dim=256,
                    lin_k_heads=16, lin_v_heads=16, lin_head_dim=128, bpe_vocab=512, vocab_size=248320,
                    mrope=[11, 11, 10], rope_theta=10_000_000.0, max_pos=262144, shards=2,
                    head=dict(hidden_size=1024, width=256, routing_layers=2, layers=4, heads=4,
                              feedforward=1024)),
}


# --------------------------------------------------------------------------- tokenizer

def build_tokenizer(bpe_vocab: int):
    """Train the byte-level BPE and add Qwen's added tokens. Returns a ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    # One "document" per line keeps the trainer input order-stable, so merges are reproducible.
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    return tok


def full_size_tokenizer(tok, vocab_size: int, seed: int = 0):
    """``tok`` grown to ``vocab_size`` ids, as large as a release's (Clef-Flash: 248,320 tokens and about as
    many merges): deterministic random merges of the tokens it has, ranked after its own, at the ids its
    added tokens leave free. Its memory is a real tokenizer's (the text it encodes keeps its trained
    merges first); for memory measurements at the real size."""
    import json
    import random

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    taken = set(vocab.values()) | {a["id"] for a in spec["added_tokens"]}
    free = (i for i in range(vocab_size) if i not in taken)
    rng, pool = random.Random(seed), list(vocab)
    budget = vocab_size - len(taken)
    while budget > 0:
        first, second = rng.choice(pool), rng.choice(pool[:4096])
        merged = first + second
        if merged in vocab or len(merged) > 24:
            continue
        vocab[merged] = next(free)
        merges.append([first, second] if merges and isinstance(merges[0], list) else f"{first} {second}")
        pool.append(merged)
        budget -= 1
    return Tokenizer.from_str(json.dumps(spec))


def tokenizer_config(tok) -> dict:
    decoder = {}
    for text in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS:
        decoder[str(tok.token_to_id(text))] = {
            "content": text, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": text in SPECIAL_TOKENS}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
            "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
            "errors": "replace", "model_max_length": 262144, "pad_token": "<|endoftext|>",
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


# --------------------------------------------------------------------------- config

def _layer_types(p: dict) -> list[str]:
    return ["full_attention" if (i + 1) % p["interval"] == 0 else "linear_attention"
            for i in range(p["layers"])]


def make_config(p: dict, tok) -> dict:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    text = {
        "model_type": "qwen3_5_text", "vocab_size": p["vocab_size"], "hidden_size": p["hidden"],
        "intermediate_size": p["ffn"], "num_hidden_layers": p["layers"],
        "num_attention_heads": p["heads"], "num_key_value_heads": p["kv_heads"],
        "head_dim": p["head_dim"], "hidden_act": "silu", "max_position_embeddings": p["max_pos"],
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": p["lin_head_dim"],
        "linear_value_head_dim": p["lin_head_dim"], "linear_num_key_heads": p["lin_k_heads"],
        "linear_num_value_heads": p["lin_v_heads"], "layer_types": _layer_types(p),
        "full_attention_interval": p["interval"], "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": p["rope_theta"],
                            "partial_rotary_factor": 0.25, "mrope_section": list(p["mrope"]),
                            "mrope_interleaved": True},
        "bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": None,
        "dtype": "bfloat16",
    }
    vision = {"model_type": "qwen3_5_vision", "hidden_act": "gelu_pytorch_tanh",
              "out_hidden_size": p["hidden"], "initializer_range": 0.02, **_TINY_VISION}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text, "vision_config": vision,
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"], "tie_word_embeddings": False,
            "dtype": "bfloat16"}


# --------------------------------------------------------------------------- tensor list
# Each entry: (name, shape, init) where init is (kind, scale). Kinds: "normal" (scale = std),
# "zc_norm" (zero-centred RMSNorm weight, ~0), "norm" (plain weight, ~1), "a_log", "zeros".

def _decoder_layer(pre: str, p: dict, kind: str, out_scale: float) -> list[tuple]:
    H, F, hd = p["hidden"], p["ffn"], p["head_dim"]
    lin = lambda n_in: ("normal", 1.0 / math.sqrt(n_in))  # noqa: E731 - keeps the table short
    out = [(pre + "input_layernorm.weight", [H], ("zc_norm", 0.1)),
           (pre + "post_attention_layernorm.weight", [H], ("zc_norm", 0.1))]
    if kind == "full_attention":
        nq, nkv = p["heads"] * hd, p["kv_heads"] * hd
        out += [(pre + "self_attn.q_proj.weight", [2 * nq, H], lin(H)),  # query and gate per head
                (pre + "self_attn.k_proj.weight", [nkv, H], lin(H)),
                (pre + "self_attn.v_proj.weight", [nkv, H], lin(H)),
                (pre + "self_attn.o_proj.weight", [H, nq], ("normal", out_scale / math.sqrt(nq))),
                (pre + "self_attn.q_norm.weight", [hd], ("zc_norm", 0.1)),
                (pre + "self_attn.k_norm.weight", [hd], ("zc_norm", 0.1))]
    else:
        kd, vd = p["lin_k_heads"] * p["lin_head_dim"], p["lin_v_heads"] * p["lin_head_dim"]
        nv = p["lin_v_heads"]
        out += [(pre + "linear_attn.in_proj_qkv.weight", [2 * kd + vd, H], lin(H)),
                (pre + "linear_attn.in_proj_z.weight", [vd, H], lin(H)),
                (pre + "linear_attn.in_proj_b.weight", [nv, H], lin(H)),
                (pre + "linear_attn.in_proj_a.weight", [nv, H], lin(H)),
                (pre + "linear_attn.conv1d.weight", [2 * kd + vd, 1, 4], ("normal", 0.5)),
                (pre + "linear_attn.dt_bias", [nv], ("normal", 0.5)),
                (pre + "linear_attn.A_log", [nv], ("a_log", 0.0)),
                (pre + "linear_attn.norm.weight", [p["lin_head_dim"]], ("norm", 0.1)),
                (pre + "linear_attn.out_proj.weight", [H, vd], ("normal", out_scale / math.sqrt(vd)))]
    out += [(pre + "mlp.gate_proj.weight", [F, H], lin(H)),
            (pre + "mlp.up_proj.weight", [F, H], lin(H)),
            (pre + "mlp.down_proj.weight", [H, F], ("normal", out_scale / math.sqrt(F)))]
    return out


def vision_tensors(p: dict, vision: dict | None = None) -> list[tuple]:
    """The release's ``model.visual.*`` tensors for the vision config ``vision`` (default: the tiny one)."""
    v, pre, w = vision or _TINY_VISION, "model.visual.", ("normal", 0.02)
    D, I, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2  # noqa: E741
    patch = [D, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"]]
    out = [(pre + "patch_embed.proj.weight", patch, w), (pre + "patch_embed.proj.bias", [D], ("zeros", 0)),
           (pre + "pos_embed.weight", [v["num_position_embeddings"], D], w)]
    for j in range(v["depth"]):
        b = f"{pre}blocks.{j}."
        out += [(b + "norm1.weight", [D], ("norm", 0)), (b + "norm1.bias", [D], ("zeros", 0)),
                (b + "norm2.weight", [D], ("norm", 0)), (b + "norm2.bias", [D], ("zeros", 0)),
                (b + "attn.qkv.weight", [3 * D, D], w), (b + "attn.qkv.bias", [3 * D], ("zeros", 0)),
                (b + "attn.proj.weight", [D, D], w), (b + "attn.proj.bias", [D], ("zeros", 0)),
                (b + "mlp.linear_fc1.weight", [I, D], w), (b + "mlp.linear_fc1.bias", [I], ("zeros", 0)),
                (b + "mlp.linear_fc2.weight", [D, I], w), (b + "mlp.linear_fc2.bias", [D], ("zeros", 0))]
    out += [(pre + "merger.norm.weight", [D], ("norm", 0)), (pre + "merger.norm.bias", [D], ("zeros", 0)),
            (pre + "merger.linear_fc1.weight", [merged, merged], w),
            (pre + "merger.linear_fc1.bias", [merged], ("zeros", 0)),
            (pre + "merger.linear_fc2.weight", [p["hidden"], merged], w),
            (pre + "merger.linear_fc2.bias", [p["hidden"]], ("zeros", 0))]
    return out


def tensor_specs(p: dict) -> list[tuple]:
    """Every tensor of the release, in checkpoint order, with its shape and init rule."""
    H, V = p["hidden"], p["vocab_size"]
    # Shrink residual-branch outputs with depth so 24 random layers stay finite; at 4 layers each
    # branch still moves the residual stream by O(1).
    out_scale = 1.0 / math.sqrt(max(1.0, p["layers"] / 4))
    lm = "model.language_model."
    specs = [(lm + "embed_tokens.weight", [V, H], ("normal", 1.0))]
    for i, kind in enumerate(_layer_types(p)):
        specs += _decoder_layer(f"{lm}layers.{i}.", p, kind, out_scale)
    specs += [(lm + "norm.weight", [H], ("zc_norm", 0.1)),
              ("lm_head.weight", [V, H], ("normal", 1.0 / math.sqrt(H)))]
    specs += vision_tensors(p)
    # One multi-token-prediction block, as the real checkpoints carry (transformers ignores mtp.*).
    specs += [("mtp.fc.weight", [H, 2 * H], ("normal", 1.0 / math.sqrt(2 * H))),
              ("mtp.pre_fc_norm_embedding.weight", [H], ("zc_norm", 0.1)),
              ("mtp.pre_fc_norm_hidden.weight", [H], ("zc_norm", 0.1)),
              ("mtp.norm.weight", [H], ("zc_norm", 0.1))]
    specs += _decoder_layer("mtp.layers.0.", p, "full_attention", out_scale)
    return specs


def strong_vision_tensor(name: str, tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A vision tensor of a release redrawn at O(1) scale (the tests' and benches' "strong" releases:
    the tiny release's own vision weights, ~0.02, barely move its answers): biases and norms spread by
    0.3, positions unit, matrices (and the Conv3d kernel) unit gain over their fan-in."""
    noise = torch.randn(tensor.shape, generator=gen)
    if name.endswith(".bias"):
        value = 0.3 * noise
    elif "norm" in name:
        value = 1.0 + 0.3 * noise
    elif name.endswith("pos_embed.weight"):
        value = noise
    else:
        value = noise / math.sqrt(tensor[0].numel())
    return value.to(tensor.dtype)


def init_tensor(shape: list[int], rule: tuple, gen: torch.Generator) -> torch.Tensor:
    kind, scale = rule
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "a_log":  # decay rates A in [0.5, 4): moderate forgetting, so the state matters
        return torch.log(0.5 + 3.5 * torch.rand(shape, generator=gen))
    x = torch.randn(shape, generator=gen) * scale
    return x + 1.0 if kind == "norm" else x


def _write_weights(out: Path, specs: list[tuple], shards: int, seed: int) -> list[str]:
    """Write bf16 safetensors, sharded by size with an index when ``shards > 1``."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [math.prod(shape) * 2 for _, shape, _ in specs]
    total, acc = sum(sizes), 0
    bounds: list[int] = []
    target = total / max(1, shards)
    for k, size in enumerate(sizes):  # cut points where the running size crosses a multiple
        acc += size
        if len(bounds) < shards - 1 and acc >= target * (len(bounds) + 1) and k < len(specs) - 1:
            bounds.append(k + 1)
    groups = [specs[a:b] for a, b in zip([0] + bounds, bounds + [len(specs)])]
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map = {}
    for fname, group in zip(names, groups):
        # Generated shard by shard in one fixed order: the values do not depend on the sharding.
        tensors = {name: init_tensor(shape, rule, gen).to(torch.bfloat16) for name, shape, rule in group}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / files.SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_head(out: Path, head_config: dict, seed: int) -> None:
    # The head package owns the module tree and the file format; the weights are random_head's.
    from clef_gguf.convert.synthetic.head import random_head
    from clef_gguf.heads import save_head

    head = random_head(dict(head_config), seed)
    save_head(head, out, dtype=torch.bfloat16)
    cfg_path = out / "joint_head_config.json"
    if not cfg_path.is_file():  # in case save_head writes only the weights
        cfg_path.write_text(json.dumps(head_config, indent=2) + "\n")


def build_release(out_dir, *, preset: str = "tiny", seed: int = 0, shards: int | None = None,
                  with_head: bool = True) -> Path:
    """Write a random Clef release (Hugging Face layout) into ``out_dir`` and return its path.

    ``shards`` overrides the preset's number of ``model-*.safetensors`` files (>1 adds the index).
    RANDOM WEIGHTS: the result is for exercising the pipeline only; its answers mean nothing.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(p["bpe_vocab"])
    if tok.get_vocab_size(with_added_tokens=True) >= p["vocab_size"]:
        raise ValueError("preset vocab_size must exceed the tokenizer so the embedding has padding rows")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(make_config(p, tok), indent=2) + "\n")
    _write_weights(out, tensor_specs(p), shards or p["shards"], seed)
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_IMAGE_PROCESSOR, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(TINY_VIDEO_PROCESSOR, indent=2) + "\n")
    if with_head:
        write_head(out, p["head"], seed)
    (out / "RANDOM_WEIGHTS.json").write_text(json.dumps(
        {"warning": "RANDOM WEIGHTS - for testing the pipeline only", "preset": preset,
         "seed": seed, "generator": "clef_gguf.convert.synthetic.tiny.build_release"}, indent=2) + "\n")
    return out
