"""A transformers causal LM on a preallocated KV cache, with CUDA graphs for the small steps of decoding.

Layout: a token's cache slot is its position. Each row writes its new tokens at the slots that follow its own
cached tokens, so a row's cache is always its real tokens at slots 0..length-1, with no holes:

- trimming a row (rejected drafts) only moves its length back; the next forward overwrites the slots past it;
- attention is the causal rule "key slot <= query slot" within each row, which can never reach a stale slot,
  so rows that kept different numbers of drafts need no bookkeeping of holes;
- padding tokens (left padding of ragged prompts, right padding of ragged catch-up tokens) are written after
  the row's real tokens of the same forward, where no real token sees them and the next forward overwrites them.

Every tensor has a fixed address and, for a given (rows, new tokens, attended slots), a fixed shape: attended
slots are rounded up to a power of two, so a handful of shapes cover a whole generation. On CUDA the small
steps (the target's K+1-token verification, the draft's 1- and 2-token steps) are captured once per shape as
CUDA graphs and replayed with no Python and no host sync; prefill runs eagerly. On CPU the same step runs
eagerly. compile=True runs the small steps through torch.compile (Inductor fuses norms, rotary, SiLU-mul and
residual adds; "reduce-overhead" on CUDA, whose CUDA graphs then replace ours; the C++ backend on a CPU). Where
steps are captured or compiled, their widths are padded up to BUCKETS (padding tokens after the real ones, as
below), so a generation needs at most len(BUCKETS) widths per batch size, and warm_up() can run them all at load.

Supported: decoder-only models whose attention reads a 4D mask and the cache through `Cache.update` and whose
logits are `lm_head(last hidden state)` (Llama, Mistral, Qwen2, Qwen3, Gemma), with sdpa or eager attention and
no sliding-window layers (the window is not expressed in this mask).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..text.vocab import embedding_rows
from . import register_backend
from .hf import _eos_ids, cache_keyword

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
SUPPORTED_ATTENTION = ("sdpa", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEFAULT_MAX_LEN = 4096
# A batch verifies max(K) drafts for every row, also for rows that need fewer tokens before they finish, so a
# row can write up to K slots past prompt + max_new_tokens before the loop trims them.
SPARE_SLOTS = 16
MIN_SPAN = 64  # smallest number of attended slots: short contexts all share one shape
BUCKETS = (1, 2, 4, 8, 16)  # step widths (K+1) a captured or compiled step is padded to
# Each combination of batch size 1 or more, width 1 or more, last_only and output_hidden is a graph of its own
# (torch specializes sizes 1); dynamo's default limit of 8 would send the rest back to eager Python silently.
RECOMPILE_LIMIT = 64


class StaticBackend:
    """A ModelBackend with a static KV cache for max_batch rows of max_len tokens (prompt + new tokens).

    vocab_size: width of the returned logits (the vocabulary shared with the other model), at most the output
    layer's rows. compile: False, True (mode "reduce-overhead" on CUDA, "default" on a CPU) or a torch.compile
    mode: the steps of at most graph_max_tokens new tokens run compiled. cuda_graphs: "auto" (on when the model is
    on CUDA and compile's mode captures none itself), True (an error when it is not) or False. Steps of at most
    graph_max_tokens new tokens are captured once per (rows, tokens, attended slots, last_only, output_hidden), the
    second time that shape is seen (one-off shapes stay eager), or compiled on its first sight.
    """

    graph_max_tokens = 16

    def __init__(self, model, vocab_size: int | None = None, max_batch: int = 8, max_len: int | None = None,
                 compile: bool | str = False, cuda_graphs: bool | str = "auto"):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        _check_supported(model, config)
        self.model = model.eval()
        self.config = config
        rows = embedding_rows(model)
        if vocab_size is not None and not 1 <= vocab_size <= rows:
            raise ValueError(f"vocab_size={vocab_size} but the model's output layer has {rows} rows")
        self.vocab_size = vocab_size or rows
        self.device = next(model.parameters()).device
        context = getattr(config, "max_position_embeddings", None)
        max_len = max_len if max_len is not None else min(context or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
        for name, value in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StaticBackend {name} must be an integer >= 1, got {value!r}")
        self.max_batch, self.max_len = max_batch, max_len
        self.max_positions = min(context, max_len) if context else max_len
        self.eos_token_ids = _eos_ids(model)
        self.name = getattr(config, "_name_or_path", "") or type(model).__name__
        self._decoder = model.get_decoder()
        self._head = model.get_output_embeddings()
        self._cache_keyword = cache_keyword(self._decoder.forward)
        self._dtype = model.dtype  # the activations' (and so K/V's) dtype, also for quantized weights
        self._additive_mask = config._attn_implementation == "eager"  # eager adds the mask to the scores
        self._capacity = max_len + SPARE_SLOTS
        self.compile_mode = _compile_mode(compile, self.device)
        # whether torch.compile captures CUDA graphs itself (then ours are off); read twice a step: kept, not derived
        self._compile_graphs = self.device.type == "cuda" and self.compile_mode in ("reduce-overhead", "max-autotune")
        self._cache = _SlotCache(config, max_batch, self._capacity, self._dtype, self.device,
                                 static=self.compile_mode is not None)
        self._graphs_on = _graphs_wanted(cuda_graphs, self.device, self.compile_mode)
        self._step_fn = self._compiled_step() if self.compile_mode else self._step
        self._buckets = BUCKETS if self._graphs_on or self.compile_mode else ()
        # sights of a shape that run far slower than its steady cost: a first eager run and a capture (graphs),
        # a compilation (compile), a compilation and a recording (compile's own CUDA graphs)
        self._cold_sights = 2 if self._graphs_on or self._compile_graphs else 1 if self.compile_mode else 0
        self._graphs: dict[tuple, _CapturedStep] = {}
        self._sights: dict[tuple, int] = {}
        self._masks: dict[tuple, torch.Tensor] = {}  # validity masks of unpadded rows, by (rows, real, width)
        self._pool = None
        self.cold_forwards = 0  # forwards of a shape's cold sights (base.py): the policy does not learn their time
        self.warmed: list[tuple] = []  # the step shapes warm_up() ran (warmup.py)
        self.warm_up_report = None  # the last warm_up()'s WarmUpReport
        self.reset(1)

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    def _compiled_step(self):
        import torch._dynamo.config as dynamo_config

        limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), RECOMPILE_LIMIT))
        # dynamic=True: one graph serves every batch, width and span (sizes 1 apart, which torch specializes), so a
        # warm-up compiles a handful of graphs, not one per shape. Counted on the 42 step shapes of a 64-token
        # warm-up at batch 1: dynamic=False compiles 42 graphs, None 8 (each static first, dynamic on its first
        # change), True 4; a compile of a 24-layer model costs tens of seconds (docs/BENCHMARKS.md, device check).
        return torch.compile(self._step, mode=self.compile_mode, dynamic=True)

    def step_shape(self, batch: int, n: int, past: int, last_only: bool = False, output_hidden: bool = False):
        """The shape a forward of n new tokens per row runs as, rows holding up to past tokens: (rows, width,
        attended slots, last_only, output_hidden); width is n padded up to a bucket where steps are captured."""
        width = n
        if n <= self.graph_max_tokens:
            width = next((b for b in self._buckets if b >= n and past + b <= self._capacity), n)
        span = min(self._capacity, max(MIN_SPAN, 1 << (past + width - 1).bit_length()))
        return batch, width, span, last_only, output_hidden

    def is_warm(self, shape: tuple) -> bool:
        return self._sights.get(shape, 0) >= self._cold_sights

    def spans(self) -> list[int]:
        """Every number of attended slots a step can have."""
        spans, span = [], MIN_SPAN
        while span < self._capacity:
            spans.append(span)
            span *= 2
        return spans + [self._capacity]

    @torch.inference_mode()
    def warm_shape(self, shape: tuple) -> None:
        """Runs one step of this shape (warmup.py) on scratch slots: only while no row holds tokens."""
        batch, width, span, last_only, output_hidden = shape
        if any(self._lengths) or batch > self.max_batch:
            raise ValueError(f"warm_shape({shape}) needs an empty cache of at least {batch} rows (reset() first)")
        rows, self._lengths = self._lengths, [max(0, span - width)] * batch  # rows this long attend `span` slots
        try:
            ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
            self.forward(ids, last_only=last_only, output_hidden=output_hidden)
        finally:
            self._lengths = rows

    def warm_up(self, batches=(1,), seconds: float = 60.0, log=print):
        """Every small step shape at these batch sizes, run before the first request (warmup.py); its report is
        also kept as warm_up_report (a loader warms up before its caller can show anything)."""
        from .warmup import step_shapes, warm_up

        self.warm_up_report = warm_up(self, step_shapes(self, [b for b in batches if b <= self.max_batch]), seconds,
                                      log)
        return self.warm_up_report

    @property
    def captured_graphs(self) -> int:
        """How many step shapes run as CUDA graphs so far."""
        return len(self._graphs)

    def reset(self, batch_size: int) -> None:
        if batch_size > self.max_batch:
            raise ValueError(f"a batch of {batch_size} rows exceeds this StaticBackend's max_batch={self.max_batch}: "
                             f"pass a larger max_batch= to StaticBackend, or send fewer prompts at once")
        # No clearing: slots past a row's length are never attended, and each forward writes before it reads.
        self._lengths = [0] * batch_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False,
                output_hidden: bool = False):
        batch, n = input_ids.shape
        if batch != len(self._lengths):
            raise ValueError(f"forward got {batch} rows but the cache holds {len(self._lengths)}: call reset() first")
        need = max(self._lengths, default=0) + n
        if need > self._capacity:
            raise ValueError(f"a row needs {need} cache slots but this StaticBackend holds max_len={self.max_len} "
                             f"(+{SPARE_SLOTS} spare for drafts): pass a larger max_len= to StaticBackend "
                             f"(at least prompt + max_new_tokens)")
        key = self.step_shape(batch, n, max(self._lengths, default=0), last_only, output_hidden)
        # Each row's count of real tokens: a host read, but only for prefill and a draft's catch-up forward,
        # which come right after the loop's own sync (the GPU queue is empty then).
        counts = [n] * batch if valid is None else valid.sum(dim=1).tolist()
        input_ids = input_ids.to(self.device)
        if key[1] > n:  # padded to the bucket: padding after each row's real tokens, outputs cut back to n
            input_ids = torch.nn.functional.pad(input_ids, (0, key[1] - n))
            valid = self._mask(batch, n, key[1]) if valid is None else \
                torch.nn.functional.pad(valid.to(self.device, torch.bool), (0, key[1] - n), value=False)
        logits, hidden = self._run(key, input_ids, valid)
        if key[1] > n:
            logits = logits if last_only else logits[:, :n]
            hidden = hidden[:, :n] if hidden is not None else None
        self._lengths = [length + c for length, c in zip(self._lengths, counts)]
        return (logits, hidden) if output_hidden else logits

    def trim(self, lengths: list[int]) -> None:
        lengths = list(lengths)
        if len(lengths) != len(self._lengths) or any(not 0 <= new <= old for new, old in zip(lengths, self._lengths)):
            raise ValueError(f"trim({lengths}) must keep between 0 and the cached count of each row {self._lengths}")
        self._lengths = lengths  # the slots past each length are simply overwritten later

    def fork(self, batch_size: int) -> StaticBackend:
        """A backend for batch_size new rows on the same weights, with buffers of its own for those rows: it
        prefills beside this one's running rows (eagerly: graphs belong to this one's buffers) until merge()."""
        if len(self._lengths) + batch_size > self.max_batch:
            raise ValueError(f"{len(self._lengths)} running rows + {batch_size} new ones exceed this StaticBackend's "
                             f"max_batch={self.max_batch}: pass a larger max_batch= to StaticBackend, or admit "
                             f"fewer rows at once")
        other = copy.copy(self)
        other.max_batch = batch_size
        other._cache = _SlotCache(self.config, batch_size, self._capacity, self._dtype, self.device)
        other._graphs_on, other._graphs, other._sights, other._pool, other._masks = False, {}, {}, None, {}
        # eager too: compiled steps are guarded on (and compile's graphs hold) this one's cache tensors
        other._step_fn, other._buckets, other._cold_sights, other.compile_mode = other._step, (), 0, None
        other._compile_graphs = False
        other.reset(batch_size)
        return other

    @torch.inference_mode()
    def merge(self, other: StaticBackend) -> None:
        """The rows of a fork join this batch after the existing rows (their used slots are copied in)."""
        start, rows = len(self._lengths), len(other._lengths)
        if start + rows > self.max_batch:
            raise ValueError(f"{start} running rows + {rows} joining exceed this StaticBackend's max_batch="
                             f"{self.max_batch}: pass a larger max_batch= to StaticBackend")
        used = max(other._lengths, default=0)
        for mine, theirs in zip(self._cache.layers, other._cache.layers):
            mine.keys[start:start + rows, :, :used] = theirs.keys[:rows, :, :used]
            mine.values[start:start + rows, :, :used] = theirs.values[:rows, :, :used]
        self._lengths += other._lengths

    @torch.inference_mode()
    def select_rows(self, rows: list[int]) -> None:
        rows = list(rows)
        if rows == list(range(len(self._lengths))):
            return
        lengths = [self._lengths[r] for r in rows]
        used = max(lengths, default=0)
        if used:
            # Rows move to the front of the buffers (fixed addresses: the captured graphs read them there).
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            for layer in self._cache.layers:
                layer.keys[: len(rows), :, :used] = layer.keys[index, :, :used]
                layer.values[: len(rows), :, :used] = layer.values[index, :, :used]
        self._lengths = lengths

    # ------------------------------------------------------------------ the step
    def _run(self, key: tuple, input_ids: torch.Tensor, valid: torch.Tensor | None):
        past = torch.tensor(self._lengths, dtype=torch.long)
        if self.device.type == "cuda":  # from pinned memory, asynchronously: a pageable copy would wait for the GPU
            past = past.pin_memory().to(self.device, non_blocking=True)
        small = key[1] <= self.graph_max_tokens
        if small and key not in self._graphs:
            self._sights[key] = sights = self._sights.get(key, 0) + 1
            self.cold_forwards += int(sights <= self._cold_sights)
        if self._graphs_on and small:
            captured = self._captured(key, input_ids, valid, past)
            if captured is not None:
                return captured.run(input_ids, valid, past)
        batch, n, span, last_only, output_hidden = key
        if valid is None:
            valid = self._mask(batch, n, n)
        step = self._step_fn if small else self._step  # prefill: eager, one-off widths would each compile
        if small and self._compile_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits, hidden = step(self._cache, input_ids, valid.to(self.device, torch.bool), past, span, last_only,
                              output_hidden)
        if small and self._compile_graphs:  # compile's graph outputs are overwritten by its next replay
            return logits.clone(), (hidden.clone() if hidden is not None else None)
        return logits, hidden

    def _mask(self, batch: int, real: int, width: int) -> torch.Tensor:
        """[batch, width] bool: the first `real` tokens of every row real, the rest padding. Built once per shape and
        only read (the step and the captured graphs copy from it): a step of unpadded rows allocates no mask."""
        key = (batch, real, width)
        if key not in self._masks:
            mask = torch.arange(width, device=self.device) < real
            self._masks[key] = mask.expand(batch, width).contiguous()  # contiguous: compiled steps guard on strides
        return self._masks[key]

    def _captured(self, key: tuple, input_ids, valid, past) -> _CapturedStep | None:
        """The graph of this step shape, captured the second time the shape is seen (one-offs stay eager)."""
        if key in self._graphs:
            return self._graphs[key]
        if self._sights[key] < 2:
            return None
        if self._pool is None:  # one memory pool for all graphs: they never run at the same time
            self._pool = torch.cuda.graph_pool_handle()
        self._graphs[key] = _CapturedStep(self._step_fn, self._cache, key, self.device, self._pool, input_ids, valid,
                                          past)
        return self._graphs[key]

    def _step(self, cache: _SlotCache, input_ids, valid, past, span: int, last_only: bool, output_hidden: bool):
        """One forward: pure tensor work on fixed addresses, the body of the captured graphs."""
        batch, n = input_ids.shape
        real = valid.long()
        count = real.sum(dim=1, keepdim=True)
        # Real tokens first, in order; padding after them (slots count, count+1, ...).
        offset = torch.where(valid, real.cumsum(dim=1) - 1, count + (1 - real).cumsum(dim=1) - 1)
        slots = past.unsqueeze(1) + offset  # [B, n], also the positions
        visible = torch.arange(span, device=input_ids.device) <= slots.unsqueeze(-1)  # [B, n, span]
        mask = visible.unsqueeze(1)
        if self._additive_mask:
            mask = torch.zeros(mask.shape, dtype=self._dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self._dtype).min)
        cache.slots, cache.span = slots, span
        hidden = self._decoder(input_ids=input_ids, attention_mask=mask, position_ids=slots, use_cache=True,
                               **{self._cache_keyword: cache}).last_hidden_state
        picked = hidden
        if last_only:  # each row's last real token
            last = (real * torch.arange(1, n + 1, device=real.device)).argmax(dim=1)
            picked = hidden[torch.arange(batch, device=hidden.device), last].unsqueeze(1)
        logits = self._head(picked)[..., : self.vocab_size].float()
        return logits, (hidden if output_hidden else None)


class _CapturedStep:
    """One step shape captured as a CUDA graph, with its static inputs and outputs.

    Built on the call that first needs it, with that call's inputs: the warm-up run writes K/V at exactly the
    slots the replay then rewrites with the same values, so capturing never disturbs a cached token.
    """

    def __init__(self, step, cache: _SlotCache, key: tuple, device: torch.device, pool, input_ids, valid, past):
        batch, n, span, last_only, output_hidden = key
        self.ids = torch.zeros(batch, n, dtype=torch.long, device=device)
        self.valid = torch.ones(batch, n, dtype=torch.bool, device=device)
        self.past = torch.zeros(batch, dtype=torch.long, device=device)
        self._load(input_ids, valid, past)
        args = (cache, self.ids, self.valid, self.past, span, last_only, output_hidden)
        # Warm up on a side stream (cuBLAS workspaces, lazy inits, compilation), as capture requires.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads may touch CUDA while this one captures
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits, self.hidden = step(*args)

    def _load(self, input_ids, valid, past) -> None:
        self.ids.copy_(input_ids)
        if valid is None:
            self.valid.fill_(True)
        else:
            self.valid.copy_(valid)
        self.past.copy_(past)

    def run(self, input_ids: torch.Tensor, valid: torch.Tensor | None, past: torch.Tensor):
        self._load(input_ids, valid, past)
        self.graph.replay()
        # Copies: the next replay of this graph (or another sharing its memory pool) overwrites the outputs.
        return self.logits.clone(), (self.hidden.clone() if self.hidden is not None else None)


class _SlotLayer(CacheLayerMixin):
    """One layer's K/V for max_batch rows × capacity slots; written where the cache's slots say."""

    is_compileable = True

    def __init__(self, cache: _SlotCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.cache, self.keys, self.values = cache, keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        batch, heads, n, dim = key_states.shape
        if heads != self.keys.shape[1] or dim != self.keys.shape[3]:
            raise ValueError(f"the model produced K/V of {heads} heads x {dim} but the static cache was sized "
                             f"{self.keys.shape[1]} x {self.keys.shape[3]} from its config")
        index = self.cache.slots[:, None, :, None].expand(batch, heads, n, dim)
        keys, values = self.keys[:batch], self.values[:batch]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        span = self.cache.span
        return keys[:, :, :span], values[:, :, :span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.span, 0

    def get_seq_length(self) -> int:
        raise RuntimeError("StaticBackend's cache has one length per row: positions must be passed explicitly")

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _SlotCache(Cache):
    """The model-facing cache: per-layer static K/V, and where this forward's tokens go (set by the step)."""

    def __init__(self, config, max_batch: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 static: bool = False):
        heads = config.num_key_value_heads or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (max_batch, heads, capacity, dim)
        # Zeros, not empty: masked slots still enter the attention product, and garbage there could be NaN.
        super().__init__(layers=[_SlotLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                                            torch.zeros(shape, dtype=dtype, device=device))
                                 for _ in range(config.num_hidden_layers)])
        if static:  # fixed addresses for torch.compile: no guard on them, and its CUDA graphs read them in place
            for layer in self.layers:
                torch._dynamo.mark_static_address(layer.keys)
                torch._dynamo.mark_static_address(layer.values)
        self.slots: torch.Tensor | None = None
        self.span = 0


