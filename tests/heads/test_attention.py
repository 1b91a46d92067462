"""The head's attention as ``heads.attention`` records it equals the reference module's own attention
(Cloudflare's ``joint_schema_model.py`` vendored in clef-finetune, its MultiheadAttention modules asked
for their weights), in f32 on tiny heads; recording leaves the logits' bytes as they were."""

from __future__ import annotations

import threading

import pytest
import torch

from clef_gguf.heads import JointSchemaHead
from clef_gguf.heads.attention import attention_weights, recording

CONFIGS = [dict(hidden_size=32, width=16, routing_layers=2, layers=3, heads=2, feedforward=24),
           dict(hidden_size=24, width=24, routing_layers=1, layers=2, heads=4, feedforward=16)]
BAR = 1e-6  # f32; measured <= 4e-8 (2 configs, 40 to 2,000 tokens)


def random_head(config: dict, seed: int) -> JointSchemaHead:
    head = JointSchemaHead(**config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            scale = 0.2 if p.ndim == 0 else 1 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=generator) * scale + (1.0 if "norm.weight" in name else 0.0))
    return head.eval()


def record_layout(tokens: int) -> tuple[list, list, list, list]:
    """Two questions (3 and 2 options) laid out in the last part of a ``tokens`` prompt."""
    question_spans = [(tokens - 30, tokens - 27), (tokens - 14, tokens - 11)]
    option_spans = [(tokens - 26, tokens - 24), (tokens - 23, tokens - 20), (tokens - 19, tokens - 16),
                    (tokens - 10, tokens - 7), (tokens - 6, tokens - 3)]
    return question_spans, option_spans, [3, 2], [1, 2]


def reference_attention(head: JointSchemaHead, hidden: torch.Tensor, ids: torch.Tensor, embedding: torch.Tensor,
                        layout: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(routing weights, deciding weights, logits) of the vendored reference head with ``head``'s
    weights, each MultiheadAttention called with need_weights=True (its own averaging over heads)."""
    from clef_finetune._vendor import joint_schema_model as jsm

    question_spans, option_spans, counts, types = layout
    reference = jsm.JointSchemaHead(**head.config).eval()
    missing = reference.load_state_dict(head.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    seen: dict[str, list[torch.Tensor]] = {"routing": [], "deciding": []}

    def hook(kind: str, module: torch.nn.MultiheadAttention):
        original = module.forward

        def forward(query, key, value, **kwargs):
            kwargs.update(need_weights=True, average_attn_weights=True)
            out, weights = original(query, key, value, **kwargs)
            seen[kind].append(weights[0])
            return out, weights
        module.forward = forward

    for block in reference.evidence_layers:
        hook("routing", block.attention)
    for block in reference.layers:
        hook("deciding", block.multihead_attn)
    questions, at = [], 0
    for q, (span, count, kind) in enumerate(zip(question_spans, counts, types)):
        questions.append(jsm.EncodedQuestion(f"q{q}", kind, span, tuple(option_spans[at:at + count]),
                                             tuple(str(i) for i in range(count))))
        at += count
    record = jsm.EncodedRecord(tuple(ids.tolist()), tuple(questions), "r")
    with torch.no_grad():
        logits = reference(hidden[None], ids[None], torch.ones(1, len(ids), dtype=torch.long), [record], embedding)
    return seen["routing"], seen["deciding"], [x for q in logits[0] for x in q]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("tokens", [40, 301])
def test_recorded_attention_equals_the_reference_modules(config, tokens):
    head = random_head(config, seed=tokens)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, config["hidden_size"], generator=generator)
    embedding = torch.randn(97, config["hidden_size"], generator=generator)
    ids = torch.randint(0, 97, (tokens,), generator=generator)
    layout = record_layout(tokens)
    question_spans, option_spans, counts, types = layout
    rows = torch.cat([embedding[ids[a:b]] for a, b in option_spans])
    with torch.inference_mode(), recording(head) as seen:
        logits = head(hidden, rows, question_spans, option_spans, counts, types)
    routing, deciding, reference_logits = reference_attention(head, hidden, ids, embedding, layout)
    assert len(seen.routing) == len(routing) == config["routing_layers"]
    assert len(seen.deciding) == len(deciding) == config["layers"]
    for ours, theirs in zip(seen.routing + seen.deciding, routing + deciding):
        assert ours.shape == theirs.shape and ours.dtype == torch.float32
        assert (ours - theirs).abs().max().item() < BAR
    assert torch.allclose(seen.routing[0].sum(-1), torch.ones(sum(counts)), atol=1e-5)
    assert (logits - torch.stack(reference_logits)).abs().max().item() < 1e-4
    owner = [0, 0, 0, 1, 1]
    mean = seen.option_rows(owner)
    expected = torch.stack([layer for layer in seen.routing] + [layer[owner] for layer in seen.deciding]).mean(0)
    assert torch.equal(mean, expected) and mean.shape == (5, tokens)


def test_recording_leaves_the_logits_bytes_and_hooks_alone():
    config = CONFIGS[0]
    head = random_head(config, seed=3)
    hidden = torch.randn(60, config["hidden_size"], generator=torch.Generator().manual_seed(4))
    question_spans, option_spans, counts, types = record_layout(60)
    rows = torch.randn(sum(b - a for a, b in option_spans), config["hidden_size"])
    with torch.inference_mode():
        plain = head(hidden, rows, question_spans, option_spans, counts, types)
        with recording(head):
            recorded = head(hidden, rows, question_spans, option_spans, counts, types)
        after = head(hidden, rows, question_spans, option_spans, counts, types)
    assert plain.numpy().tobytes() == recorded.numpy().tobytes() == after.numpy().tobytes()
    assert all(not m._forward_pre_hooks for m in head.modules())


def test_another_threads_forward_pass_is_not_recorded():
    config = CONFIGS[1]
    head = random_head(config, seed=5)
    hidden = torch.randn(50, config["hidden_size"])
    question_spans, option_spans, counts, types = record_layout(50)
    rows = torch.randn(sum(b - a for a, b in option_spans), config["hidden_size"])
    with torch.inference_mode(), recording(head) as seen:
        other = threading.Thread(target=head, args=(hidden, rows, question_spans, option_spans, counts, types))
        other.start()
        other.join()
        assert seen.routing == [] and seen.deciding == []
        head(hidden, rows, question_spans, option_spans, counts, types)
    assert len(seen.routing) == 1 and len(seen.deciding) == 2


def test_weights_of_a_bf16_module_are_float32_and_sum_to_one():
    config = CONFIGS[0]
    attention = random_head(config, seed=6).to(torch.bfloat16).evidence_layers[0].attention
    weights = attention_weights(attention, torch.randn(4, 16, dtype=torch.bfloat16),
                                torch.randn(9, 16, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32 and weights.shape == (4, 9)
    assert torch.allclose(weights.sum(-1), torch.ones(4), atol=1e-5)
