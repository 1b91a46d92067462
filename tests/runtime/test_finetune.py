"""Fine-tunes at run time: a clef-finetune checkpoint of the tiny release, converted to a
GGUF LoRA, on the base tower; against the transformers reference of the PEFT-merged release.

Two checkpoints (seeds 1 and 2) of the tiny release, made by PEFT in clef-finetune 0.1.0's layout
(``finetune_helpers``), converted with ``clef-gguf convert adapter``; the reference is clef-finetune's
own merge run through the parity tool's transformers reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from finetune_helpers import (
    MERGED_FILES,
    PROVENANCE_KEYS,
    lora_targets,
    max_abs_dp,
    merged_release,
    peft_checkpoint,
    reference_probabilities,
    safetensors_names,
    without_run_facts,
)
from safetensors import safe_open

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.convert.samples import SAMPLE_REQUESTS
from clef_gguf.tools.parity import Reference, compare

# The text parity gate, and the margin above which the argmax must agree.
F32_MAX_DP, MARGIN = 2e-3, 0.01
# Base q8_0 + f32 adapter against the merged release quantized to q8_0: both are q8_0 rounding of
# nearly the same weights; the tiny model's q8_0 parity with the reference is within 5e-2.
Q8_MAX_DP = 5e-2
# An adapter that acts moves the answers by far more than the parity gate.
MOVED_DP = 0.02
ADAPTER_TENSOR = re.compile(r"base_model\.model\.model\.language_model\.layers\.\d+\."
                            r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_(qkv|z|a|b)|out_proj)|"
                            r"mlp\.(gate|up|down)_proj)\.lora_[AB]\.weight")


def convert_adapter(checkpoint: Path, out: Path, base: Path, name: str | None = None) -> Path:
    """What ``clef-gguf convert adapter`` runs, with an f32 adapter: the parity gates measure the
    runtime, not the adapter's rounding."""
    from clef_gguf.convert.lora import convert_adapter as convert

    return convert(checkpoint, out, base=base, outtype="f32", name=name)


# ---------------------------------------------------------------- fixtures (built once per module)

