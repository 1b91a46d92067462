"""The language tower in llama.cpp: final hidden states (after the last RMSNorm) of every token.

Thin ctypes wrappers over llama-cpp-python's low-level API, each owning its resource. We do not
use ``Llama``/``embed()``: it builds Python lists, forces 256 recurrent-state slots (~12 GiB for
the 9B) and runs the 248K-row lm_head for every token. Instead the staging API
``llama_set_embeddings_nextn(ctx, true, false)`` hands back the post-``output_norm`` state of
every token while the lm_head runs for one row only (docs/design/llama-cpp-notes.md §1).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as ll
import numpy as np

from clef_gguf.cpus import available_cpus
from clef_gguf.errors import ClefError, CorruptModel, InferenceError, InvalidValue, ModelNotFound
from clef_gguf.statecache import SegmentedForward, Snapshot, StateCache

log = logging.getLogger("clef_gguf.llama")

# ---------------------------------------------------------------- llama.cpp log capture
# llama.cpp reports load failures only through its log; keep the tail to put it in our errors.
# ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line. Info is chatty
# (every load prints ~100 lines), so it goes to DEBUG.
_LOG_TAIL: collections.deque[tuple[int, str]] = collections.deque(maxlen=40)
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_last_level = [1]


@ll.llama_log_callback
def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level == 5:
        level = _last_level[0]
    _last_level[0] = level
    line = text.decode("utf-8", "replace")
    _LOG_TAIL.append((level, line))
    log.log(_LEVELS.get(level, logging.DEBUG), "%s", line.rstrip())


ll.llama_log_set(_on_log, ctypes.c_void_p(0))
ll.llama_backend_init()


def _log_errors() -> str:
    lines = [text.strip() for level, text in _LOG_TAIL if level >= 3 and text.strip()]
    return "; ".join(lines[-4:])


# ---------------------------------------------------------------- staging API binding
def _bind(names: tuple[str, ...], argtypes: list, restype):
    """The nextn functions are exported only under C++-mangled names in 0.3.36."""
    for name in names:
        fn = getattr(ll.llama_cpp._lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            return fn
    return None


_set_nextn = _bind(("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb"),
                   [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None)
_get_nextn = _bind(("llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context"),
                   [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float))


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan...)."""
    return bool(ll.llama_supports_gpu_offload())


def extra_buffer_types() -> bool:
    """ggml's extra weight buffers (CPU repacking, AMX) unless this build has AMX: a native build on
    an AMX CPU (Sapphire Rapids and later) segfaults decoding Q8_0 towers there, so it gets the
    plain kernels: slower on Q4_0/Q8_0, never a crash."""
    return b"AMX_INT8 = 1" not in ll.llama_print_system_info()


# ---------------------------------------------------------------- header checks
# qwen35 hyperparameters llama.cpp 0.3.36 reads but does not check against the tensors: a bad value
# reaches a GGML_ASSERT (the process aborts) or a graph that never finishes. Its layer limit:
LLAMA_MAX_LAYERS = 512
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}


