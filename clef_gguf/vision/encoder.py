"""``VisionTower``: a loaded vision tower, the object the runtime holds to embed images and videos."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from clef_gguf.core.cpus import check_threads, torch_threads
from clef_gguf.core.errors import InferenceError, InvalidSetting
from clef_gguf.vision import engines, load
from clef_gguf.vision.model import VisionConfig, VisionModel

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Source = str | os.PathLike | tuple[str | os.PathLike, str | os.PathLike]


class VisionTower:
    """``embed(pixel_values, grid_thw) -> [tokens, out_hidden_size]`` float32, the embeddings that replace
    the ``<|image_pad|>``/``<|video_pad|>`` ids, in their order. Owns its module and its thread count."""

    def __init__(self, model: VisionModel, *, source: Path, threads: int | None = None,
                 files: tuple[Path, ...] = (), engine: str = engines.DEFAULT) -> None:
        """``files``: the weight files the tensors were read from (what the vision cache's keys name);
        ``engine``: how ``model`` runs (``engines.apply`` made it so)."""
        self.model, self.source, self.threads, self.files = model, source, threads, files
        self.engine = engines.check(engine)

    @classmethod
    def load(cls, source: Source, dtype: torch.dtype = torch.float32, threads: int | None = None,
             engine: str = engines.DEFAULT) -> VisionTower:
        """``source``: a converted model directory (``vision_config.json`` + ``vision.safetensors``), a Hugging
        Face release directory (``config.json`` + ``model*.safetensors``; only the vision tensors are read), or
        the pair (vision config path, vision weights path). ``dtype``: float32 (exact) or bfloat16/float16.
        ``engine``: ``exact`` (the module as built) or ``int8`` (its blocks quantized; float32 only)."""
        engines.check(engine)
        if dtype not in DTYPES:
            raise InvalidSetting(f"the vision tower runs in float32, bfloat16 or float16, not {dtype}", field="vision")
        check_threads(threads)
        if isinstance(source, tuple):
            config, sources = load.file_sources(Path(source[0]), Path(source[1]))
            where = Path(source[1])
        else:
            where = Path(source)
            config, sources = load.sources(where)
        model = engines.apply(load.build(config, load.read_tensors(sources, config), dtype), engine)
        files = tuple(sorted({path for path, _ in sources.values()}))
        return cls(model, source=where, threads=threads, files=files, engine=engine)

    @classmethod
    def random(cls, config: VisionConfig, dtype: torch.dtype = torch.float32, threads: int | None = None,
               engine: str = engines.DEFAULT, seed: int = 0) -> VisionTower:
        """A tower of ``config``'s shape with seeded weights (N(0, 0.02) matrices, unit norms, zero biases),
        for timing: its time depends on the shapes, not on the values (``pick --picture``, the benchmarks)."""
        from clef_gguf.vision.model import rope_inv_freq

        engines.check(engine)
        with torch.device("meta"):  # no default initialisation: every value is drawn once, below
            model = VisionModel(config)
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    param.fill_(1.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02, generator=gen)
        model.inv_freq = rope_inv_freq(config)
        model.to(dtype).requires_grad_(False).eval()
        return cls(engines.apply(model, engine), source=Path("random"), threads=threads, engine=engine)

    @property
    def config(self) -> VisionConfig:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.patch_embed.proj.weight.dtype

    def n_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Tokens per image or video: t·h·w / m² (m × m patches merge into one token)."""
        m2 = self.config.spatial_merge_size ** 2
        return [t * h * w // m2 for t, h, w in torch.as_tensor(grid_thw).tolist()]

    def check(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        """InferenceError when the processor's output does not fit this tower (another patch size or merge)."""
        c = self.config
        if grid_thw.ndim != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0 \
                or grid_thw.dtype.is_floating_point or bool((grid_thw < 1).any()):
            raise InferenceError(f"grid_thw must be [n >= 1, 3] positive integers, got {list(grid_thw.shape)} "
                                 f"{grid_thw.dtype}", field="vision")
        if bool((grid_thw[:, 1:] % c.spatial_merge_size).any()):
            raise InferenceError(f"grid heights and widths must be multiples of the merge size "
                                 f"{c.spatial_merge_size}: {grid_thw.tolist()}", field="vision")
        patches = int(grid_thw.prod(dim=1).sum())
        if tuple(pixel_values.shape) != (patches, c.patch_dim) or not pixel_values.dtype.is_floating_point:
            raise InferenceError(f"pixel_values must be float [{patches}, {c.patch_dim}] for grids "
                                 f"{grid_thw.tolist()}, got {pixel_values.dtype} {list(pixel_values.shape)}",
                                 field="vision")

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The processor's ``pixel_values`` [patches, C·T·P·P] and ``grid_thw`` [n, 3] -> float32
        [sum of n_tokens, out_hidden_size]."""
        pixel_values, grid_thw = torch.as_tensor(pixel_values), torch.as_tensor(grid_thw)
        self.check(pixel_values, grid_thw)
        with torch.inference_mode(), torch_threads(self.threads):
            return self.model(pixel_values, grid_thw).float()

    def split(self, embeddings: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``embed``'s output cut into one tensor per image or video."""
        return embeddings.split(self.n_tokens(grid_thw))
