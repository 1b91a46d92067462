"""Strict loading of joint_head_config.json + joint_head.safetensors, and every way those files can be wrong."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clef_gguf.core.errors import ClefError, CorruptModel, HeadMismatch, ModelNotFound
from clef_gguf.convert.synthetic.head import random_head
from clef_gguf.heads import head_scalars, load_head, read_head_config, save_head

JUDGE = dict(hidden_size=32, width=16, routing_layers=2, layers=4, heads=2, feedforward=24)
CONFIG = "joint_head_config.json"
WEIGHTS = "joint_head.safetensors"


@pytest.fixture
def saved(tmp_path):
    """A random head written as a release would be (bf16 weights), and the head itself."""
    head = random_head(JUDGE, seed=1)
    save_head(head, tmp_path)
    return tmp_path, head


def load(directory, **kwargs):
    return load_head(directory / CONFIG, directory / WEIGHTS, **kwargs)


def rewrite_weights(directory, change):
    tensors = load_file(str(directory / WEIGHTS))
    change(tensors)
    save_file(tensors, str(directory / WEIGHTS))


def rewrite_config(directory, change):
    config = json.loads((directory / CONFIG).read_text())
    change(config)
    (directory / CONFIG).write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------------- success


def test_save_writes_the_release_format(saved):
    directory, _ = saved
    assert json.loads((directory / CONFIG).read_text()) == JUDGE  # exactly the six keys, no dropout
    with safe_open(str(directory / WEIGHTS), framework="pt") as handle:
        names = list(handle.keys())
        assert len(names) == 122
        assert {handle.get_tensor(name).dtype for name in names} == {torch.bfloat16}


def test_strict_load_round_trip(saved):
    directory, head = saved
    loaded = load(directory, hidden_size=32)
    assert not loaded.training and loaded.hidden_norm.weight.dtype == torch.float32
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    assert head_scalars(loaded) == pytest.approx(head_scalars(head), abs=1e-2)
    assert set(head_scalars(loaded)) == {"prior_logit_scale", "joint_logit_scale", "residual_gate"}


def test_load_in_bf16(saved):
    directory, _ = saved
    loaded = load(directory, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    with torch.inference_mode():
        out = loaded(torch.randn(6, 32), torch.randn(3, 32), [(0, 2)], [(2, 4), (5, 6)], [2], [1])
    assert out.dtype == torch.bfloat16 and out.shape == (2,) and bool(torch.isfinite(out).all())


def test_optional_dropout_key_is_accepted(saved):
    directory, _ = saved
    rewrite_config(directory, lambda config: config.update(dropout=0.1))
    assert load(directory).config == JUDGE


def test_fp32_file_loads_too(saved):
    directory, head = saved
    save_head(head, directory, dtype=torch.float32)
    assert torch.equal(load(directory).memory_projection.weight, head.memory_projection.weight)


# ---------------------------------------------------------------------------------------------- weights


def test_missing_tensor(saved):
    directory, _ = saved
    rewrite_weights(directory, lambda t: t.pop("layers.2.norm3.bias"))
    with pytest.raises(HeadMismatch, match=r"1 missing tensor\(s\): layers\.2\.norm3\.bias"):
        load(directory)


def test_unexpected_tensor(saved):
    directory, _ = saved
    rewrite_weights(directory, lambda t: t.update({"temperature": torch.ones(())}))
    with pytest.raises(HeadMismatch, match=r"unexpected tensor\(s\): temperature"):
        load(directory)


def test_wrong_shape(saved):
    directory, _ = saved
    rewrite_weights(directory, lambda t: t.update({"type_embedding.weight": torch.zeros(4, 16)}))
    with pytest.raises(HeadMismatch, match=r"type_embedding\.weight \[4, 16\] \(expected \[3, 16\]\)"):
        load(directory)


def test_many_problems_are_summarised(saved):
    directory, _ = saved
    rewrite_weights(directory, lambda t: [t.pop(name) for name in [n for n in t if n.startswith("layers.")]])
    with pytest.raises(HeadMismatch, match=r"72 missing tensor\(s\): .*\.\.\. and 67 more") as caught:
        load(directory)
    assert caught.value.field == "head_weights"


def test_weights_of_another_config(saved, tmp_path_factory):
    """A head built for the 8-wide 'verdict' config against the 16-wide config: names fit, shapes do not."""
    directory, _ = saved
    other = tmp_path_factory.mktemp("other")
    save_head(random_head(dict(JUDGE, width=8), seed=2), other)
    (directory / WEIGHTS).write_bytes((other / WEIGHTS).read_bytes())
    with pytest.raises(HeadMismatch, match="wrong shape"):
        load(directory)


def test_integer_tensor(saved):
    directory, _ = saved
    rewrite_weights(directory, lambda t: t.update({"residual_gate": torch.tensor(1, dtype=torch.int64)}))
    with pytest.raises(HeadMismatch, match="residual_gate has dtype torch.int64"):
        load(directory)


def test_non_finite_weight(saved):
    directory, _ = saved

    def poison(tensors):
        tensors["option_norm.weight"][3] = float("nan")

    rewrite_weights(directory, poison)
    with pytest.raises(CorruptModel, match="option_norm.weight contains NaN"):
        load(directory)


@pytest.mark.parametrize("keep", [0, 5, 8, 100, -1, -1000])
def test_truncated_file(saved, keep):
    directory, _ = saved
    raw = (directory / WEIGHTS).read_bytes()
    (directory / WEIGHTS).write_bytes(raw[: keep if keep >= 0 else len(raw) + keep])
    with pytest.raises(CorruptModel, match="not a readable safetensors file") as caught:
        load(directory)
    assert caught.value.field == "head_weights"


def test_not_safetensors_at_all(saved):
    directory, _ = saved
    (directory / WEIGHTS).write_text("<html>404 Not Found</html>" * 10)
    with pytest.raises(CorruptModel):
        load(directory)


def test_missing_weights_file(saved):
    directory, _ = saved
    (directory / WEIGHTS).unlink()
    with pytest.raises(ModelNotFound, match="head weights not found"):
        load(directory)


def test_weights_path_is_a_directory(saved):
    directory, _ = saved
    with pytest.raises(ModelNotFound):
        load_head(directory / CONFIG, directory)


# ---------------------------------------------------------------------------------------------- config


def test_unexpected_config_key(saved):
    directory, _ = saved
    rewrite_config(directory, lambda config: config.update(num_types=3))
    with pytest.raises(HeadMismatch, match="unexpected key.*num_types") as caught:
        load(directory)
    assert caught.value.field == "head_config"


def test_missing_config_key(saved):
    directory, _ = saved
    rewrite_config(directory, lambda config: config.pop("routing_layers"))
    with pytest.raises(HeadMismatch, match="missing key.*routing_layers"):
        load(directory)


@pytest.mark.parametrize("value", [16.0, "16", True, None, [16]])
def test_non_integer_config_value(saved, value):
    directory, _ = saved
    rewrite_config(directory, lambda config: config.update(width=value))
    with pytest.raises(HeadMismatch, match="width must be an integer"):
        load(directory)


@pytest.mark.parametrize("change, message", [
    (dict(heads=0), "heads must be >= 1"),
    (dict(layers=-1), "layers must be >= 0"),
    (dict(heads=3), "not divisible"),
    (dict(dropout="none"), "dropout"),
])
def test_invalid_config_values(saved, change, message):
    directory, _ = saved
    rewrite_config(directory, lambda config: config.update(change))
    with pytest.raises(HeadMismatch, match=message):
        load(directory)


def test_config_not_an_object(saved):
    directory, _ = saved
    (directory / CONFIG).write_text("[32, 16]")
    with pytest.raises(HeadMismatch, match="must be a JSON object"):
        read_head_config(directory / CONFIG)


def test_config_not_json(saved):
    directory, _ = saved
    (directory / CONFIG).write_bytes(b'{"hidden_size": 32,')
    with pytest.raises(CorruptModel, match="cannot read head config"):
        load(directory)


def test_missing_config_file(saved):
    directory, _ = saved
    (directory / CONFIG).unlink()
    with pytest.raises(ModelNotFound, match="head config not found"):
        load(directory)


def test_hidden_size_mismatch(saved):
    directory, _ = saved
    with pytest.raises(HeadMismatch, match="head hidden_size 32 does not match the tower's n_embd 64"):
        load(directory, hidden_size=64)


def test_errors_are_clef_errors():
    assert issubclass(HeadMismatch, ClefError) and issubclass(CorruptModel, ClefError)


# ---------------------------------------------------------------------------------------------- no crash

FUZZ = textwrap.dedent(
    """
    import random, shutil, sys
    from pathlib import Path
    from clef_gguf.core.errors import ClefError
    from clef_gguf.heads import load_head

    source = Path(sys.argv[1])
    raw = (source / "joint_head.safetensors").read_bytes()
    header = int.from_bytes(raw[:8], "little")
    variants = [raw[:cut] for cut in (1, 7, 8, 9, 8 + header // 2, 8 + header, 9 + header, len(raw) // 2, len(raw) - 1)]
    for value in (0, 1, header - 1, header + 1, len(raw), 2**40, 2**64 - 1):
        variants.append(value.to_bytes(8, "little") + raw[8:])
    rng = random.Random(0)
    for _ in range(150):  # single-byte edits in the JSON header: names, dtypes, shapes, offsets
        data = bytearray(raw)
        data[rng.randrange(8, 8 + header)] = rng.choice(b'0123456789[]{}",:FBIU ')
        variants.append(bytes(data))
    outcomes = {}
    for index, data in enumerate(variants):
        target = Path(sys.argv[2]) / f"case{index}"
        target.mkdir()
        shutil.copy(source / "joint_head_config.json", target)
        (target / "joint_head.safetensors").write_bytes(data)
        try:
            load_head(target / "joint_head_config.json", target / "joint_head.safetensors")
            outcome = "loaded"
        except ClefError as error:
            outcome = error.code
        except BaseException as error:
            print("ESCAPED", index, type(error).__name__, error)
            sys.exit(3)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(sorted(outcomes.items()))
    """
)


@pytest.mark.slow  # hundreds of damaged files in child processes
def test_corrupted_files_never_crash_the_process(saved, tmp_path_factory):
    """Truncations, absurd header lengths and header byte flips, in a child process so a crash is visible."""
    directory, _ = saved
    scratch = tmp_path_factory.mktemp("fuzz")
    done = subprocess.run(
        [sys.executable, "-c", FUZZ, str(directory), str(scratch)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "corrupt_model" in done.stdout
