"""The random fine-tune (``convert.synthetic.finetune_demo``) and ``clef-gguf demo --finetune``."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from clef_gguf.formats import files
from clef_gguf.convert.synthetic.finetune_demo import build_finetune_checkpoint
from clef_gguf.formats.finetune_files import AdapterFiles


def test_checkpoint_layout_is_clef_finetunes(tiny_release, tmp_path):
    ckpt = build_finetune_checkpoint(tiny_release, tmp_path / "checkpoint-1", seed=3, rank=4)
    assert {p.name for p in ckpt.iterdir()} == {"adapter", "joint_head.safetensors", "train_config.json"}
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == ("LORA", 4, 8, None)
    assert config["base_model_name_or_path"] == str(tiny_release.resolve())
    lora = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    modules = {n[len("base_model.model."):-len(".lora_A.weight")] for n in lora if ".lora_A." in n}
    assert len(modules) == 31 and all(re.fullmatch(config["target_modules"], m) for m in modules)
    assert not any(re.fullmatch(config["target_modules"], m) for m in (
        "model.language_model.layers.0.linear_attn.conv1d", "lm_head", "model.visual.blocks.0.attn.qkv"))
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in lora.values())
    assert all(lora[n].abs().max() > 0 for n in lora if ".lora_B." in n)  # B is not PEFT's zero init
    head = load_file(str(ckpt / "joint_head.safetensors"))
    base = load_file(str(tiny_release / "joint_head.safetensors"))
    assert head.keys() == base.keys() and all(head[k].shape == base[k].shape for k in head)
    assert all(head[k].dtype == torch.float32 for k in head)
    assert any(not torch.equal(head[k], base[k].float()) for k in head)
    again = build_finetune_checkpoint(tiny_release, tmp_path / "again", seed=3, rank=4)
    assert (again / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (ckpt / "adapter" / "adapter_model.safetensors").read_bytes()


def test_peft_loads_and_merges_the_checkpoint(tiny_release, tiny_hf_model, tmp_path):
    """PEFT (a test dependency) reads the files as its own: every tensor lands, the merge is W + 2 B A."""
    import copy

    from peft import PeftModel

    ckpt = build_finetune_checkpoint(tiny_release, tmp_path / "ckpt")
    model = PeftModel.from_pretrained(copy.deepcopy(tiny_hf_model), ckpt / "adapter")
    lora = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert sum(1 for n, _ in model.named_parameters() if ".lora_" in n) == len(lora)
    merged = model.merge_and_unload()
    name = "model.language_model.layers.0.linear_attn.in_proj_qkv"
    a, b = lora[f"base_model.model.{name}.lora_A.weight"], lora[f"base_model.model.{name}.lora_B.weight"]
    before = tiny_hf_model.get_submodule(name).weight
    after = merged.get_submodule(name).weight
    assert torch.allclose(after, before + 2.0 * (b @ a), atol=1e-5)


@pytest.mark.parametrize("outtype, lora_type", [("f32", "f32"), ("f16", "f16")])
def test_demo_finetune_command(tmp_path, capsys, outtype, lora_type):
    from clef_gguf.cli import main

    out = tmp_path / "demo"
    assert main(["demo", str(out), "--finetune", "--outtype", outtype]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "RANDOM WEIGHTS" in captured.err
    assert summary["finetune_checkpoint"] == str(out / "finetune-checkpoint")
    assert summary["finetune"] == str(out / "finetune")
    assert summary["finetune_adapter"] == str(out / "finetune" / f"adapter-{lora_type}.gguf")
    assert (out / "finetune-checkpoint" / "adapter" / "adapter_model.safetensors").is_file()
    found = AdapterFiles.from_directory(out / "finetune")
    assert found.adapter.name == f"adapter-{lora_type}.gguf"
    assert found.name == "clef-random-tiny-seed0-finetune" and found.source["tool"] == "clef-finetune"
    base = files.read_manifest(out)
    assert found.base["name"] == base["name"] and found.base["tower"] == base["tower"]
    assert found.base["tower_sha256"] == base["files"][base["tower"]]["sha256"]
    assert found.lora == {"rank": 8, "alpha": 16.0, "targets": 31, "outtype": lora_type}


def test_demo_without_the_flag_writes_no_finetune(tmp_path, capsys):
    from clef_gguf.cli import main

    assert main(["demo", str(tmp_path / "demo")]) == 0
    assert "finetune" not in json.loads(capsys.readouterr().out)
    assert not (tmp_path / "demo" / "finetune").exists()
