"""The PyTorch vision tower against transformers' Qwen3_5Model.get_image_features / get_video_features.

Two releases: the tiny release as built (weights ~0.02, zero biases, unit norms, so attention is nearly uniform)
and the same release with every vision tensor redrawn at O(1) scale, where a wrong RoPE axis, position-grid
resize or patch order moves the embeddings by O(1), not by noise.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clef_gguf.convert.synthetic.tiny import build_release, strong_vision_tensor
from clef_gguf.core.errors import InferenceError, InvalidSetting
from clef_gguf.vision import VisionTower

# (grids, videos?): one image, one with a non-square grid larger than the position table, one smaller than
# it, two images at once, a two-frame-pair video.
GRIDS = [([[1, 4, 4]], False), ([[1, 6, 8]], False), ([[1, 2, 6]], False),
         ([[1, 4, 4], [1, 6, 8]], False), ([[2, 4, 4]], True)]
FP32_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def strong_release(tiny_release, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision-strong")
    gen = torch.Generator().manual_seed(17)
    for path in sorted(tiny_release.iterdir()):
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
            tensors = {name: strong_vision_tensor(name, t, gen) if name.startswith("model.visual.") else t
                       for name, t in tensors.items()}
            save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        else:
            shutil.copyfile(path, out / path.name)
    return out


@pytest.fixture(scope="module", params=["tiny", "strong"])
def release(request, tiny_release, strong_release):
    return {"tiny": tiny_release, "strong": strong_release}[request.param]


@pytest.fixture(scope="module")
def reference(release):
    import transformers

    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32)
    return model.eval().model


def _inputs(tower: VisionTower, grids: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(dim=1).sum()), tower.config.patch_dim, generator=gen), grid


@pytest.mark.parametrize("grids, video", GRIDS)
def test_embeddings_match_transformers(release, reference, grids, video):
    tower = VisionTower.load(release)
    pixel_values, grid = _inputs(tower, grids)
    ours = tower.embed(pixel_values, grid)
    with torch.no_grad():
        features = (reference.get_video_features if video else reference.get_image_features)(pixel_values, grid)
    expected = torch.cat(features.pooler_output)
    assert ours.dtype == torch.float32
    assert ours.shape == expected.shape == (sum(tower.n_tokens(grid)), reference.config.text_config.hidden_size)
    assert (ours - expected).abs().max().item() <= FP32_TOLERANCE
    assert [len(part) for part in tower.split(ours, grid)] == [len(p) for p in features.pooler_output]


def test_the_strong_release_is_sensitive(strong_release):
    # The embeddings are O(1) and depend on the patch order: the parity above is not a parity of near-zeros.
    tower = VisionTower.load(strong_release)
    pixel_values, grid = _inputs(tower, [[1, 6, 8]])
    out = tower.embed(pixel_values, grid)
    assert out.abs().max().item() > 0.5
    transposed = tower.embed(pixel_values, torch.tensor([[1, 8, 6]]))
    assert (out - transposed).abs().max().item() > 0.1


def test_images_are_independent(strong_release):
    # Attention stays inside each image (and each frame): two images at once = each alone.
    tower = VisionTower.load(strong_release)
    pixel_values, grid = _inputs(tower, [[1, 4, 4], [1, 6, 8]])
    both = tower.embed(pixel_values, grid)
    first = tower.embed(pixel_values[:16], grid[:1])
    second = tower.embed(pixel_values[16:], grid[1:])
    assert torch.allclose(both, torch.cat([first, second]), atol=1e-6)


def test_a_sharded_release_loads_the_same_tower(tmp_path, strong_release):
    sharded = build_release(tmp_path / "sharded", preset="tiny", seed=0, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    plain = build_release(tmp_path / "plain", preset="tiny", seed=0)
    a, b = VisionTower.load(sharded), VisionTower.load(plain)
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_bf16_is_close_to_fp32(strong_release):
    exact = VisionTower.load(strong_release)
    fast = VisionTower.load(strong_release, dtype=torch.bfloat16)
    assert fast.dtype == torch.bfloat16
    pixel_values, grid = _inputs(exact, [[1, 6, 8]])
    a, b = exact.embed(pixel_values, grid), fast.embed(pixel_values, grid)
    assert b.dtype == torch.float32
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def test_the_linear_kernel_is_fp32_and_falls_back_where_it_cannot_run():
    # model.Linear: oneDNN's fp32 kernel for inference where PyTorch has it; F.linear for anything else.
    from clef_gguf.vision.model import Linear, onednn_linear

    gen = torch.Generator().manual_seed(3)
    layer = Linear(1152, 512)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(512, 1152, generator=gen) / 34)
    x = torch.randn(200, 1152, generator=gen)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.float32
    assert ((got.double() - exact).norm() / exact.norm()).item() < 2e-6  # fp32 rounding, not bf16's 1e-3
    assert onednn_linear() == torch.backends.mkldnn.is_available()  # this CPU build has it
    x.requires_grad_(True)
    y = layer(x)  # autograd: F.linear
    y.sum().backward()
    assert x.grad is not None and torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    half = Linear(8, 4).to(torch.bfloat16)
    with torch.inference_mode():
        assert half(torch.ones(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_threads_apply_during_embed_only(tiny_release):
    before = torch.get_num_threads()
    tower = VisionTower.load(tiny_release, threads=1)
    pixel_values, grid = _inputs(tower, [[1, 4, 4]])
    tower.embed(pixel_values, grid)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("grids, patches, dim", [
    ([[1, 4, 4]], 15, None),      # one patch short
    ([[1, 4, 4]], 16, 47),        # another patch size
    ([[1, 3, 4]], 12, None),      # a height the 2 x 2 merge cannot cover
    ([[1, 4]], 16, None),         # not [n, 3]
    ([[0, 4, 4]], 0, None),       # an empty grid
])
def test_inputs_that_do_not_fit_are_refused(tiny_release, grids, patches, dim):
    tower = VisionTower.load(tiny_release)
    pixel_values = torch.zeros(patches, dim or tower.config.patch_dim)
    with pytest.raises(InferenceError) as caught:
        tower.embed(pixel_values, torch.tensor(grids))
    assert caught.value.field == "vision"


@pytest.mark.parametrize("options", [{"dtype": torch.int8}, {"threads": 0}, {"threads": True}])
def test_bad_settings_are_refused(tiny_release, options):
    with pytest.raises(InvalidSetting):
        VisionTower.load(tiny_release, **options)


def test_a_random_tower_has_the_shape_it_is_given_and_its_seed_draws_it(tiny_release):
    """``VisionTower.random`` (pick --picture times one): the config's shape, finite rows, the seed's weights,
    and the engine applied as ``load`` applies it."""
    config = VisionTower.load(tiny_release).config
    a, b = VisionTower.random(config, seed=1), VisionTower.random(config, seed=1)
    pixels, grid = torch.randn(16, config.patch_dim), torch.tensor([[1, 4, 4]])
    rows = a.embed(pixels, grid)
    assert rows.shape == (4, config.out_hidden_size) and torch.isfinite(rows).all()
    assert torch.equal(rows, b.embed(pixels, grid))
    assert not torch.equal(rows, VisionTower.random(config, seed=2).embed(pixels, grid))
    assert VisionTower.random(config, engine="int8").engine == "int8"
    with pytest.raises(InvalidSetting, match="vision_engine"):
        VisionTower.random(config, engine="fast")
