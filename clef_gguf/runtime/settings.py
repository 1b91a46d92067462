"""How a model is loaded, as one typed object: every field's type, bounds and help text live here.

``LoadSettings`` is what ``Clef.load`` takes (its keywords build one), what every command's load flags
are generated from (``add_arguments`` / ``from_args``: decide, serve, batch, eval, calibrate, bench,
parity), and what the Ray engines ship to each actor or replica (``for_workers``), so a flag cannot be
mapped by hand in one place and forgotten in another. As llama-cpp-python's server settings: the
object is the source, the argparse flags are derived from it (``core.commandline.CommandSettings``, the
one generator every command's settings share).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import Field

from clef_gguf.core import errors
from clef_gguf.core import argtypes
from clef_gguf.core.commandline import CommandSettings, Flag
from clef_gguf.core.cpus import available_cpus
from clef_gguf.core.limits import CONTEXT_WINDOW, DECODE_CHUNK, MAX_MB, VISION_CACHE_MB, VisionEngine
from clef_gguf.formats.calibration import Calibration
from clef_gguf.tower.cache import DEFAULT_MB

PathLike = Union[str, Path]
# One fine-tune (a directory: it answers every request) or several by name (the base answers
# unless a request's ``model`` names one).
Adapters = Union[PathLike, Mapping[str, PathLike]]
Whole = Annotated[int, pydantic.Strict(), Field(ge=1)]  # True is not a thread count


class LoadSettings(CommandSettings):
    """Everything ``Clef.load`` needs to open a model; frozen, picklable (the Ray paths ship it)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    flag_group = "model"

    model: Annotated[PathLike | None, Flag(("--model", "-m"))] = Field(default=None, description=(
        "a converted model directory, a .gguf next to its head files, or a catalog name such as "
        "clef-flash:Q4_K_M / clef-flash:auto"))
    backend: Literal["auto", "gguf", "nvfp4"] = Field(default="auto", description=(
        "which tower runs: gguf (llama.cpp on a .gguf), nvfp4 (PyTorch on a compressed-tensors "
        "NVFP4/NVFP4A16 checkpoint directory: native FP4 on Blackwell GPUs, a dequantizing fallback on "
        "other GPUs and, slowly, on the CPU); auto (default): what the model's files are"))
    gguf: PathLike | None = Field(default=None, description="tower GGUF path (overrides the directory's)")
    head: PathLike | None = Field(default=None, description="joint_head.safetensors path")
    head_config: PathLike | None = Field(default=None, description="joint_head_config.json path")
    tokenizer: PathLike | None = Field(default=None, description="tokenizer.json path")
    threads: Annotated[Whole | None, Flag(type=argtypes.positive_int)] = Field(default=None, description=(
        "CPU threads for the tower (default: all cores available to this process)"))
    head_threads: Annotated[Whole | None, Flag(type=argtypes.positive_int)] = Field(default=None, description=(
        "torch threads for the head (default: as many as the tower; the head runs after the tower "
        "on the same cores)"))
    gpu_layers: Annotated[Union[Annotated[int, pydantic.Strict(), Field(ge=-1)], Literal["auto", "all"]],
                          Flag(type=argtypes.gpu_layers)] = Field(default="auto", description=(
        "tower layers on the GPU: auto (default: all when this llama-cpp-python build has a GPU "
        "backend and the model fits, as `clef-gguf pick` says; else 0), all, or a count; 0 keeps "
        "it on the CPU (nvfp4: auto/all use CUDA when present, 0 the CPU)"))
    max_length: Annotated[Whole, Flag(type=argtypes.positive_int)] = Field(default=CONTEXT_WINDOW, description=(
        f"prompt window in tokens (reference: {CONTEXT_WINDOW}); longer requests are refused"))
    head_device: Annotated[str, pydantic.StringConstraints(pattern=r"^(auto|cpu|cuda(:\d+)?)$"),
                           Flag(type=argtypes.head_device)] = Field(default="auto", description=(
        "where the joint head runs: auto (default: the GPU that holds the tower's layers when torch sees "
        "CUDA, else the CPU), cpu, cuda or cuda:N (refused where torch has no CUDA); fp32 with TF32 off "
        "unless --head-dtype bf16"))
    nvfp4_dtype: Literal["auto", "bf16", "fp32"] = Field(default="auto", description=(
        "the nvfp4 backend's compute dtype: auto (default: bf16 on CUDA, fp32 on the CPU), bf16, or fp32 "
        "(on CUDA: the CPU's numbers, for like-for-like checks); the gguf backend takes only auto"))
    head_dtype: Annotated[Literal["fp32", "bf16"], Flag(("--head-dtype", "--precision"), unless_given=True)] = Field(
        default="fp32", description="the head's dtype: fp32 (default, unless `clef-gguf tune` chose bf16 "
                            "here) or bf16 (the reference's numerics); --precision is its earlier name")
    decode_chunk: Annotated[Whole | None, Flag(type=argtypes.positive_int)] = Field(default=None, description=(
        "tokens per llama_decode in the tower (llama.cpp's n_batch = n_ubatch; default: what `clef-gguf "
        f"tune` chose for this model here, else {DECODE_CHUNK}); other chunks move answers by up to ~1e-4"))
    flash_attention: Literal["auto", "on", "off"] = Field(default="auto", description=(
        "llama.cpp's flash attention: auto (default: what `clef-gguf tune` chose for this model here, else "
        "llama.cpp's own choice; f32 towers on the CPU keep exact f32 attention), on or off"))
    pack_size: Annotated[Whole | None, Flag(type=argtypes.positive_int)] = Field(default=None, description=(
        "prompts decoded together per llama_decode when several are waiting (default: what `clef-gguf "
        "tune` chose for this model here, else 4 on the CPU, 16 on a GPU; 1: one at a time)"))
    tune: Annotated[bool, Flag(
        ("--no-tune",), action="store_true", to_setting=lambda no_tune: not no_tune,
        help="ignore what `clef-gguf tune` measured for this model on this machine: the built-in defaults "
             "for every setting no flag gives")] = Field(default=True, description=(
            "run with what `clef-gguf tune` measured for this model on this machine (threads, decode chunk, "
            "flash attention, pack size, head device and dtype) wherever no setting is given"))
    allow_download: Annotated[bool, Flag(
        ("--offline",), action="store_true", to_setting=lambda offline: not offline,
        help="never download: catalog names resolve from the local cache only")] = Field(default=False, description=(
            "download a catalog model missing from the local Hugging Face cache (the Python API's "
            "default is not to; the commands download unless --offline)"))
    state_cache_mb: Annotated[float, pydantic.Strict(), Field(ge=0, lt=MAX_MB), Flag(type=argtypes.megabytes)] = Field(
        default=DEFAULT_MB, description=(
        "memory for reusing decoded states: another question set about a state seen before decodes "
        "only its questions, a repeated request skips the tower "
        f"(default {DEFAULT_MB} MiB; 0 turns it off)"))
    vision_cache_mb: Annotated[float, pydantic.Strict(), Field(ge=0, lt=MAX_MB),
                               Flag(type=argtypes.megabytes)] = Field(default=VISION_CACHE_MB, description=(
        "memory for reusing the vision tower's output: a picture seen before is not run through the "
        "vision tower again, whatever state or questions come with it "
        f"(default {VISION_CACHE_MB} MiB, ~80 Clef-Flash pictures of 448x448; 0 turns it off)"))
    vision_engine: VisionEngine = Field(default="exact", description=(
        "how the vision tower runs: exact (default: fp32, the reference's numerics; ~2.3 s for a 448x448 "
        "picture at Clef-Flash's shape on 2 cores) or int8 (its blocks' matmuls in dynamic int8: ~2x faster; "
        "answers within max |dp| 4.5e-4 of exact on the test releases, but its vision rows move ~4 in 100 "
        "at Clef-Flash's shape: docs/media.md)"))
    strict: Annotated[bool, Flag(action="store_true")] = Field(default=False, description=(
        "refuse what the reference lets through: unknown keys (unknown_field), a \"model\" this process "
        "does not serve (unknown_model), and requests past Jev's limits (1-64 questions, 2-255 choice "
        "options, 2-10 score levels). Without it, as the reference: unknown keys are ignored and named in "
        "the response's \"warnings\"; any \"model\" is answered by the default model (named in "
        "\"warnings\" only when fine-tunes are loaded); the limits are not applied"))
    calibration: Annotated[PathLike | Calibration | None, Flag(metavar="CAL.json")] = Field(default=None, description=(
        "apply the temperatures a `clef-gguf calibrate` file fitted for this very model "
        "(softmax(logits / T) per question; audit.calibration_version names it); a file fitted on "
        "other weights is refused. Default: none (T = 1, the reference's probabilities)"))
    adapters: Annotated[Adapters | None, Flag(
        ("--adapter",), action="append", metavar="[NAME=]DIR",
        to_setting=lambda flags: parse_adapter_flags(flags))] = Field(default=None, description=(
            "a fine-tune on this tower (a `clef-gguf convert adapter` directory: a LoRA applied by "
            "llama.cpp at run time, on any quant of its base, plus its head). One bare DIR: it answers "
            "every request. Repeat as NAME=DIR for several: the tower loads once, the base answers "
            "unless a request's \"model\" names one"))

    @classmethod
    def of(cls, *, precision: str | None = None, **values: Any) -> LoadSettings:
        """Settings from keywords, a bad one refused as ``invalid_setting`` naming its field.
        ``precision`` is ``head_dtype``'s earlier name (the audit's "precision" is the tower's);
        ``backend`` and ``gpu_layers`` None mean auto, as ``Clef.load`` always took them."""
        for name in ("backend", "gpu_layers"):
            if name in values and values[name] is None:
                values[name] = "auto"
        if precision is not None:
            if values.get("head_dtype", "fp32") not in ("fp32", precision):
                raise errors.InvalidSetting(f"precision={precision!r} and head_dtype={values['head_dtype']!r} "
                                            "disagree: precision is head_dtype's earlier name, give one",
                                            field="precision")
            values["head_dtype"] = precision
        try:
            return cls(**values)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "settings"
            if first["type"] == "extra_forbidden":
                raise errors.InvalidSetting(f"unknown load setting {name!r}", field=name) from None
            got = values.get(name)
            raise errors.InvalidSetting(f"{name}: {first['msg'].lower()} (got {got!r})", field=name) from None

    # ------------------------------------------------------------ the command line, derived
    # (the flags: ``CommandSettings.add_arguments``, one per field, in a "model" group)
    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> LoadSettings:
        """The settings a command's parsed flags give (``add_arguments``), ``overrides`` on top."""
        return cls.of(**(cls.values_from_args(args) | overrides))

    @classmethod
    def from_strings(cls, pairs: Mapping[str, str]) -> LoadSettings:
        """Settings from ``key=value`` strings (``serve run ...:build model=DIR threads=2``), parsed by
        the very flags the commands have, so each value is checked as it is on the command line."""
        parser = argparse.ArgumentParser(prog="settings", add_help=False, exit_on_error=False)
        cls.add_arguments(parser)
        argv: list[str] = []
        for key, value in pairs.items():
            if key not in cls.model_fields and key != "offline":
                raise errors.InvalidSetting(f"unknown load setting {key!r}", field=key)
            yes = value.lower() in ("1", "true", "yes")
            if key == "tune":  # one flag, --no-tune
                argv += [] if yes else ["--no-tune"]
                continue
            if key in ("offline", "allow_download"):  # one flag, --offline, says both
                argv += ["--offline"] if yes == (key == "offline") else []
                continue
            flag = cls.flag(key)
            option = (flag.names or (f"--{key.replace('_', '-')}",))[0]
            if flag.action == "store_true":
                argv += [option] if yes else []
            else:
                argv += [option, value]
        try:
            args = parser.parse_args(argv)
        except (argparse.ArgumentError, SystemExit) as exc:
            raise errors.InvalidSetting(f"bad load setting: {exc}", field="settings") from None
        return cls.from_args(args)

    # ------------------------------------------------------------ copies for other processes
    def for_workers(self, *, threads: int | None = None) -> LoadSettings:
        """These settings for a Ray actor or replica, which need not share our working directory:
        paths that exist here made absolute (a catalog name, or a path only the nodes have, goes as
        given), and the thread count each copy gets."""
        adapters = self.adapters
        if isinstance(adapters, Mapping):
            adapters = {name: _absolute(path) for name, path in adapters.items()}
        elif adapters is not None:
            adapters = _absolute(adapters)
        calibration = self.calibration if isinstance(self.calibration, Calibration) else \
            _absolute(self.calibration) if self.calibration is not None else None
        return self.model_copy(update={
            "model": _absolute(self.model) if self.model is not None else None,
            **{role: _absolute(v) if (v := getattr(self, role)) is not None else None
               for role in ("gguf", "head", "head_config", "tokenizer")},
            "adapters": adapters, "calibration": calibration,
            "threads": threads if threads is not None else self.threads})


