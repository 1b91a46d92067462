"""The joint schema head of Clef (spec §4): final hidden states of one prompt in, one logit per option out.

The module tree and parameter names are those of Cloudflare's ``joint_schema_model.py`` (spec §1.2), so the
released ``joint_head.safetensors`` loads strictly into it. The forward pass processes one record, like the
reference; within the record it batches whatever can be batched without changing the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clef_gguf.core.questions import QUESTION_TYPES

# Both learned temperatures are exponentiated and capped at a multiplier of 100; there is no lower cap.
LOG_100 = math.log(100.0)

# Row order of ``type_embedding``; the runtime passes these ints in ``types``.

Span = tuple[int, int]


class EvidenceRoutingLayer(nn.Module):
    """One pre-norm block in which option queries cross-attend to the prompt (§4 D).

    Queries never attend to each other, so options of one record stay independent here.
    """

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.feedforward_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        # Dropout placeholders keep the release indices: linear layers at 0 and 3.
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(feedforward, width),
            nn.Dropout(dropout),
        )

    def forward(self, options: Tensor, memory: Tensor) -> Tensor:
        # The routing blocks (unlike the decoder) see a normalised copy of the memory.
        memory = self.memory_norm(memory)
        # need_weights=False keeps attention memory linear in the prompt length (no [N, T] weight matrix).
        attended, _ = self.attention(self.query_norm(options), memory, memory, need_weights=False)
        options = options + attended
        return options + self.feedforward(self.feedforward_norm(options))


class JointSchemaHead(nn.Module):
    """Scores every option of every question of one record against the prompt and against each other field."""

    def __init__(
        self,
        hidden_size: int,
        width: int,
        routing_layers: int,
        layers: int,
        heads: int,
        feedforward: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        # What save_head writes back; dropout is a training knob and not part of the release config.
        self.config = {
            "hidden_size": hidden_size,
            "width": width,
            "routing_layers": routing_layers,
            "layers": layers,
            "heads": heads,
            "feedforward": feedforward,
        }
        self.width = width
        self.hidden_norm = nn.LayerNorm(hidden_size)
        self.memory_projection = nn.Linear(hidden_size, width, bias=False)
        self.question_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_question_projection = nn.Linear(hidden_size, width, bias=False)
        self.global_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_context_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden_size, width, bias=False)
        self.type_embedding = nn.Embedding(len(QUESTION_TYPES), width)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(width, heads, feedforward, dropout) for _ in range(routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(
                d_model=width,
                nhead=heads,
                dim_feedforward=feedforward,
                dropout=dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.field_norm = nn.LayerNorm(width)
        self.option_norm = nn.LayerNorm(width)
        self.residual_scorer = nn.Sequential(
            nn.Linear(4 * width, width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(width, 1),
        )
        # The reference initialises the three scalars to 0; the release values are trained.
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))

    def forward(
        self,
        hidden: Tensor,
        lexical_rows: Tensor,
        question_spans: Sequence[Span],
        option_spans: Sequence[Span],
        option_counts: Sequence[int],
        types: Sequence[int],
    ) -> Tensor:
        """Logits of all N options, flat in question order then option order, in the head's dtype.

        ``hidden`` [T, H]: final (post-norm) hidden states of every real prompt token.
        ``lexical_rows`` [sum of option span lengths, H]: lm_head rows of every option-span token, option by option.
        Spans are end-exclusive token ranges; ``types`` index ``QUESTION_TYPES``.
        """
        owner, slot = _check_record(hidden, lexical_rows, question_spans, option_spans, option_counts, types)
        if hidden.shape[1] != self.config["hidden_size"]:
            raise ValueError(f"hidden has width {hidden.shape[1]}, the head expects {self.config['hidden_size']}")
        reference = self.hidden_norm.weight
        # Everything runs in the head's dtype so a bf16 head reproduces the reference's bf16 arithmetic.
        hidden = hidden.to(device=reference.device, dtype=reference.dtype)
        lexical_rows = lexical_rows.to(device=reference.device, dtype=reference.dtype)
        owner_t = torch.tensor(owner, dtype=torch.long, device=reference.device)
        slot_t = torch.tensor(slot, dtype=torch.long, device=reference.device)
        types_t = torch.tensor(list(types), dtype=torch.long, device=reference.device)

        # A. The head re-normalises the tower's output; the memory is the whole prompt, unmasked, and the
        # last token (the final ':') summarises the record.
        normed = self.hidden_norm(hidden)
        memory = self.memory_projection(normed).unsqueeze(0)
        global_vector = normed[-1]

        # B. Plain per-span means, one span at a time: the same reduction (and rounding in bf16) as the
        # reference, and negligible next to the tower even for thousands of options.
        question_vectors = torch.stack([normed[start:end].mean(0) for start, end in question_spans])
        option_contexts = torch.stack([normed[start:end].mean(0) for start, end in option_spans])
        lengths = [end - start for start, end in option_spans]
        option_lexicals = torch.stack([rows.mean(0) for rows in lexical_rows.split(lengths)])

        # C. An option query knows what its tokens say in context, what they mean as output tokens, and
        # which question it answers.
        options = (
            self.option_context_projection(option_contexts)
            + self.option_lexical_projection(option_lexicals)
            + self.option_question_projection(question_vectors)[owner_t]
        )

        # D. All options of the record form one sequence; they only read the prompt, so batching is exact.
        options = options.unsqueeze(0)
        for block in self.evidence_layers:
            options = block(options, memory)
        routed = options.squeeze(0)

        # E. A field starts from its question, plus what its own options found (weighted by agreement with
        # the question), the record summary and its type.
        base_fields = self.question_projection(question_vectors)
        summary = self._option_summary(routed, base_fields, owner_t, slot_t, max(option_counts))
        fields = (
            base_fields
            + self.option_summary_norm(summary)
            + self.global_projection(global_vector)
            + self.type_embedding(types_t)
        )

        # F. Fields decide jointly: each attends to every field and to the raw (un-normed) memory.
        fields = fields.unsqueeze(0)
        for block in self.layers:
            fields = block(fields, memory)
        decided = self.field_norm(fields.squeeze(0))

        # G. Prior: does the option's output-token meaning point where the question + record state points
        # (a logit-lens cosine in hidden space)?
        anchors = F.normalize(question_vectors + global_vector, dim=-1, eps=1e-12)
        lexical_directions = F.normalize(option_lexicals, dim=-1, eps=1e-12)
        prior_scale = self.prior_logit_scale.clamp(max=LOG_100).exp()
        prior = prior_scale * (lexical_directions * anchors[owner_t]).sum(-1)

        # G. Joint term: how well the decided field matches the routed option, as a scaled cosine plus a
        # learned correction on the usual pair features (order fixed by the release weights).
        field_per_option = decided[owner_t]
        option_states = self.option_norm(routed)
        cosine = F.cosine_similarity(field_per_option, option_states, dim=-1, eps=1e-8)
        features = torch.cat(
            [
                field_per_option,
                option_states,
                field_per_option * option_states,
                (field_per_option - option_states).abs(),
            ],
            dim=-1,
        )
        residual = self.residual_scorer(features).squeeze(-1)
        joint_scale = self.joint_logit_scale.clamp(max=LOG_100).exp()
        joint = joint_scale * cosine + residual

        # The gate scales the whole joint term but never the prior.
        return prior + torch.sigmoid(self.residual_gate) * joint

    def _option_summary(
        self, routed: Tensor, base_fields: Tensor, owner: Tensor, slot: Tensor, max_options: int
    ) -> Tensor:
        """s_q = sum_k softmax_k(<o_qk, f_q> / sqrt(W)) o_qk, for all questions at once.

        Options are laid out [Q, K_max, W] with zero rows in empty slots, so the matmuls below equal the
        reference's per-question ones (zero rows add exact zeros) and empty slots get -inf scores.
        """
        questions = base_fields.shape[0]
        padded = routed.new_zeros(questions, max_options, routed.shape[-1])
        padded[owner, slot] = routed
        present = torch.zeros(questions, max_options, dtype=torch.bool, device=routed.device)
        present[owner, slot] = True
        # The full width, not the per-head width: this is one dot product over all W features.
        scores = (padded @ base_fields.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.width)
        weights = scores.masked_fill(~present, float("-inf")).softmax(-1)
        return (weights.unsqueeze(1) @ padded).squeeze(1)


def _check_record(
    hidden: Tensor,
    lexical_rows: Tensor,
    question_spans: Sequence[Span],
    option_spans: Sequence[Span],
    option_counts: Sequence[int],
    types: Sequence[int],
) -> tuple[list[int], list[int]]:
    """Validate one record's layout; return each option's question index and its slot within the question.

    The reference would silently produce NaN (empty span) or index garbage; these are caller bugs, so they
    raise ValueError before any arithmetic.
    """
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        raise ValueError(f"hidden must be [T, H] with T >= 1, got {tuple(hidden.shape)}")
    tokens, hidden_size = hidden.shape
    questions = len(question_spans)
    if questions == 0:
        raise ValueError("a record needs at least one question")
    if len(option_counts) != questions or len(types) != questions:
        raise ValueError(
            f"{questions} question spans but {len(option_counts)} option counts and {len(types)} types"
        )
    if any(count < 1 for count in option_counts):
        raise ValueError(f"every question needs at least one option, got counts {list(option_counts)}")
    if sum(option_counts) != len(option_spans):
        raise ValueError(f"option counts sum to {sum(option_counts)} but {len(option_spans)} option spans given")
    if any(kind not in range(len(QUESTION_TYPES)) for kind in types):
        raise ValueError(f"types must be 0 (noul), 1 (choice) or 2 (score), got {list(types)}")
    for name, spans in (("question", question_spans), ("option", option_spans)):
        for index, (start, end) in enumerate(spans):
            if not 0 <= start < end <= tokens:
                raise ValueError(f"{name} span {index} = [{start}, {end}) is empty or outside the {tokens} tokens")
    span_tokens = sum(end - start for start, end in option_spans)
    if lexical_rows.ndim != 2 or tuple(lexical_rows.shape) != (span_tokens, hidden_size):
        raise ValueError(
            f"lexical_rows must be [{span_tokens}, {hidden_size}] (one lm_head row per option-span token), "
            f"got {tuple(lexical_rows.shape)}"
        )
    owner: list[int] = []
    slot: list[int] = []
    for question, count in enumerate(option_counts):
        owner.extend([question] * count)
        slot.extend(range(count))
    return owner, slot
