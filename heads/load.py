"""Reading and writing joint heads.

The release ships ``joint_head_config.json`` (exactly the constructor's keyword arguments) and
``joint_head.safetensors`` (122 bf16 tensors). The reference loads both strictly; so does ``load_head``, and it
turns every way those files can be wrong into a ``ModelLoadError`` subclass instead of a Python traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from clef_gguf.core import errors
from clef_gguf.core.errors import CorruptModel, HeadMismatch, ModelNotFound
from clef_gguf.formats.files import HEAD_CONFIG, HEAD_WEIGHTS
from clef_gguf.formats.safetensors import opened
from clef_gguf.heads.joint import JointSchemaHead

# The constructor's keyword arguments, in the order the release config lists them.
CONFIG_KEYS = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")
# The constructor also takes dropout; it is accepted in a config and ignored (inference never drops out).
OPTIONAL_KEYS = ("dropout",)
SCALARS = ("prior_logit_scale", "joint_logit_scale", "residual_gate")
# Float8 and integer tensors are not a head the reference could have saved.
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Far above any release head (Flash: 1024 wide, 2 + 4 layers), and low enough that building one
# (~1 ms a layer, even on the meta device) and torch's size arithmetic stay bounded.
MAX_SIZE, MAX_LAYERS = 1 << 20, 256
# How many offending names an error message lists before "... and N more".
SHOWN = 5
# ValueError: not UTF-8 or not JSON; RecursionError: nested past Python's stack.
JSON_ERRORS: dict[type[BaseException], type[errors.ClefError]] = {
    OSError: CorruptModel, ValueError: CorruptModel, RecursionError: CorruptModel}


def check_config(config: object, source: str = HEAD_CONFIG) -> dict[str, int]:
    """The six head sizes of ``config`` as ints; HeadMismatch naming the key on anything else.

    The reference builds ``JointSchemaHead(**config)``, so an unknown key is a different model, not noise.
    """
    if not isinstance(config, Mapping):
        raise HeadMismatch(f"{source} must be a JSON object, got {type(config).__name__}", field="head_config")
    unexpected = [key for key in config if key not in CONFIG_KEYS and key not in OPTIONAL_KEYS]
    if unexpected:
        raise HeadMismatch(f"{source} has unexpected key(s): {_names(unexpected)}", field="head_config")
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise HeadMismatch(f"{source} is missing key(s): {_names(missing)}", field="head_config")
    sizes: dict[str, int] = {}
    for key in CONFIG_KEYS:
        value = config[key]
        # bool is an int subclass in Python; `true` is no layer count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise HeadMismatch(f"{source}: {key} must be an integer, got {value!r}", field="head_config")
        # Zero routing or decoder blocks is a degenerate but constructible head; zero sizes are not.
        least, most = (0, MAX_LAYERS) if key in ("routing_layers", "layers") else (1, MAX_SIZE)
        if value < least:
            raise HeadMismatch(f"{source}: {key} must be >= {least}, got {value}", field="head_config")
        if value > most:
            raise HeadMismatch(f"{source}: {key} must be <= {most}, got {value}",
                               field="head_config")
        sizes[key] = value
    dropout = config.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise HeadMismatch(f"{source}: dropout must be a number in [0, 1), got {dropout!r}", field="head_config")
    if sizes["width"] % sizes["heads"]:
        raise HeadMismatch(
            f"{source}: width {sizes['width']} is not divisible by heads {sizes['heads']}", field="head_config"
        )
    return sizes


def read_head_config(path: str | Path) -> dict[str, int]:
    """Parse and check ``joint_head_config.json``."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"head config not found: {path}", field="head_config")
    with errors.mapped(JSON_ERRORS, field="head_config", what=f"cannot read head config {path}"):
        config = json.loads(path.read_text(encoding="utf-8"))
    return check_config(config, source=path.name)


def load_head(
    config_path: str | Path,
    weights_path: str | Path,
    *,
    hidden_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> JointSchemaHead:
    """Build the head from its config and load the weights strictly; cast to ``dtype``, eval mode.

    ``hidden_size`` is the tower's n_embd; a head trained for another tower is refused. Use
    ``dtype=torch.bfloat16`` to reproduce the reference's bf16 arithmetic.
    """
    sizes = read_head_config(config_path)
    if hidden_size is not None and hidden_size != sizes["hidden_size"]:
        raise HeadMismatch(
            f"head hidden_size {sizes['hidden_size']} does not match the tower's n_embd {hidden_size}",
            field="head_config",
        )
    # On the meta device the module costs nothing to build; load_state_dict(assign=True) then adopts the file's
    # tensors, so a Flash-sized head is never randomly initialised only to be overwritten.
    with torch.device("meta"):
        head = JointSchemaHead(**sizes)
    expected = {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}
    tensors = _read_weights(Path(weights_path), expected, dtype)
    head.load_state_dict(tensors, strict=True, assign=True)
    head.requires_grad_(False)
    return head.eval()


def _read_weights(path: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file's tensors in ``dtype``, after checking names, shapes, dtypes and finiteness against
    ``expected``. Each is cast as it is read, so the file's bf16 copy of one tensor at a time is all the
    load holds beside the result (a Flash head: 0.45 GiB in fp32, not 0.68 with every bf16 copy too)."""
    with opened(path, field="head_weights", kind="head weights") as weights:
        shapes = {name: info.shape for name, info in weights.header().items()}
        problems = _layout_problems(shapes, expected)
        if problems:
            raise HeadMismatch(f"{path.name} does not fit the head config: {problems}", field="head_weights")
        tensors = {}
        for name in expected:
            tensor = weights.tensor(name, check_finite=True)
            if tensor.dtype not in WEIGHT_DTYPES:
                raise HeadMismatch(
                    f"{path.name}: tensor {name} has dtype {tensor.dtype}, expected bf16, f16, f32 or f64",
                    field="head_weights",
                )
            tensors[name] = tensor.to(dtype)
    return tensors


def _layout_problems(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str:
    """Missing keys, unexpected keys and wrong shapes, as one message (empty when the layout fits)."""
    parts = []
    missing = [name for name in expected if name not in found]
    if missing:
        parts.append(f"{len(missing)} missing tensor(s): {_names(missing)}")
    unexpected = [name for name in found if name not in expected]
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
    wrong = [
        f"{name} {list(found[name])} (expected {list(shape)})"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    if wrong:
        parts.append(f"{len(wrong)} wrong shape(s): {_names(wrong)}")
    return "; ".join(parts)


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown if len(items) <= SHOWN else f"{shown}, ... and {len(items) - SHOWN} more"


def head_scalars(head: JointSchemaHead) -> dict[str, float]:
    """The three learned scalars as raw floats (the runtime prints them at load)."""
    return {name: float(getattr(head, name).detach().float()) for name in SCALARS}


def save_head(head: JointSchemaHead, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``joint_head.safetensors`` (release dtype bf16 by default) and ``joint_head_config.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in head.state_dict().items()}
    save_file(state, str(directory / HEAD_WEIGHTS), metadata={"format": "pt"})
    (directory / HEAD_CONFIG).write_text(json.dumps(dict(head.config), indent=2) + "\n", encoding="utf-8")
    return directory
