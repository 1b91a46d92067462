"""Write the language tower of a Hugging Face Clef release as a GGUF (``write_tower``).

The GGUF has llama.cpp architecture ``qwen35``: the language tower only; the vision tower and the
MTP block are skipped. ``convert.release`` builds a whole model directory around it.

Tensors are streamed: a first pass plans every output tensor from the safetensors headers alone
(name, shape, storage type, byte size), the GGUF header is written from that plan, and then each
tensor is loaded, edited, encoded and appended one at a time. Peak memory is one tensor, not the model.
Anything unexpected (unknown tensor name, missing tensor, wrong shape, unsupported config)
raises ``ConversionError`` before the output file exists: llama.cpp aborts the whole process on
some malformed files, so we refuse to write one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from clef_gguf.formats import files
from clef_gguf.convert import gguf_vocab
from clef_gguf.convert import tensor_map as tm
from clef_gguf.core.errors import ConversionError, ModelNotFound
from clef_gguf.formats.gguf import TOWER_ARCH
from clef_gguf.formats.safetensors import Tensors, opened

# architecture -> where its text hyper-parameters live and the checkpoint prefix of text tensors
SUPPORTED = {
    "Qwen3_5ForConditionalGeneration": ("text_config", "model.language_model."),
    "Qwen3_5ForCausalLM": (None, "model."),
}
_SOURCE_DTYPES = {"BF16", "F16", "F32"}


# --------------------------------------------------------------------------- config

def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path} must hold a JSON object")
    return value


def load_config(src: Path) -> tuple[dict, dict, str]:
    """(config.json, its text part, architecture name); errors name the missing piece."""
    path = src / "config.json"
    if not path.is_file():
        raise ModelNotFound(f"no config.json in {src}: not a Hugging Face model directory", field="src")
    config = read_json(path)
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ConversionError(f"unsupported architecture {archs or None} in {path}; "
                              f"supported: {', '.join(SUPPORTED)}")
    key = SUPPORTED[arch][0]
    text = config.get(key) if key else config
    if not isinstance(text, dict):
        raise ConversionError(f"{path}: {arch} needs a {key!r} object")
    return config, text, arch


def _need(text: dict, key: str):
    if key not in text:
        raise ConversionError(f"config is missing text setting {key!r}")
    return text[key]


def rope_settings(text: dict) -> tuple[float, int, list[int]]:
    """(theta, rotary width n_rot, 4 M-RoPE sections summing to n_rot/2)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConversionError(f"rope_type {rope_type!r} is not supported (only plain/M-RoPE)")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    n_rot = int(_need(text, "head_dim") * factor)
    half = n_rot // 2
    sections = list(rope.get("mrope_section") or [])
    if not sections:  # spread like Qwen's default [11, 11, 10] for 32 pairs
        sections = [half // 3 + (i < half % 3) for i in range(3)]
    sections = (sections + [0, 0, 0, 0])[:4]
    # Interleaved M-RoPE gives every rotary pair a section by index; pairs outside the sections
    # would rotate with the 4th (always 0 for text) position, silently breaking attention.
    if sum(sections) != half or n_rot % 2:
        raise ConversionError(f"mrope_section {sections} must sum to n_rot/2 = {half} "
                              f"(head_dim {text.get('head_dim')} x partial_rotary_factor {factor})")
    return theta, n_rot, sections


def text_dims(text: dict, tied: bool) -> tm.Dims:
    n_layer = int(_need(text, "num_hidden_layers"))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n_layer)]
    if len(layer_types) != n_layer or set(layer_types) - {"full_attention", "linear_attention"}:
        raise ConversionError(f"layer_types must list {n_layer} of linear_attention/full_attention")
    d = tm.Dims(hidden=_need(text, "hidden_size"), ffn=_need(text, "intermediate_size"),
                vocab=_need(text, "vocab_size"), heads=_need(text, "num_attention_heads"),
                kv_heads=text.get("num_key_value_heads", text["num_attention_heads"]),
                head_dim=_need(text, "head_dim"), lin_k_heads=_need(text, "linear_num_key_heads"),
                lin_v_heads=_need(text, "linear_num_value_heads"),
                lin_k_dim=_need(text, "linear_key_head_dim"),
                lin_v_dim=_need(text, "linear_value_head_dim"),
                conv_kernel=text.get("linear_conv_kernel_dim", 4), layer_types=list(layer_types),
                tied=tied)
    # llama.cpp's qwen35 graph uses one head size (ssm.state_size) for both keys and values.
    if d.lin_k_dim != d.lin_v_dim:
        raise ConversionError("linear_key_head_dim must equal linear_value_head_dim for llama.cpp")
    if d.lin_v_heads % d.lin_k_heads:
        raise ConversionError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if text.get("attention_bias") or text.get("hidden_act", "silu") != "silu":
        raise ConversionError("attention biases / non-SiLU activations are not supported")
    return d