def check_header(reader, path: Path) -> None:
    """Refuse (CorruptModel) a qwen35 GGUF, parsed by ``lexical.open_gguf``, that llama.cpp would
    abort or hang on: block count, width, rotary dims, GDN inner size, norm epsilon or vocab."""

    def refuse(why: str):
        raise CorruptModel(f"{path} is a damaged qwen35 tower: {why}", field="tower")

    def number(key: str, kinds: set[str] = _INT_TYPES, required: bool = True):
        f = reader.fields.get(key)
        if f is None and not required:  # llama.cpp has a default for it
            return None
        if f is None or len(f.types) != 1 or f.types[0].name not in kinds:
            refuse(f"{key} is missing or not a {'whole ' if 'INT32' in kinds else ''}number")
        return f.contents()

    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    n_layer = number("qwen35.block_count")
    blocks = {int(n.split(".")[1]) for n in shapes if n.split(".")[0] == "blk"
              and n.split(".")[1].isdigit()}
    if not 1 <= n_layer <= LLAMA_MAX_LAYERS or blocks != set(range(n_layer)):
        refuse(f"qwen35.block_count is {n_layer}, the tensors have {len(blocks)} blocks")
    n_embd = number("qwen35.embedding_length")
    if shapes.get("token_embd.weight", [None])[0] != n_embd:
        refuse(f"qwen35.embedding_length {n_embd} is not token_embd.weight's width "
               f"{shapes.get('token_embd.weight')}")
    head = number("qwen35.attention.key_length", required=False)
    n_rot = number("qwen35.rope.dimension_count", required=False)
    n_rot = head if n_rot is None else n_rot  # llama.cpp's default
    if n_rot is not None and (n_rot < 2 or n_rot % 2 or (head is not None and n_rot > head)):
        refuse(f"qwen35.rope.dimension_count {n_rot} is not an even count <= key_length {head}")
    # Rotary pairs given to each of the (up to 4) position axes: at most the n_rot / 2 there are.
    sections = reader.fields.get("qwen35.rope.dimension_sections")
    if n_rot is not None and sections is not None and sections.types[-1].name in _INT_TYPES:
        values = sections.contents()
        values = [int(v) for v in values] if isinstance(values, list) else [int(values)]
        if len(values) > 4 or min(values, default=0) < 0 or sum(values) > n_rot // 2:
            refuse(f"qwen35.rope.dimension_sections {values} do not split {n_rot // 2} pairs")
    inner = number("qwen35.ssm.inner_size")
    wrong = [n for n, s in shapes.items() if n.endswith(".ssm_out.weight") and s[0] != inner]
    if inner < 1 or wrong:
        refuse(f"qwen35.ssm.inner_size {inner} is not the width of {wrong[:1] or 'ssm_out'}")
    eps = number("qwen35.attention.layer_norm_rms_epsilon", {"FLOAT32", "FLOAT64"})
    if not 0 < eps < 1:  # NaN fails too
        refuse(f"qwen35.attention.layer_norm_rms_epsilon is {eps}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # llama.cpp asserts they are distinct
    if tokens is not None and len({bytes(tokens.parts[i]) for i in tokens.data}) < len(tokens.data):
        refuse("tokenizer.ggml.tokens holds the same token twice")


class _Model:
    """Owns a ``llama_model*`` loaded with mmap, ``gpu_layers`` of it offloaded."""

    def __init__(self, path: Path, gpu_layers: int = 0):
        params = ll.llama_model_default_params()
        params.load_mode = ll.LLAMA_LOAD_MODE_MMAP
        params.n_gpu_layers = gpu_layers  # -1: all; without a GPU backend llama.cpp uses the CPU
        self.gpu_layers = gpu_layers if gpu_offload() else 0
        params.use_extra_bufts = extra_buffer_types()
        _LOG_TAIL.clear()
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            detail = _log_errors() or "llama.cpp gave no reason"
            raise CorruptModel(f"llama.cpp could not load {path}: {detail}", field="tower")
        self.n_embd = int(ll.llama_model_n_embd(self.ptr))
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.ptr)))

    def close(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


_COMPUTE_BUFFER = re.compile(r"compute buffer size =\s*([0-9.]+) MiB")


class _Context:
    """Owns a ``llama_context*`` for one sequence: one recurrent slot, no lm_head over the prompt.

    ``seqs > 1`` makes the packed context instead: ``seqs`` sequences, each in a KV stream of its
    own of ``n_ctx // seqs`` cells (``kv_unified`` off: in one shared pool a sequence's attention
    runs over other cells and its sums change, 0.09 max |dh| on the 110M model), ``n_batch``
    tokens per ubatch. It needs the nextn API (embeddings mode splits ubatches per sequence)."""

    def __init__(self, model: _Model, n_ctx: int, n_batch: int, threads: int, seqs: int = 1):
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch  # fixed: GDN chunking makes results depend slightly on it
        params.n_seq_max = seqs  # one recurrent-state slot each (~50 MiB for the 9B), not 256
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = self.threads = threads
        params.pooling_type = ll.LLAMA_POOLING_TYPE_NONE
        params.attention_type = ll.LLAMA_ATTENTION_TYPE_CAUSAL
        self.nextn = _set_nextn is not None and _get_nextn is not None
        # Fallback when the staging API is missing: embeddings mode (pays the lm_head per token).
        params.embeddings = not self.nextn
        # nextn: only the last token of a chunk is an output (1 lm_head row). Embeddings mode makes
        # every token an output, and a smaller n_outputs_max there aborts the process. llama.cpp
        # wants room for one output per sequence; packed batches flag none (no lm_head at all).
        params.n_outputs_max = seqs if self.nextn else 0
        _LOG_TAIL.clear()
        self.ptr = ll.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise InferenceError(f"llama.cpp could not create a context: {_log_errors()}")
        if self.nextn:
            _set_nextn(self.ptr, True, False)  # masked=False: every token, whatever batch.logits
        self.n_ctx = int(ll.llama_n_ctx(self.ptr))
        self.n_batch = int(ll.llama_n_batch(self.ptr))
        self.seqs = seqs
        # llama.cpp reports its compute buffers (one per backend) only in its log.
        self.compute_bytes = int(sum(float(m.group(1)) for _, text in _LOG_TAIL
                                     if (m := _COMPUTE_BUFFER.search(text))) * (1 << 20))

    def rows(self, n: int, n_embd: int) -> np.ndarray:
        ptr = _get_nextn(self.ptr) if self.nextn else ll.llama_get_embeddings(self.ptr)
        if not ptr:
            raise InferenceError("llama.cpp returned no hidden states")
        # A view into llama.cpp's output buffer, valid until the next decode: copy it out.
        return np.ctypeslib.as_array(ptr, shape=(n, n_embd)).copy()

    def close(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


# ---------------------------------------------------------------- several prompts per decode
@dataclass(frozen=True)
class PackRule:
    """Whether ``Tower.forward_many`` decodes several prompts per ``llama_decode`` on one kind of device."""

    pack: int  # prompts decoded together (sequences of the packed context); 1: one at a time
    max_tokens: int  # longer prompts run one at a time; also each packed sequence's KV window
    ubatch: int  # tokens per packed llama_decode (the packed context's n_batch = n_ubatch)
    evidence: str


# The packing policy, in one place; the figures are BENCHMARKS.md "Several prompts per decode". On the
# CPU packing paid at every size measured (100-2,000 tokens), most for short prompts; 8 prompts gained
# no more than 4 for twice the sequence memory; 2,048-token ubatches were slower than 1,024. Past 2,048
# tokens it is unmeasured, and each sequence's KV window would grow with it. The GPU is unmeasured.
PACKING = {
    "cpu": PackRule(4, 2048, 1024, "2 threads, packed/one-by-one: 110M q8_0 decisions 0.87 at 336 tokens, "
                    "0.95 at 2,000, tower 0.68 at 100; 9B Q4_K_M tower 0.59 at 100, decisions 0.98 at 466"),
    "gpu": PackRule(1, 0, 2048, "not measured (no GPU was lent to this work): one prompt at a time"),
}
# The packed context may take this share of the memory the device policy leaves free at its creation.
PACK_MEMORY_SHARE = 0.5
# A llama.cpp sequence state starts with u32 magic, u32 source sequence, then (hybrid memory, attention
# part first) u32 n_stream, a u32 cell count per KV stream (the sequence's cells follow its own stream's
# count) and the recurrent part, which is what LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY saves after the header.
_SEQ_HEADER = 8


def _u32(*values: int) -> np.ndarray:
    return np.array(values, dtype="<u4").view(np.uint8)


def _to_streams(buf: np.ndarray, n_stream: int) -> np.ndarray:
    """A one-stream sequence state (what the single context saves) in the layout of a packed context of
    ``n_stream`` KV streams: the empty streams first, the cells after the last count (llama.cpp reads
    them into the destination sequence's stream, whichever count they follow)."""
    if buf.size < _SEQ_HEADER + 4 or int(buf[8:12].view("<u4")[0]) != 1:
        raise InferenceError("a saved sequence state does not have the one-stream layout")
    return np.concatenate([buf[:8], _u32(n_stream, *[0] * (n_stream - 1)), buf[12:]])


def _to_one_stream(buf: np.ndarray, n_stream: int, seq: int, recurrent: int) -> np.ndarray:
    """Sequence ``seq``'s state saved from a packed context, in the one-stream layout the single context
    saves (byte for byte), so that the state cache holds one kind of entry for both paths."""
    before = slice(12, 12 + 4 * seq)
    cells = slice(before.stop, buf.size - recurrent - 4 * (n_stream - 1 - seq))
    after = slice(cells.stop, buf.size - recurrent)
    if (cells.start > cells.stop or int(buf[8:12].view("<u4")[0]) != n_stream
            or buf[before].any() or buf[after].any()):
        raise InferenceError("a packed sequence state does not have the expected layout")
    return np.concatenate([buf[:4], _u32(0, 1), buf[cells], buf[buf.size - recurrent:]])


def _chunks(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """A segment's canonical chunks: at most ``step`` tokens each, from the segment's own start."""
    return [(s, min(s + step, end)) for s in range(start, end, step)]


@dataclass(eq=False)
class _Slot:
    """One prompt of a packed wave: its sequence, what is left to decode, what it has so far."""

    index: int  # position in forward_many's input
    ids: np.ndarray
    source: np.ndarray  # the packed-layout state restored into its sequence first
    parts: list[np.ndarray]  # hidden states so far (restored, then decoded chunks)
    cached: int
    chunks: list[tuple[int, int]]
    save_at: int = 0  # after this token, the [prefix][state] snapshot goes to the cache (0: none)
    state_key: bytes | None = None
    seq: int = 0


def _next_group(slots: list[_Slot], ubatch: int) -> list[_Slot]:
    """The sequences the next llama_decode advances: whole next chunks of one length, on consecutive
    sequence ids. llama.cpp's split_equal then makes one ubatch of exactly those chunks (it would cut
    unequal ones, or sequences with a gap between their ids, into other ubatches), so every sequence
    sees the ubatches of its one-by-one schedule. The slots with most chunks left go first, so that
    the prompts reach their last chunks (often the same question schema) together."""
    best, best_score, run = [], None, []
    for slot in [s for s in slots if s.chunks] + [None]:
        if (slot is not None and run and slot.seq == run[-1].seq + 1
                and _length(slot) == _length(run[0])):
            run.append(slot)
            continue
        if run:
            group = run[:max(1, ubatch // _length(run[0]))]
            score = (max(len(s.chunks) for s in group), _length(run[0]) * len(group))
            if best_score is None or score > best_score:
                best, best_score = group, score
        run = [slot] if slot is not None else []
    return best


def _length(slot: _Slot) -> int:
    start, end = slot.chunks[0]
    return end - start


class _Batch:
    """Owns a ``llama_batch`` of up to ``size`` tokens, each in one sequence, none an output."""

    def __init__(self, size: int):
        self.size = size
        self.batch = ll.llama_batch_init(size, 0, 1)
        b = self.batch
        self.token, self.pos, self.n_seq_id, self.logits = (
            np.ctypeslib.as_array(p, shape=(size,)) for p in (b.token, b.pos, b.n_seq_id, b.logits))

    def fill(self, group: list[_Slot]) -> int:
        n = 0
        for slot in group:
            start, end = slot.chunks[0]
            self.token[n:n + end - start] = slot.ids[start:end]
            self.pos[n:n + end - start] = np.arange(start, end, dtype=np.int32)
            for i in range(n, n + end - start):
                self.batch.seq_id[i][0] = slot.seq
            n += end - start
        self.n_seq_id[:n] = 1
        self.logits[:n] = 0  # nextn hands back every token's state; no lm_head row at all
        self.batch.n_tokens = n
        return n

    def close(self) -> None:
        if self.size:
            ll.llama_batch_free(self.batch)
            self.size = 0


class Tower(SegmentedForward):
    """``hidden_states(ids) -> float32 [T, n_embd]`` for one prompt at a time (thread-safe);
    ``forward_many`` decodes several prompts per llama_decode where :data:`PACKING` says it pays."""

    def __init__(self, model: _Model, ctx: _Context, path: Path):
        self._model, self._ctx, self.path = model, ctx, path
        self._lock = threading.Lock()
        self._prefix: tuple[bytes, Snapshot] | None = None  # the system prefix, decoded once
        # forward_many's context of several sequences, made on first use (see _packed_context)
        self._packed: tuple[_Context, _Batch, int] | None = None  # context, its batch, KV window
        self._packed_prefix: tuple[bytes, np.ndarray] | None = None  # the prefix, packed layout
        self._costs: tuple[int, int] | None = None  # (recurrent state, KV per token) bytes
        self._refused: int | None = None  # the smallest KV window the memory budget refused
        self.pack_stats: collections.Counter[int] = collections.Counter()  # sequences per packed decode

    @classmethod
    def load(cls, path: str | Path, *, n_ctx: int = 16384, threads: int | None = None,
             n_batch: int = 512, gpu_layers: int = 0) -> Tower:
        path = Path(path)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise InvalidValue(f"threads must be a whole number >= 1 (got {threads!r})",
                               field="threads")
        if not isinstance(gpu_layers, int) or isinstance(gpu_layers, bool) or gpu_layers < -1:
            raise InvalidValue(f"gpu_layers must be -1 (all), 0 or a layer count (got "
                               f"{gpu_layers!r})", field="gpu_layers")
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}", field="tower")
        model = _Model(path, gpu_layers)
        try:
            ctx = _Context(model, n_ctx, min(n_batch, n_ctx), threads or available_cpus())
        except BaseException:
            model.close()
            raise
        return cls(model, ctx, path)

    @property
    def n_embd(self) -> int:
        return self._model.n_embd

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def threads(self) -> int:
        return self._ctx.threads

    @property
    def gpu_layers(self) -> int:
        """Layers offloaded (-1: all); 0 on a CPU-only build whatever was asked."""
        return self._model.gpu_layers

    @property
    def uses_nextn(self) -> bool:
        return self._ctx.nextn

    vocab_name = "GGUF vocab"

    @property
    def closed(self) -> bool:
        return self._ctx.ptr is None

    def _clear(self) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(self._ctx.ptr), True)

    def _decode(self, ids: np.ndarray) -> np.ndarray:
        """Append ``ids`` to the sequence, in chunks of ``n_batch`` from the segment's own start:
        the fixed schedule that makes a restored segment bit-identical to a decoded one. Chunks
        also keep every call under llama.cpp's per-call n_batch assert (an abort, not an error)."""
        out = np.empty((len(ids), self.n_embd), dtype=np.float32)
        step = self._ctx.n_batch
        for start in range(0, len(ids), step):
            chunk = np.ascontiguousarray(ids[start:start + step])
            batch = ll.llama_batch_get_one(
                chunk.ctypes.data_as(ctypes.POINTER(ll.llama_token)), len(chunk))
            rc = ll.llama_decode(self._ctx.ptr, batch)
            if rc != 0:
                self._clear()
                raise InferenceError(f"llama_decode failed with code {rc}: {_log_errors()}")
            out[start:start + len(chunk)] = self._ctx.rows(len(chunk), self.n_embd)
        return out

    def _state_size(self) -> int:
        return int(ll.llama_state_seq_get_size_ext(self._ctx.ptr, 0, 0))

    def _save(self, size: int | None = None) -> np.ndarray:
        """The whole sequence (KV cells + recurrent state), serialized by llama.cpp."""
        size = self._state_size() if size is None else size
        buf = np.empty(size, dtype=np.uint8)
        got = ll.llama_state_seq_get_data_ext(
            self._ctx.ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0, 0)
        if got != size:
            raise InferenceError(f"llama.cpp saved {got} of {size} bytes of the sequence state")
        return buf

    def _restore(self, buf: np.ndarray) -> None:
        self._clear()
        got = ll.llama_state_seq_set_data_ext(
            self._ctx.ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), buf.size, 0, 0)
        if got != buf.size:
            self._clear()
            raise InferenceError("llama.cpp could not restore a saved sequence state")

    def hidden_states(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states of one prompt decoded from scratch, as one segment (no reuse)."""
        with self._lock:
            ids = self._checked(ids)
            self._clear()
            return self._decode(ids)

    # The sequence operations of the shared schedule (statecache.SegmentedForward): one
    # sequence, held by the context itself.
    def _begin(self) -> None:
        self._clear()

    def _resume(self, kept: np.ndarray) -> None:
        self._restore(kept)

    def _append(self, _seq: None, ids: np.ndarray, _start: int) -> np.ndarray:
        return self._decode(ids)

    def _kept_bytes(self, _seq: None) -> int:
        return self._state_size()

    def _keep(self, _seq: None, size: int) -> np.ndarray:
        return self._save(size)

    # ------------------------------------------------------------ several prompts per decode
    @property
    def pack_rule(self) -> PackRule:
        return PACKING["gpu" if self.gpu_layers else "cpu"]

    def pack_size(self, n_tokens: int) -> int:
        """How many prompts of ``n_tokens`` the policy decodes together here (1: one at a time)."""
        rule = self.pack_rule
        return rule.pack if self.uses_nextn and n_tokens <= rule.max_tokens else 1

    def forward_many(self, prompts: list[tuple[np.ndarray, int, int]], cache: StateCache | None = None,
                     *, pack: int | None = None) -> list[tuple[np.ndarray, int] | ClefError]:
        """``forward`` for several prompts ``(ids, prefix, state)``: one result per prompt, in order,
        ``(hidden, cached_tokens)`` or the ClefError that prompt raised (the others still run).

        Up to ``pack`` prompts (None: :data:`PACKING` decides, and packs only prompts of up to its
        ``max_tokens``) are sequences of one packed context and share each ``llama_decode``. Every
        sequence is decoded on its one-by-one chunks, so the hidden states are the ones ``forward``
        gives, bit for bit (tests/test_tower.py). ``pack=1`` is ``forward`` for each prompt."""
        if pack is not None and (not isinstance(pack, int) or isinstance(pack, bool) or pack < 1):
            raise InvalidValue(f"pack must be a whole number >= 1 (got {pack!r})", field="pack")
        cache = cache if cache is not None and cache.max_bytes > 0 else None
        rule = self.pack_rule
        want, limit = (rule.pack, rule.max_tokens) if pack is None else (pack, self.n_ctx)
        results: list = [None] * len(prompts)
        with self._lock:
            packable, alone = [], []
            for i, (ids, prefix, state) in enumerate(prompts):
                try:
                    ids = self._checked(ids)
                except ClefError as exc:
                    results[i] = exc
                    continue
                fits = want > 1 and self.uses_nextn and len(ids) <= limit
                (packable if fits else alone).append((i, ids, prefix, state))
            # The policy's window is fixed, so one context serves every call; an explicit pack
            # sizes it to this call's longest prompt.
            window = min(limit, self.n_ctx) if pack is None else max((len(i[1]) for i in packable), default=0)
            try:
                ctx = self._packed_context(want, window) if len(packable) > 1 else None
            except ClefError as exc:  # llama.cpp made no packed context: one at a time, as before
                log.warning("no packed decoding: %s", exc)
                ctx = None
            if ctx is None:
                alone = sorted(packable + alone, key=lambda item: item[0])
            else:
                self._forward_packed(ctx, min(want, ctx.seqs), packable, cache, results)
            for i, ids, prefix, state in alone:
                results[i] = self._one(ids, prefix, state, cache)
        return results

    def _one(self, ids: np.ndarray, prefix: int, state: int,
             cache: StateCache | None) -> tuple[np.ndarray, int] | ClefError:
        """``forward`` under the lock already held, its error returned rather than raised."""
        prompt_key = cache.key("prompt", ids) if cache is not None else None
        if cache is not None and (hit := cache.get(prompt_key)) is not None:
            return hit.hidden.copy(), hit.n_tokens
        try:
            hidden, cached = self._forward_locked(ids, prefix, state, cache)
        except ClefError as exc:
            return exc
        if cache is not None:
            cache.put(prompt_key, Snapshot(len(ids), None, hidden.copy()))
        return hidden, cached

    def _forward_packed(self, ctx: _Context, seqs: int, items: list, cache: StateCache | None,
                        results: list) -> None:
        """Waves of up to ``seqs`` prompts. With a cache, a prompt whose whole prompt, or whose state
        not cached yet, another prompt of the wave decodes waits for the next wave and is restored
        from the cache there, as one by one; so does one with another prefix than the snapshot's (it
        then runs alone and replaces the snapshot)."""
        pending = items
        while pending:
            wave, later, keys = [], [], set()
            for item in pending:
                i, ids, prefix, state = item
                if len(wave) == seqs:
                    later.append(item)
                    continue
                if cache is not None:
                    prompt_key = cache.key("prompt", ids)
                    if (hit := cache.get(prompt_key)) is not None:
                        results[i] = (hit.hidden.copy(), hit.n_tokens)
                        continue
                    state_key = cache.key("state", ids[:prefix + state]) if state else None
                    if prompt_key in keys or (state_key is not None and state_key in keys
                                              and state_key not in cache):
                        later.append(item)
                        continue
                    keys.update(k for k in (prompt_key, state_key) if k is not None)
                if self._prefix is None or self._prefix[0] != ids[:prefix].tobytes():
                    if wave:
                        later.append(item)
                    else:
                        results[i] = self._one(ids, prefix, state, cache)
                    continue
                wave.append(item)
            if wave:
                self._wave(ctx, wave, cache, results)
            pending = later

    def _wave(self, ctx: _Context, wave: list, cache: StateCache | None, results: list) -> None:
        try:
            self._wave_decode(ctx, wave, cache, results)
        except ClefError as exc:  # a failed decode or restore: each prompt again on its own
            log.warning("packed decode failed (%s); decoding its %d prompts one at a time", exc, len(wave))
            ll.llama_memory_clear(ll.llama_get_memory(ctx.ptr), True)
            for i, ids, prefix, state in wave:
                if results[i] is None:
                    results[i] = self._one(ids, prefix, state, cache)

    def _wave_decode(self, ctx: _Context, wave: list, cache: StateCache | None, results: list) -> None:
        _, batch, _ = self._packed
        step, n_stream = self._ctx.n_batch, ctx.seqs
        prefix_key, prefix_snap = self._prefix
        if self._packed_prefix is None or self._packed_prefix[0] != prefix_key:
            self._packed_prefix = (prefix_key, _to_streams(prefix_snap.seq_state, n_stream))
        slots = []
        for i, ids, prefix, state in wave:
            head = prefix + state
            state_key = cache.key("state", ids[:head]) if cache is not None and state else None
            known = cache.get(state_key) if state_key else None
            if known is not None:
                slot = _Slot(i, ids, _to_streams(known.seq_state, n_stream), [known.hidden], head,
                             _chunks(head, len(ids), step))
            else:
                slot = _Slot(i, ids, self._packed_prefix[1], [prefix_snap.hidden], prefix,
                             _chunks(prefix, head, step) + _chunks(head, len(ids), step),
                             head if state_key else 0, state_key)
            slots.append(slot)
        # Equal chunk lists next to each other: equal chunks are on consecutive sequence ids.
        slots.sort(key=lambda s: [e - b for b, e in reversed(s.chunks)])
        ll.llama_memory_clear(ll.llama_get_memory(ctx.ptr), True)
        for seq, slot in enumerate(slots):
            slot.seq = seq
            got = ll.llama_state_seq_set_data_ext(
                ctx.ptr, slot.source.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), slot.source.size, seq, 0)
            if got != slot.source.size:
                raise InferenceError(f"llama.cpp could not restore a state into sequence {seq}: {_log_errors()}")
        while group := _next_group(slots, ctx.n_batch):
            n = batch.fill(group)
            rc = ll.llama_decode(ctx.ptr, batch.batch)
            if rc != 0:
                raise InferenceError(f"llama_decode failed with code {rc}: {_log_errors()}")
            self.pack_stats[len(group)] += 1
            rows, at = ctx.rows(n, self.n_embd), 0
            for slot in group:
                start, end = slot.chunks.pop(0)
                slot.parts.append(rows[at:at + end - start])
                at += end - start
                if end == slot.save_at:
                    self._save_packed(ctx, slot, cache)
        for slot in slots:
            hidden = np.concatenate(slot.parts)
            results[slot.index] = (hidden, slot.cached)
            if cache is not None:
                cache.put(cache.key("prompt", slot.ids), Snapshot(len(slot.ids), None, hidden.copy()))

    def _save_packed(self, ctx: _Context, slot: _Slot, cache: StateCache) -> None:
        """The state cache entry ``forward`` would have made after ``[prefix][state]``."""
        size = int(ll.llama_state_seq_get_size_ext(ctx.ptr, slot.seq, 0))
        one_stream = size - 4 * (ctx.seqs - 1)
        if one_stream + slot.save_at * self.n_embd * 4 > cache.max_bytes:
            return
        buf = np.empty(size, dtype=np.uint8)
        got = ll.llama_state_seq_get_data_ext(
            ctx.ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, slot.seq, 0)
        if got != size:
            raise InferenceError(f"llama.cpp saved {got} of {size} bytes of a sequence state")
        recurrent = int(ll.llama_state_seq_get_size_ext(
            ctx.ptr, slot.seq, ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) - _SEQ_HEADER
        cache.put(slot.state_key, Snapshot(slot.save_at, _to_one_stream(buf, ctx.seqs, slot.seq, recurrent),
                                           np.concatenate(slot.parts)))

    def _packed_context(self, seqs: int, window: int) -> _Context | None:
        """The context of up to ``seqs`` sequences of ``window`` tokens each, or None where memory
        does not allow two. Its recurrent state (one slot per sequence, ~50 MiB each for the 9B), its KV
        streams and its compute buffer must fit ``PACK_MEMORY_SHARE`` of what the device policy leaves
        free (host RAM, or the GPU's memory when the tower is offloaded). Kept until a call needs more."""
        window = -(-max(window, 1) // 256) * 256  # llama.cpp rounds each stream to 256 cells
        ubatch = max(self.pack_rule.ubatch, self._ctx.n_batch)
        if self._refused is not None and window >= self._refused:
            return None  # asked and refused before: no new memory probe per call
        if self._packed is not None:
            ctx, _, held = self._packed
            if ctx.seqs >= seqs and held >= window:
                return ctx
            seqs, window = max(seqs, ctx.seqs), max(window, held)
            self._close_packed()
        recurrent, kv = self._state_costs()
        budget = int(self._free_memory() * PACK_MEMORY_SHARE)
        seqs = min(seqs, budget // (recurrent + window * kv))
        if seqs < 2:
            log.info("no packed decoding: 2 sequences of %d tokens do not fit %d MiB", window, budget >> 20)
            self._refused = window
            return None
        ctx = _Context(self._model, seqs * window, ubatch, self.threads, seqs)
        if ctx.compute_bytes + seqs * (recurrent + window * kv) > budget:
            ctx.close()
            log.info("no packed decoding: its compute buffer (%d MiB) does not fit %d MiB",
                     ctx.compute_bytes >> 20, budget >> 20)
            self._refused = window
            return None
        self._packed, self._packed_prefix = (ctx, _Batch(ubatch), window), None
        return ctx

    def _state_costs(self) -> tuple[int, int]:
        """(recurrent state of one sequence, KV of one token) in bytes, from llama.cpp's own state
        sizes for a one-token sequence in the single context (cleared again: it is only ever used
        after a clear or a restore)."""
        if self._costs is None:
            self._clear()
            one = np.zeros(1, dtype=np.int32)
            rc = ll.llama_decode(self._ctx.ptr, ll.llama_batch_get_one(
                one.ctypes.data_as(ctypes.POINTER(ll.llama_token)), 1))
            full = self._state_size()
            recurrent = int(ll.llama_state_seq_get_size_ext(
                self._ctx.ptr, 0, ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) - _SEQ_HEADER
            self._clear()
            if rc != 0:
                raise InferenceError(f"llama_decode failed with code {rc}: {_log_errors()}")
            self._costs = (recurrent, max(1, full - recurrent - _SEQ_HEADER - 8))
        return self._costs

    def _free_memory(self) -> int:
        from clef_gguf.models import device

        profile = device.probe(check_llama=False)
        if self.gpu_layers and profile.gpus and not profile.unified_memory:
            return max(0, max(g.vram_free or g.vram_total for g in profile.gpus) - device.GPU_RESERVE)
        return device.host_budget(profile)

    def _close_packed(self) -> None:
        if self._packed is not None:
            ctx, batch, _ = self._packed
            batch.close()
            ctx.close()
            self._packed = self._packed_prefix = None

    def close(self) -> None:
        with self._lock:
            self._close_packed()
            self._ctx.close()
            self._model.close()

    def __enter__(self) -> Tower:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