@pytest.fixture(scope="module")
def checkpoints(tiny_release, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune-checkpoints")
    return {name: peft_checkpoint(tiny_release, root / f"run-{name}" / "checkpoint-1", seed=seed)
            for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def merged(tiny_release, checkpoints, tmp_path_factory) -> Path:
    return merged_release(tiny_release, checkpoints["a"], tmp_path_factory.mktemp("merged") / "release")


@pytest.fixture(scope="module")
def finetunes(checkpoints, tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetunes")
    return {name: convert_adapter(ck, root / name, tiny_model_dir, name)
            for name, ck in checkpoints.items()}


@pytest.fixture(scope="module")
def merged_reference(merged) -> list[list[np.ndarray]]:
    return reference_probabilities(merged, SAMPLE_REQUESTS)


# ---------------------------------------------------------------- the checkpoints themselves

def test_checkpoint_has_clef_finetunes_layout(tiny_release, checkpoints):
    ck = checkpoints["a"]
    assert {p.name for p in ck.iterdir()} == {"adapter", "joint_head.safetensors", "training_state.pt",
                                              "train_config.json"}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (ck / "adapter").iterdir()}
    config = json.loads((ck / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", 8, 16, "none")
    targets = lora_targets(tiny_release)
    assert re.fullmatch(config["target_modules"], targets[0])
    assert not re.fullmatch(config["target_modules"], "lm_head")
    with safe_open(str(ck / "adapter" / "adapter_model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
        assert len(names) == 2 * len(targets) == 62  # A and B of 31 modules: every linear of 4 layers
        assert all(ADAPTER_TENSOR.fullmatch(n) for n in names), names
        for name in names:
            tensor = handle.get_tensor(name)
            assert tensor.dtype == torch.float32 and float(tensor.abs().max()) > 0  # B too: not PEFT's zero init
    with safe_open(str(tiny_release / "joint_head.safetensors"), framework="pt") as release_head, \
            safe_open(str(ck / "joint_head.safetensors"), framework="pt") as head:
        assert set(head.keys()) == set(release_head.keys())
        assert all(head.get_tensor(n).dtype == torch.float32 for n in head.keys())
        assert any(not torch.equal(head.get_tensor(n), release_head.get_tensor(n).float()) for n in head.keys())
    train = json.loads((ck / "train_config.json").read_text())
    assert train["lora"]["r"] == 8 and train["model"]["path"] == str(tiny_release)


def test_merged_release_keeps_the_release_names(tiny_release, checkpoints, merged):
    assert all((merged / name).is_file() for name in MERGED_FILES)
    dropped = safetensors_names(tiny_release) - safetensors_names(merged)
    assert dropped and all(n.startswith("mtp.") for n in dropped)  # transformers never loads MTP
    info = json.loads((merged / "CLEF_FINETUNE.json").read_text())
    assert set(info) == set(PROVENANCE_KEYS) and info["tool"] == "clef-finetune"
    assert info["checkpoint"] == str(checkpoints["a"]) and info["dtype"] == "float32"


# ---------------------------------------------------------------- correctness

def test_f32_base_with_adapter_matches_the_merged_reference(tiny_release, tiny_model_dir, checkpoints,
                                                            finetunes, merged_reference, record_property):
    with Clef.load(tiny_model_dir, adapters=finetunes["a"], max_length=4096) as clef:
        ours = [clef.probabilities(r) for r in SAMPLE_REQUESTS]
    with Clef.load(tiny_model_dir, max_length=4096) as base:
        plain = [base.probabilities(r) for r in SAMPLE_REQUESTS]
    report = compare(ours, merged_reference, model="tiny f32 + adapter a", margin=MARGIN)
    # The retrained head alone on the base backbone: what the runtime gives if the adapter is ignored.
    head_only = Reference(tiny_release)
    from clef_gguf.heads import load_head

    head_only.head = load_head(tiny_release / "joint_head_config.json",
                               checkpoints["a"] / "joint_head.safetensors", dtype=torch.float32)
    without_lora = [head_only.probabilities(r) for r in SAMPLE_REQUESTS]
    moved = {"vs_base": max_abs_dp(ours, plain), "vs_retrained_head_only": max_abs_dp(ours, without_lora)}
    record_property("finetune_parity_f32", report.to_dict() | {"moved": moved})
    print(f"\nf32 + adapter vs merged reference: max|dp|={report.max_abs_dp:.2e} "
          f"mean|dp|={report.mean_abs_dp:.2e} argmax {report.argmax_agree}/{report.argmax_checked}; "
          f"moved {moved}")
    assert report.questions == 9 and report.options == 27
    assert report.max_abs_dp <= F32_MAX_DP
    assert report.argmax_agree == report.argmax_checked > 0
    assert moved["vs_base"] > MOVED_DP and moved["vs_retrained_head_only"] > MOVED_DP


def test_quantized_base_with_adapter_vs_merged_then_quantized(tiny_model_dir_factory, merged, finetunes,
                                                              merged_reference, tmp_path_factory,
                                                              record_property):
    from clef_gguf.convert.release import convert_release

    merged_q8 = convert_release(merged, tmp_path_factory.mktemp("merged-q8_0"), outtype="q8_0",
                                name="clef-tiny-merged-a")
    with Clef.load(tiny_model_dir_factory("q8_0"), adapters=finetunes["a"], max_length=4096) as clef:
        adapted = [clef.probabilities(r) for r in SAMPLE_REQUESTS]
    with Clef.load(merged_q8, max_length=4096) as clef:
        quantized_merge = [clef.probabilities(r) for r in SAMPLE_REQUESTS]
    numbers = {"adapter_vs_merged_q8_0": max_abs_dp(adapted, quantized_merge),
               "adapter_vs_reference": max_abs_dp(adapted, merged_reference),
               "merged_q8_0_vs_reference": max_abs_dp(quantized_merge, merged_reference)}
    record_property("finetune_parity_q8_0", numbers)
    print(f"\nq8_0: {json.dumps(numbers)}")
    assert all(v <= Q8_MAX_DP for v in numbers.values()), numbers


# ---------------------------------------------------------------- several fine-tunes, one tower

STATE = "Order 7731: the customer was charged twice for one subscription and asks for a refund today."
QUESTION_SETS = [
    {"refund": {"type": "noul", "instructions": "Should the duplicate charge be refunded?"}},
    {"team": {"type": "choice", "criteria": {"billing": "Payments", "support": None, "fraud": None}},
     "anger": {"type": "score", "criteria": ["calm", "annoyed", "angry"]}},
]


def mixed_requests(base_name: str) -> list[dict]:
    """Interleaved: every sample request through a, b and the base (by no name and by its name),
    with the same states coming back through other models."""
    out = []
    for i, request in enumerate(SAMPLE_REQUESTS):
        for model in ("a", "b", None, "a", base_name if i % 2 else None, "b"):
            out.append(request | ({"model": model} if model else {}))
    return out


def single_answers(model_dir: Path, requests: list[dict], adapters: Path | None) -> list[dict]:
    """Each request through a Clef that loaded only that fine-tune (or none), one request at a time."""
    with Clef.load(model_dir, adapters=adapters, max_length=4096) as clef:
        return [without_run_facts(clef.decide(r)) for r in requests]


def test_two_finetunes_and_the_base_answer_as_if_loaded_alone(tiny_model_dir, finetunes):
    with Clef.load(tiny_model_dir, adapters={"a": finetunes["a"], "b": finetunes["b"]}, max_length=4096) as clef:
        base_name = clef.provenance.model_name
        assert set(clef.models) == {base_name, "a", "b"}
        requests = mixed_requests(base_name)
        one_by_one = [without_run_facts(clef.decide(r)) for r in requests]
        many = [without_run_facts(r) for r in clef.decide_many(requests)]
        many_packed = [without_run_facts(r) for r in clef.decide_many(requests, pack=4)]
    by_model: dict[str | None, list[int]] = {}
    for i, r in enumerate(requests):
        by_model.setdefault(r.get("model") if r.get("model") != base_name else None, []).append(i)
    expected: list[dict | None] = [None] * len(requests)
    for model, idx in by_model.items():
        alone = single_answers(tiny_model_dir, [requests[i] for i in idx],
                               finetunes[model] if model else None)
        for i, answer in zip(idx, alone):
            expected[i] = answer
    for i, request in enumerate(requests):
        assert json.dumps(one_by_one[i]) == json.dumps(expected[i]), (i, request.get("model"))
        assert json.dumps(many[i]) == json.dumps(expected[i]), (i, request.get("model"))
        assert json.dumps(many_packed[i]) == json.dumps(expected[i]), (i, request.get("model"))
    # The three models really answer differently.
    first = {r.get("model"): one_by_one[i]["answers"] for i, r in enumerate(requests[:3])}
    assert first["a"] != first["b"] != first[None] != first["a"]


def test_a_state_asked_through_two_finetunes_never_shares_a_cached_state(tiny_model_dir, finetunes):
    ask = [{"state": STATE, "questions": qs} for qs in QUESTION_SETS]
    alone = {name: single_answers(tiny_model_dir, ask, finetunes[name]) for name in ("a", "b")}
    alone[None] = single_answers(tiny_model_dir, ask, None)
    for order in (("a", "b"), ("b", "a")):
        with Clef.load(tiny_model_dir, adapters={"a": finetunes["a"], "b": finetunes["b"]},
                       max_length=4096) as clef:
            cache = clef.state_cache
            # One cache under one budget for the base and its fine-tunes, their entries kept apart by key.
            assert all(model.state_cache is cache for model in clef.models.values())
            first, second = order
            warm = clef.decide(ask[0] | {"model": first})
            assert warm["usage"]["cached_tokens"] == 0
            hits = cache.hits
            # The same state, the same prompt, through the other fine-tune: nothing it may reuse.
            other = clef.decide(ask[0] | {"model": second})
            assert other["usage"]["cached_tokens"] == 0 and cache.hits == hits
            assert without_run_facts(other) == alone[second][0]
            # Its own state is now cached: the next question set about it restores [prefix][state].
            again = clef.decide(ask[1] | {"model": second})
            assert again["usage"]["cached_tokens"] > 0 and cache.hits == hits + 1
            assert without_run_facts(again) == alone[second][1]
            # Through the first fine-tune and the base, after the other's warm-up: each its own.
            for model in (first, None):
                got = clef.decide(ask[1] | ({"model": model} if model else {}))
                assert without_run_facts(got) == alone[model][1], (order, model)
            # The first prompt again through each: from its own prompt cache where it has one.
            for model in ("a", "b", None):
                got = clef.decide(ask[0] | ({"model": model} if model else {}))
                assert without_run_facts(got) == alone[model][0], (order, model)


# ---------------------------------------------------------------- bad input

def test_another_model_name_is_answered_by_the_default_and_refused_only_when_strict(tiny_model_dir, finetunes):
    request = SAMPLE_REQUESTS[0]
    adapters = {"a": finetunes["a"], "b": finetunes["b"]}
    with Clef.load(tiny_model_dir, adapters=adapters, max_length=4096) as clef:
        got = clef.decide(request | {"model": "c"})
        assert got["answers"] == clef.decide(request)["answers"] and got["warnings"][0]["code"] == "unknown_model"
    with Clef.load(tiny_model_dir, adapters=adapters, max_length=4096, strict=True) as clef:
        with pytest.raises(errors.UnknownModel) as caught:
            clef.decide(request | {"model": "c"})
        assert caught.value.code == "unknown_model" and caught.value.field == "model"
        out = list(clef.decide_many([request | {"model": "a"}, request | {"model": "nope"}, request]))
    assert out[1]["error"]["code"] == "unknown_model"
    assert "answers" in out[0] and "answers" in out[2] and out[0]["answers"] != out[2]["answers"]


def test_finetune_of_another_base_size_is_refused_at_load(tiny_model_dir, tmp_path_factory):
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release

    root = tmp_path_factory.mktemp("tiny256-finetune")
    release = build_release(root / "release", preset="tiny256", seed=0)
    base = convert_release(release, root / "model", outtype="f32", name="clef-tiny256-random")
    tune = convert_adapter(peft_checkpoint(release, root / "checkpoint-1", seed=3), root / "finetune", base)
    with Clef.load(base, adapters=tune, max_length=2048) as clef:  # on its own base it loads
        assert "answers" in clef.decide(SAMPLE_REQUESTS[0])
    with pytest.raises(errors.AdapterMismatch) as caught:
        Clef.load(tiny_model_dir, adapters=tune, max_length=2048)
    assert caught.value.code == "adapter_mismatch"
    assert "another" in caught.value.message or "n_embd" in caught.value.message


def _truncate_adapter(tune: Path) -> None:
    adapter = next(tune.glob("adapter-*.gguf"))
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])


def _wide_head(tune: Path) -> None:
    from clef_gguf.convert.synthetic.tiny import PRESETS
    from clef_gguf.convert.synthetic.head import random_head
    from clef_gguf.heads import save_head

    save_head(random_head(PRESETS["tiny256"]["head"], seed=1), tune, dtype=torch.float32)


DAMAGES = {  # what is done to a copy of a fine-tune directory -> the error Clef.load must raise
    "truncated adapter": (_truncate_adapter, errors.CorruptModel),
    "head of another width": (_wide_head, errors.HeadMismatch),
    "no head": (lambda tune: (tune / "joint_head.safetensors").unlink(), errors.ModelNotFound),
    "no manifest": (lambda tune: (tune / "clef-gguf-adapter.json").unlink(), errors.ModelNotFound),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_finetune_is_refused_at_load(tiny_model_dir, finetunes, tmp_path, damage):
    import shutil

    tune = Path(shutil.copytree(finetunes["a"], tmp_path / "a"))
    make, error = DAMAGES[damage]
    make(tune)
    with pytest.raises(error) as caught:
        Clef.load(tiny_model_dir, adapters={"a": tune}, max_length=2048)
    assert caught.value.field in ("adapter", "head_config", "head_weights"), caught.value.to_dict()