def add_metadata(w: gguf.GGUFWriter, text: dict, d: tm.Dims, outtype: str, name: str,
                 file_type: int | None = None) -> None:
    """The header's keys; ``file_type``: llama.cpp's name for the whole file when it is not ``outtype``'s."""
    theta, n_rot, sections = rope_settings(text)
    k = lambda key: f"{TOWER_ARCH}.{key}"  # noqa: E731
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    w.add_uint32("general.file_type", int(tm.OUTTYPES[outtype][1]) if file_type is None else file_type)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    w.add_uint32(k("context_length"), int(text.get("max_position_embeddings", 262144)))
    w.add_uint32(k("embedding_length"), d.hidden)
    w.add_uint32(k("block_count"), len(d.layer_types))  # the MTP block is not written
    w.add_uint32(k("feed_forward_length"), d.ffn)
    w.add_uint32(k("attention.head_count"), d.heads)
    w.add_uint32(k("attention.head_count_kv"), d.kv_heads)
    w.add_uint32(k("attention.key_length"), d.head_dim)
    w.add_uint32(k("attention.value_length"), d.head_dim)
    w.add_float32(k("attention.layer_norm_rms_epsilon"), float(text.get("rms_norm_eps", 1e-6)))
    w.add_float32(k("rope.freq_base"), theta)
    w.add_uint32(k("rope.dimension_count"), n_rot)
    w.add_array(k("rope.dimension_sections"), sections)
    w.add_uint32(k("ssm.conv_kernel"), d.conv_kernel)
    w.add_uint32(k("ssm.state_size"), d.lin_k_dim)
    w.add_uint32(k("ssm.group_count"), d.lin_k_heads)
    w.add_uint32(k("ssm.time_step_rank"), d.lin_v_heads)
    w.add_uint32(k("ssm.inner_size"), d.lin_v_dim * d.lin_v_heads)
    # The explicit per-layer pattern wins over the interval in llama.cpp; write both.
    w.add_array(k("attention.recurrent_layers"), [t == "linear_attention" for t in d.layer_types])
    w.add_uint32(k("full_attention_interval"), int(text.get("full_attention_interval", 4)))


# --------------------------------------------------------------------------- checkpoint

@dataclass
class Planned:
    hf_name: str          # name in the checkpoint
    file: Path
    gguf_name: str
    edits: tuple[str, ...]
    qtype: gguf.GGMLQuantizationType
    layout: tuple         # (shape for GGUFWriter, numpy dtype, nbytes)


def checkpoint_files(src: Path) -> list[Path]:
    index = src / files.SAFETENSORS_INDEX
    if index.is_file():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (KeyError, AttributeError, TypeError) as exc:
            raise ConversionError(f"{index} is malformed: {exc}") from None
        paths = [src / n for n in names]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise ModelNotFound(f"weight shard(s) listed in {index.name} are missing: {', '.join(missing)}",
                                field="src")
        return paths
    paths = sorted(src.glob("model*.safetensors"))
    if not paths:
        raise ModelNotFound(f"no model*.safetensors in {src}", field="src")
    return paths


def open_weights(path: Path) -> contextlib.AbstractContextManager[Tensors]:
    """A checkpoint shard; a damaged one is a ConversionError blaming ``src``."""
    return opened(path, field="src", error=ConversionError, unreadable=f"cannot read {path.name}")


def scan_checkpoint(src: Path) -> dict[str, tuple[Path, list[int], str]]:
    """name -> (file, shape, dtype) from the safetensors headers; no tensor data is read."""
    found: dict[str, tuple[Path, list[int], str]] = {}
    for path in checkpoint_files(src):
        with open_weights(path) as weights:
            header = {name: (list(info.shape), info.dtype) for name, info in weights.header().items()}
        for name, (shape, dtype) in header.items():
            if name in found:
                raise ConversionError(f"tensor {name!r} appears in both {found[name][0].name} and {path.name}")
            found[name] = (path, shape, dtype)
    return found