def per_replica_threads(asked: int | None, replicas: int) -> int:
    """``asked``, else this machine's cores shared out over the replicas."""
    return asked or max(1, available_cpus() // replicas)


def for_replicas(args: argparse.Namespace, asked_threads: int | None, replicas: int) -> LoadSettings:
    """What each Ray actor or replica loads: the command's load flags, its share of the cores."""
    return LoadSettings.from_args(args).for_workers(threads=per_replica_threads(asked_threads, replicas))


def parse_adapter_flags(values: list[str] | None) -> Adapters | None:
    """``--adapter [NAME=]DIR`` flags -> ``adapters``. One bare DIR: that fine-tune answers;
    otherwise each needs a NAME (the base answers unless a request names one)."""
    if not values:
        return None
    if len(values) == 1 and "=" not in values[0]:
        return values[0]
    out: dict[str, str] = {}
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or not name or not directory:
            raise errors.InvalidSetting(f"--adapter {value!r}: with several fine-tunes each is "
                                        "NAME=DIR", field="adapter")
        if name in out:
            raise errors.InvalidSetting(f"--adapter: the name {name!r} is given twice", field="adapter")
        out[name] = directory
    return out


def _absolute(value: PathLike) -> str:
    return str(Path(value).resolve()) if Path(value).exists() else str(value)
