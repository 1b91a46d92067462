"""Agreement of a converted model with the transformers reference of the same release.

The reference side runs the Hugging Face backbone (``last_hidden_state`` and ``lm_head.weight``
rows, spec §2) and the release head; our side runs the GGUF through llama.cpp. Both share the
encoder and the head code, so every difference comes from the tower and its quantization.
transformers is only needed here (``pip install 'clef-gguf[parity]'``).

``--per-request`` gives one row per request (tokens, the ``[prefix][state][rest]`` segment lengths,
the tokens in each segment's last ubatch, max |dp|), so a bound holds per request and a drift is
traced to the requests and boundaries that carry it; ``--layers`` adds max |dh| after every decoder
layer against transformers on the same token ids, which names the layer that departs first
(docs/parity.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_gguf.convert.samples import SAMPLE_REQUESTS
from clef_gguf.core import errors
from clef_gguf.core.deps import need

if TYPE_CHECKING:
    from clef_gguf.runtime.model import Clef


@dataclass
class ParityReport:
    model: str
    questions: int = 0
    options: int = 0
    max_abs_dp: float = 0.0
    mean_abs_dp: float = 0.0
    argmax_agree: int = 0  # over questions whose reference top-2 margin > margin
    argmax_checked: int = 0
    near_ties: list[dict] = field(default_factory=list)
    margin: float = 0.01

    def to_dict(self) -> dict:
        return asdict(self)


class Reference:
    """The transformers backbone + the release head in float32 (or bf16) on CPU."""

    def __init__(self, release: str | Path, *, dtype: str = "f32"):
        import torch

        transformers = need("transformers", "parity", what="parity needs transformers")
        from clef_gguf.pipeline.encode import Encoder
        from clef_gguf.heads import load_head

        release = Path(release)
        if not (release / "config.json").is_file():
            raise errors.ModelNotFound(f"{release} is not a Hugging Face release (no config.json)",
                                       field="release")
        self.torch = torch
        torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        arch = json.loads((release / "config.json").read_text()).get("architectures", ["?"])[0]
        model_class = getattr(transformers, arch, None)
        if model_class is None:
            raise errors.ModelNotFound(f"transformers has no class {arch}", field="release")
        model = model_class.from_pretrained(release, dtype=torch_dtype)
        self.model = model.eval()
        self.lm_head = self.model.get_output_embeddings().weight
        self.head = load_head(release / "joint_head_config.json", release / "joint_head.safetensors",
                              dtype=torch.float32)
        self.encoder = Encoder.from_file(release / "tokenizer.json")

    def _text_model(self) -> Any:
        base = self.model.model
        return getattr(base, "language_model", base)

    def layer_states(self, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(final hidden [T, n_embd], [output of decoder layer 0 .. n_layer - 2]) for ``ids``."""
        torch = self.torch
        text = self._text_model()
        caught: list[np.ndarray] = []

        def keep(_module: Any, _inputs: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            caught.append(hidden[0].float().numpy().copy())

        hooks = [layer.register_forward_hook(keep) for layer in text.layers]
        try:
            with torch.inference_mode():
                x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
                final = text(input_ids=x, use_cache=False).last_hidden_state[0].float().numpy()
        finally:
            for hook in hooks:
                hook.remove()
        return final, caught[:-1]

    def probabilities(self, request: dict) -> list[np.ndarray]:
        from clef_gguf.pipeline.answer import split_probabilities
        from clef_gguf.pipeline.request import parse_request

        torch = self.torch
        enc = self.encoder.encode(parse_request(request))
        ids = torch.as_tensor(enc.ids, dtype=torch.long)[None]
        with torch.inference_mode():
            hidden = self._text_model()(input_ids=ids, use_cache=False).last_hidden_state[0]
            rows = self.lm_head[torch.as_tensor(enc.option_token_ids(), dtype=torch.long)]
            logits = self.head(hidden.float(), rows.float(), list(enc.question_spans),
                               list(enc.option_spans), list(enc.option_counts), list(enc.types))
        return split_probabilities(logits.float().numpy(), enc.option_counts)


def compare(ours: list[list[np.ndarray]], ref: list[list[np.ndarray]], *, model: str,
            margin: float = 0.01) -> ParityReport:
    """Max/mean |dp| over every option; argmax agreement where the reference is not a near tie."""
    report = ParityReport(model=model, margin=margin)
    diffs = []
    for i, (a_q, r_q) in enumerate(zip(ours, ref)):
        for j, (a, r) in enumerate(zip(a_q, r_q)):
            diffs.append(np.abs(a.astype(np.float64) - r))
            report.questions += 1
            report.options += len(r)
            top2 = np.sort(r)[-2:] if len(r) > 1 else np.array([0.0, 1.0])
            if top2[1] - top2[0] > margin:
                report.argmax_checked += 1
                report.argmax_agree += int(np.argmax(a) == np.argmax(r))
            else:
                report.near_ties.append({"request": i, "question": j,
                                         "margin": float(top2[1] - top2[0]),
                                         "same_argmax": bool(np.argmax(a) == np.argmax(r))})
    flat = np.concatenate(diffs) if diffs else np.zeros(1)
    report.max_abs_dp = float(flat.max())
    report.mean_abs_dp = float(flat.mean())
    return report


@dataclass
class RequestRow:
    """One request of the parity set: where its segment boundaries fall and how far it is off."""

    request: int
    tokens: int
    prefix: int
    state: int
    rest: int
    tails: dict[str, int]  # tokens in each segment's last ubatch (0: an empty segment)
    max_abs_dp: float
    layers: list[float] = field(default_factory=list)  # max |dh| after each layer, then the final state

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def segment_tails(prefix: int, state: int, rest: int, n_batch: int) -> dict[str, int]:
    """Tokens in the last ubatch of each segment: each is chunked by ``n_batch`` from its own start."""
    def tail(n: int) -> int:
        return (n % n_batch or n_batch) if n else 0

    return {"prefix": tail(prefix), "state": tail(state), "rest": tail(rest)}


def per_request(clef: Clef, reference: Reference, requests: list[dict], *,
                layers: bool = False) -> list[RequestRow]:
    """One row per request. Ours is ``Clef.probabilities`` (the production path); with ``layers`` the
    prompt is decoded once more on the same schedule with every layer's output staged."""
    from clef_gguf.pipeline.request import parse_request

    tower: Any = clef.tower  # layer_states: the llama.cpp tower's, checked below
    if layers and not hasattr(tower, "layer_states"):
        raise errors.InvalidValue("--layers needs a GGUF tower (llama.cpp's staging API)", field="layers")
    # A tower that decodes each segment in one piece (nvfp4) has each segment as its own tail.
    n_batch = getattr(tower, "n_batch", tower.n_ctx)
    rows = []
    for i, request in enumerate(requests):
        enc = reference.encoder.encode(parse_request(request))
        report = compare([clef.probabilities(request)], [reference.probabilities(request)], model="")
        prefix, state = enc.prefix_tokens, enc.state_tokens
        rest = enc.n_tokens - prefix - state
        row = RequestRow(i, enc.n_tokens, prefix, state, rest,
                         segment_tails(prefix, state, rest, n_batch), report.max_abs_dp)
        if layers:
            ours_final, ours_layers = tower.layer_states(np.asarray(enc.ids), prefix, state)
            ref_final, ref_layers = reference.layer_states(np.asarray(enc.ids))
            row.layers = [float(np.abs(a - b).max()) for a, b in zip(ours_layers, ref_layers)]
            row.layers.append(float(np.abs(ours_final - ref_final).max()))
        rows.append(row)
    return rows


def run_parity(clef: Clef, reference: Reference, requests: list[dict], *, margin: float = 0.01) -> ParityReport:
    ours = [clef.probabilities(r) for r in requests]
    ref = [reference.probabilities(r) for r in requests]
    return compare(ours, ref, model=clef.info["name"] + ":" + clef.info["quant"], margin=margin)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from clef_gguf.runtime.flags import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--release", required=True,
                   help="the Hugging Face release directory the model was converted from")
    p.add_argument("--requests", help="JSON file with a list of requests (default: built-in samples)")
    p.add_argument("--reference-dtype", choices=["f32", "bf16"], default="f32",
                   help="dtype of the transformers reference (bf16 halves its memory)")
    p.add_argument("--margin", type=float, default=0.01,
                   help="argmax is compared where the reference's top-2 margin exceeds this")
    p.add_argument("--per-request", action="store_true",
                   help="one row per request: segment lengths, last-ubatch sizes, max |dp|")
    p.add_argument("--layers", action="store_true",
                   help="with --per-request: max |dh| after every decoder layer against transformers")


def run(args: argparse.Namespace) -> int:
    from clef_gguf.runtime.flags import load_model, read_request

    requests = read_request(args.requests) if args.requests else SAMPLE_REQUESTS
    if not isinstance(requests, list) or not requests:
        raise errors.InvalidValue("--requests must hold a non-empty JSON list of requests",
                                  field="requests")
    if args.layers and not args.per_request:
        raise errors.InvalidValue("--layers is a column of --per-request", field="layers")
    reference = Reference(args.release, dtype=args.reference_dtype)
    with load_model(args) as models:
        clef = models.default_model  # the model compared: the fine-tune when one --adapter is given
        report = run_parity(clef, reference, requests, margin=args.margin).to_dict()
        if args.per_request:
            report["attention"] = clef.info.get("attention")
            report["requests"] = [row.to_dict() for row in
                                  per_request(clef, reference, requests, layers=args.layers)]
    print(json.dumps(report, indent=2))
    return 0