def plan_tensors(src: Path, arch: str, text: dict, outtype: str) -> tuple[tm.Dims, list[Planned], int]:
    """Check the checkpoint against the config and plan every GGUF tensor. Returns (dims, plan, skipped)."""
    found = scan_checkpoint(src)
    prefix = SUPPORTED[arch][1]
    text_names, skipped = tm.text_names(found, prefix)
    tied = "lm_head.weight" not in text_names and bool(text.get("tie_word_embeddings"))
    d = text_dims(text, tied)
    expected = tm.expected_shapes(d)
    for name in text_names:
        if name not in expected:
            tm.gguf_name(name)  # raises for names we do not know at all
            raise ConversionError(f"unexpected tensor {text_names[name]!r} for this config "
                                  f"(check layer_types and tie_word_embeddings)")
    missing = sorted(set(expected) - set(text_names), key=tm.sort_key)
    if missing:
        shown = ", ".join(prefix + m if m != "lm_head.weight" else m for m in missing[:5])
        raise ConversionError(f"missing {len(missing)} tensor(s) in the checkpoint: {shown}"
                              + (" ..." if len(missing) > 5 else ""))
    plan = []
    for name in sorted(text_names, key=tm.sort_key):
        path, shape, dtype = found[text_names[name]]
        if shape != expected[name]:
            raise ConversionError(f"tensor {text_names[name]!r} has shape {shape}, config implies {expected[name]}")
        if dtype not in _SOURCE_DTYPES:
            raise ConversionError(f"tensor {text_names[name]!r} is {dtype}; only bf16/f16/f32 checkpoints convert")
        gg, edits = tm.gguf_name(name)
        out_shape = tm.output_shape(shape, edits)
        qtype = tm.storage_type(gg, out_shape, outtype)
        plan.append(Planned(text_names[name], path, gg, edits, qtype, tm.encoded_layout(out_shape, qtype)))
    return d, plan, skipped


# --------------------------------------------------------------------------- writing

@contextlib.contextmanager
def whole_gguf(writer: gguf.GGUFWriter, path: Path) -> Iterator[Path]:
    """``writer``'s header, key-values and tensor infos written to ``PATH.partial``, whose path the
    block gets to add the tensors' data; the file appears under its name only when the block ends
    without an error, so a failed run never leaves a loadable half."""
    tmp = path.with_name(path.name + ".partial")
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        yield tmp
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def stream_gguf(writer: gguf.GGUFWriter, path: Path, payloads: Iterable[np.ndarray]) -> None:
    """Header, then each tensor's bytes as they come (one tensor in memory at a time), as a whole file
    (``whole_gguf``)."""
    with whole_gguf(writer, path):
        for data in payloads:
            writer.write_tensor_data(data)


def write_tower(src: Path, path: Path, *, outtype: str = "f32", name: str = "clef",
                _skip_edits: frozenset[str] = frozenset()) -> dict:
    """Write the tower GGUF; returns a summary. ``_skip_edits`` exists only for negative tests."""
    if outtype not in tm.OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r}; choose one of {', '.join(tm.OUTTYPES)}")
    src = Path(src)
    config, text, arch = load_config(src)
    d, plan, skipped = plan_tensors(src, arch, text, outtype)
    tokenizer_json = src / files.TOKENIZER
    if not tokenizer_json.is_file():
        raise ModelNotFound(f"no tokenizer.json in {src}", field="src")
    tcfg_path = src / "tokenizer_config.json"
    tcfg = read_json(tcfg_path) if tcfg_path.is_file() else {}
    vocab = gguf_vocab.read_vocab(tokenizer_json, d.vocab, tcfg, text)

    writer = gguf.GGUFWriter(path=None, arch=TOWER_ARCH)
    add_metadata(writer, text, d, outtype, name)
    gguf_vocab.add_to_writer(writer, vocab)
    for item in plan:
        shape, dtype, nbytes = item.layout
        writer.add_tensor_info(item.gguf_name, shape, dtype, nbytes, raw_dtype=item.qtype)

    def payloads():
        with contextlib.ExitStack() as stack:
            handles = {}
            for item in plan:
                if item.file not in handles:
                    handles[item.file] = stack.enter_context(open_weights(item.file))
                tensor = handles[item.file].tensor(item.hf_name).to(torch.float32)
                tensor = tm.apply_edits(tensor, item.edits, d, _skip_edits)
                yield tm.encode(tensor.numpy(), item.qtype)

    stream_gguf(writer, path, payloads())
    return {"architecture": arch, "tensors": len(plan), "skipped_tensors": skipped,
            "vocab_size": d.vocab, "tokenizer_tokens": vocab.n_real,
            "config_sha256": hashlib.sha256((src / "config.json").read_bytes()).hexdigest()}