def _check_supported(model, config) -> None:
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"StaticBackend does not support {model_type!r} models (supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}): use the transformers backend (HFBackend) for it")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types) or (
        not layer_types and getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True))
    if sliding:
        raise ValueError(f"StaticBackend does not support sliding-window attention ({model_type!r} with "
                         f"sliding_window={config.sliding_window}): use the transformers backend (HFBackend)")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ValueError(f"StaticBackend does not support {rope_type!r} RoPE scaling (its frequencies follow the "
                         f"longest sequence, read on the host): use the transformers backend (HFBackend)")
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        raise ValueError(f"StaticBackend keeps the whole cache on one device, but this model is split over "
                         f"{sorted(map(str, devices))}: use the transformers backend (HFBackend) for it")
    attention = config._attn_implementation
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(f"StaticBackend needs sdpa or eager attention, not {attention!r}: load the model with "
                         f"attn_implementation='sdpa'")


def _compile_mode(compile, device: torch.device) -> str | None:
    if compile is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    if compile is False or compile is None:
        return None
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be True, False or a torch.compile mode ({', '.join(COMPILE_MODES)}), "
                         f"got {compile!r}")
    return compile


def _graphs_wanted(cuda_graphs, device: torch.device, compile_mode: str | None = None) -> bool:
    own_graphs = compile_mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"
    if cuda_graphs == "auto":
        return device.type == "cuda" and not own_graphs
    if cuda_graphs is True and own_graphs:
        raise ValueError(f"compile mode {compile_mode!r} captures CUDA graphs itself: pass cuda_graphs='auto' or "
                         f"False with it, or compile='max-autotune-no-cudagraphs' to keep this backend's graphs")
    if cuda_graphs is True and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device.type}: "
                         f"pass cuda_graphs='auto' or False")
    if cuda_graphs not in (True, False):
        raise ValueError(f"cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
    return bool(cuda_graphs)


def load(source, options):
    """The static backend's loader: the transformers model on a StaticBackend built with options.backend_options,
    its logits cut to the tokenizer's vocabulary; backend_options["warm_up"] (True or warm_up()'s arguments) runs
    every small step shape before the first request."""
    from dataclasses import replace

    from ..models.sources import LoadedModel, load_transformers

    loaded = load_transformers(source, replace(options, backend_options=None))
    vocab = len(loaded.tokenizer) if loaded.tokenizer is not None else None
    kwargs = dict(options.backend_options or {})
    warm = kwargs.pop("warm_up", None)  # True, or {"batches": [1, 4], "seconds": 60}
    backend = StaticBackend(loaded.model, vocab_size=vocab, **kwargs)
    if warm:
        backend.warm_up(**(warm if isinstance(warm, dict) else {}))
    return LoadedModel(backend, loaded.tokenizer, loaded.name, loaded.path, backend="static")


register_backend("static", load, help="transformers on a preallocated KV cache with CUDA graphs, for GPUs; "
                                      "Llama, Mistral, Qwen2/3 and Gemma")
