"""foxlm's own generation path: paged cache, Triton decode kernel, CUDA graphs, forget-gate eviction.

``generate(model, prompts, max_new_tokens)`` takes prompts of different lengths (lists of token ids),
prefills them through the fused op (left-padded batch, in column chunks), then decodes one token per row and
step: with a CUDA device the step (all layers, the decode kernel, the LM head) is captured once in a CUDA
graph and replayed. HF ``model.generate`` keeps working through the model's default ``FoxCache``.
"""

from __future__ import annotations

import math
import numbers
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops.backend import use_triton
from .cache import PagedFoxCache


@dataclass
class GenerateOutput:
    """sequences: the new tokens of every prompt (cut after ``eos_token_id``), ``num_return_sequences`` rows a
    prompt, one after another; cache: ``PagedFoxCache.stats()`` at the end; prefill_seconds / decode_seconds: wall
    time of the two phases (device synchronised), the prefill giving the first token (its time to first token) and
    ``decode_steps`` (that first token included) counting the decode's; first_step_seconds: the decode's first step
    alone, its warm-up (kernels compiled, a CUDA graph's warm-up, first allocations), left out of
    ``decode_tokens_per_s``."""

    sequences: list[list[int]]
    cache: dict = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    first_step_seconds: float = 0.0
    batch_size: int = 1

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second of the decode after its first step (all rows); None with fewer than 3 tokens."""
        steady = self.decode_seconds - self.first_step_seconds
        return self.batch_size * (self.decode_steps - 2) / steady if self.decode_steps > 2 and steady > 0 else None


def sample_next(
    logits: torch.Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: greedy, or sampling with temperature, top-k, top-p (nucleus) and min-p
    (tokens less likely than ``min_p`` times the likeliest go), applied in that order as HF generate does."""
    if not do_sample:
        return logits.argmax(-1)
    # as HF's warpers check theirs: these were torch errors naming nothing (top_k < 0, temperature 0, min_p > 1), or
    # no error at all (top_p > 1); generate checks its own, naming where each came from
    if not (_is_real(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if not (_is_int(top_k) and top_k >= 0):
        raise ValueError(f"top_k: expected an integer >= 0, got {top_k!r}")
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if not (_is_real(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # keep the smallest set of likeliest tokens whose mass reaches top_p, read as HF's TopPLogitsWarper reads it:
        # sorted ascending, a token goes while the mass up to it (itself and every less likely one) is <= 1 - top_p.
        # The same sort orders tied logits (frequent in bf16) as HF's does, and the same sums round as HF's, so the
        # same tokens stay at the boundary; a descending sort kept other tied tokens, a seeded draw other tokens
        sorted_logits, order = torch.sort(logits, dim=-1)
        drop = torch.softmax(sorted_logits, dim=-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # the likeliest token stays whatever top_p (0: greedy), as HF's min_tokens_to_keep=1
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0:
        # compared as probabilities, not as logits against log(min_p): the same rounding as HF's MinPLogitsWarper at
        # a boundary; the likeliest token always stays (min_p <= 1)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class CachedDecoder:
    """One decode step of ``model`` over a ``PagedFoxCache``: eager, or replayed from a CUDA graph.

    ``step(tokens [B]) -> logits [B, V]`` feeds one token per row at each row's own position. With
    ``cuda_graph`` the first step runs eagerly (compiles the kernels, warms the allocator) on a side stream,
    the second is captured and every later one replays it; a pool reallocation (``cache.version``) recaptures.
    Steps on the PyTorch decode path (``use_backend("torch")``, float64) stay eager: it sizes its gather from
    the cache lengths on the host, which a graph cannot capture.
    """

    def __init__(self, model, cache: PagedFoxCache, cuda_graph: bool | None = None):
        if cuda_graph is not None and not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph: expected True, False or None, got {cuda_graph!r}")
        if cuda_graph and cache.device.type != "cuda":
            raise ValueError(f"cuda_graph: CUDA graphs need a CUDA device, the model is on {cache.device}")
        self.model, self.cache = model, cache
        self.cuda_graph = cache.device.type == "cuda" if cuda_graph is None else cuda_graph
        B = cache.batch_size
        self._ids = torch.zeros(B, 1, dtype=torch.long, device=cache.device)
        self._pos = torch.zeros(B, 1, dtype=torch.long, device=cache.device)
        self._graph = self._logits = None
        self._graph_version = -1
        self._steps = 0

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self._ids, position_ids=self._pos, cache=self.cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B] the newest token of every row -> next-token logits [B, V] (valid until the next step)."""
        cache = self.cache
        cache.begin(1)
        self._ids.copy_(tokens.view(-1, 1))
        self._pos.copy_(cache.write_pos.view(-1, 1))
        self._steps += 1
        if not (self.cuda_graph and use_triton(self.cache.k_pool)):
            return self._forward()
        if self._steps == 1:  # warm-up, on a side stream as graph capture wants
            stream = torch.cuda.Stream(device=cache.device)
            stream.wait_stream(torch.cuda.current_stream(cache.device))
            with torch.cuda.stream(stream):
                logits = self._forward()
            torch.cuda.current_stream(cache.device).wait_stream(stream)
            return logits
        if self._graph is None or self._graph_version != cache.version:
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._logits = self._forward()
            self._graph_version = cache.version
        self._graph.replay()
        cache.end_step()
        return self._logits


def _check_prompts(prompts, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (torch.Tensor, np.ndarray)):  # a tokenizer's return_tensors="pt" or "np"
        prompts = [prompts.tolist()] if prompts.ndim == 1 else prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        p = p.tolist() if isinstance(p, (torch.Tensor, np.ndarray)) else p
        if isinstance(p, numbers.Integral):  # list(p) would raise a TypeError naming nothing
            raise ValueError(f"prompts[{i}]: expected a list of token ids, got the id {p!r} (one prompt goes in a "
                             f"list of its own: [ids])")
        p = list(p)
        if not p or not all(_is_int(t) and t >= 0 for t in p):  # numpy's integers too (an array's iteration)
            raise ValueError(f"prompts[{i}]: expected a non-empty list of non-negative token ids")
        p = [int(t) for t in p]
        if max(p) >= vocab:  # the embedding would fail with an IndexError naming nothing
            raise ValueError(f"prompts[{i}]: token id {max(p)} is outside the model's vocabulary of {vocab} "
                             f"(a tokenizer for another model?)")
        out.append(p)
    return out


def _unpad(prompts, attention_mask) -> list[list[int]]:
    """Each row's real tokens of a padded batch, HF generate's input_ids and attention_mask: prompts [B, T] (or [T])
    and attention_mask of the same shape, 1 at real tokens and 0 at padding, before them, after them or both (a
    tokenizer's padding=True)."""
    try:
        ids, mask = (np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x) for x in (prompts, attention_mask))
    except ValueError:  # a ragged list: no batch to unpad
        raise ValueError("prompts: with an attention_mask, expected a [B, T] batch of token ids (rows of one length), "
                         "as the mask is") from None
    if not ids.size:
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    if ids.ndim not in (1, 2) or mask.shape != ids.shape:
        raise ValueError(f"attention_mask: expected the prompts' shape {ids.shape}, got {mask.shape}")
    if not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)) or not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask: expected 1 at real tokens and 0 at padding")
    rows = []
    for b, (row, real) in enumerate(zip(ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, ids.shape[-1]))):
        at = np.flatnonzero(real)
        if not len(at) or at[-1] - at[0] + 1 != len(at):
            raise ValueError(f"attention_mask[{b}]: expected one run of real tokens with padding before and/or after "
                             f"it, got {'none' if not len(at) else 'padding between real tokens'}")
        rows.append(row[at[0]:at[-1] + 1].tolist())
    return rows


def _is_int(value) -> bool:
    """An integer, numpy's included, but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# GenerationConfig's global defaults in transformers 5.x (``_get_default_generation_params``; min_p and min_new_tokens
# have none, which means off): what HF generate takes for a control neither the caller nor generation_config sets
_HF_DEFAULTS = dict(do_sample=False, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    min_new_tokens=0, eos_token_id=None, num_return_sequences=1)


# generation_config entries that change HF generate's tokens and that foxlm's decoding (greedy or sampling, the
# controls above) does not apply, with the value at which they do nothing; encoder_repetition_penalty applies to a
# decoder-only model's prompt in HF generate
_NOT_APPLIED = dict(num_beams=1, encoder_repetition_penalty=1.0, num_beam_groups=1,
                    penalty_alpha=None, diversity_penalty=0.0, typical_p=1.0,
                    epsilon_cutoff=0.0, eta_cutoff=0.0, top_h=None, no_repeat_ngram_size=0, bad_words_ids=None,
                    force_words_ids=None, forced_bos_token_id=None, forced_eos_token_id=None, suppress_tokens=None,
                    begin_suppress_tokens=None, sequence_bias=None, guidance_scale=1.0,
                    exponential_decay_length_penalty=None, min_length=0, stop_strings=None, dola_layers=None,
                    watermarking_config=None, max_time=None, prompt_lookup_num_tokens=None)


def _warn_not_applied(config) -> None:
    """A warning naming what ``model.generation_config`` sets that foxlm's generate does not apply (HF generate
    would: beams, n-gram bans, forced tokens...): taking the config's controls, it must not pass over these silently."""
    given = {name: value for name, neutral in _NOT_APPLIED.items()  # None, the neutral value or an empty list: unset
             if (value := getattr(config, name, None)) is not None and value != neutral
             and not (isinstance(value, (list, dict)) and not value)}
    if given:
        settings = ", ".join(f"{name}={value!r}" for name, value in given.items())
        warnings.warn(f"model.generation_config sets {settings}: foxlm's generate does not apply "
                      f"{'it' if len(given) == 1 else 'them'} (greedy or sampling only; HF model.generate does)",
                      UserWarning, stacklevel=5)  # past _generation_controls, generate and no_grad's wrapper


def _generation_controls(model, from_config: set[str], **given) -> list:
    """The decoding controls as HF generate merges them: the caller's value where not None, else the model's
    ``generation_config``'s where not None, else HF's global default. Adds to ``from_config`` the names whose value
    came from the config (their errors name it)."""
    config = getattr(model, "generation_config", None)  # a PEFT model's is its base model's (attribute forwarding)
    _warn_not_applied(config)
    values = []
    for name, value in given.items():
        if value is None and getattr(config, name, None) is not None:
            value = getattr(config, name)
            from_config.add(name)
        values.append(_HF_DEFAULTS[name] if value is None else value)
    return values


def _check_eos(eos_token_id) -> list[int]:
    """The stop tokens: [] for None, [id] for an int, the ids of a list or of a 0-d or 1-d integer tensor or array (HF
    generate takes a tensor too; a list compared with a tensor of as many ids as rows would have matched them row by
    row)."""
    if isinstance(eos_token_id, (torch.Tensor, np.ndarray)):
        dtype = eos_token_id.dtype
        integral = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool) \
            if isinstance(dtype, torch.dtype) else np.issubdtype(dtype, np.integer)
        if not integral or eos_token_id.ndim > 1:  # floats HF would compare as given, and never stop
            raise ValueError(f"eos_token_id: expected a 0-d or 1-d integer tensor, got {eos_token_id.ndim}-d "
                             f"{dtype}")
        eos_token_id = eos_token_id.tolist()  # a 0-d one's is an int
    ids = [] if eos_token_id is None else [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"eos_token_id: expected a token id, a list of them or None, got {eos_token_id!r}")
    return [int(t) for t in ids]


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | list[list[int]] | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    min_new_tokens: int | None = None,
    eos_token_id: int | list[int] | torch.Tensor | None = None,
    num_return_sequences: int | None = None,
    vocab_size: int | None = None,
    evict: bool = False,
    tolerance: float = math.exp(-10),
    page_size: int = 64,
    prefill_chunk: int = 16384,
    cuda_graph: bool | None = None,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens for every prompt with foxlm's fast path.

    The decoding controls (``do_sample`` to ``num_return_sequences``) left None take ``model.generation_config``'s
    values, as HF ``model.generate`` merges them: the config's where it sets one, else HF's defaults (greedy; when
    sampling, temperature 1, top_k 50, top_p 1, no min_p; no repetition penalty, no min_new_tokens, no eos; one
    sequence a prompt). So with nothing set, generation stops at the config's ``eos_token_id`` (a model saved by
    foxlm records its config's). Unlike HF, an explicit None is the same as leaving a control unset:
    ``eos_token_id=[]`` stops at nothing (as in HF, there with a ``pad_token_id``) and ``top_k=0`` samples among all
    tokens.

    Args:
        model: a ``FoxForCausalLM`` (any arch; eviction needs QK-norm and a forget gate: fox-pro), or a PEFT model
            around one (LoRA adapters).
        prompts: token-id lists of any lengths (or a [B, T] / [T] tensor or numpy array, every id a real token
            unless ``attention_mask`` says otherwise).
        attention_mask: with a padded [B, T] (or [T]) ``prompts``, 1 at its real tokens and 0 at padding (before and/or
            after each row's real tokens), as a tokenizer's ``padding=True`` gives it and HF generate takes it; only
            the real tokens are prompts.
        do_sample: sample (with ``temperature``, ``top_k``, ``top_p``, ``min_p``) instead of greedy decoding.
        top_k: sampling keeps only the ``top_k`` likeliest tokens (0: all).
        min_p: sampling keeps only the tokens at least ``min_p`` times as likely as the likeliest (0: all).
        repetition_penalty: divide the positive logits of the tokens already in a row (its prompt and what it has
            generated) by this, and multiply the negative ones (1: none; above 1 discourages repeats, below 1
            encourages them), greedy or sampling, before the sampling controls: HF's ``repetition_penalty``. Only a
            prompt's real tokens count, never padding (HF generate with an ``attention_mask`` reads it so too).
        min_new_tokens: no row stops before this many new tokens: until then ``eos_token_id`` cannot be generated.
        eos_token_id: a row stops at this token, or at any of a list's or 1-d tensor's (as
            ``generation_config.eos_token_id``, which may be a list; ``[]``: no stop); the step loop ends when all
            rows have.
        num_return_sequences: sequences to sample for each prompt (needs ``do_sample``, as HF generate without beam
            search): HF's rows, each prompt's one after another, and from the same seed HF's tokens.
        vocab_size: only ids below it can be generated (the model's vocabulary is padded, e.g. 50304).
        evict: forget-gate cache eviction: free the cache pages whose keys have decayed so far that no future
            query can give them more than ``tolerance`` of its attention (see
            ``foxlm.ops.forgetting_attention.decode``).
        page_size: cache page size in tokens (the eviction granularity).
        prefill_chunk: prompt columns per prefill forward (bounds activation memory of long prompts).
        cuda_graph: capture the decode step in a CUDA graph (default: on CUDA; True needs a CUDA device).
        generator: random generator for sampling.

    Returns:
        GenerateOutput with the new tokens per prompt (``num_return_sequences`` rows each), the cache size and the
        phase timings.
    """
    vocab = model.config.vocab_size
    prompts = _check_prompts(prompts if attention_mask is None else _unpad(prompts, attention_mask), vocab)
    from_config: set[str] = set()
    do_sample, temperature, top_k, top_p, min_p, repetition_penalty, min_new_tokens, eos_token_id, n = \
        _generation_controls(model, from_config, do_sample=do_sample, temperature=temperature, top_k=top_k,
                             top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                             min_new_tokens=min_new_tokens, eos_token_id=eos_token_id,
                             num_return_sequences=num_return_sequences)

    def arg(name: str) -> str:  # what an error names: the argument, or the config entry its value came from
        return f"model.generation_config.{name}" if name in from_config else name

    # counts and numbers of another type (2.5, "5") were TypeErrors deep inside naming nothing
    for name, value, low in (("max_new_tokens", max_new_tokens, 1), (arg("top_k"), top_k, 0),
                             (arg("min_new_tokens"), min_new_tokens, 0), (arg("num_return_sequences"), n, 1),
                             ("page_size", page_size, 1), ("prefill_chunk", prefill_chunk, 1)):
        if not _is_int(value) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    if vocab_size is not None and not (_is_int(vocab_size) and 1 <= vocab_size <= vocab):
        raise ValueError(f"vocab_size: expected 1 to the model's {vocab}, got {vocab_size!r}")
    stops = _check_eos(eos_token_id)
    if not isinstance(do_sample, (bool, np.bool_)):  # a truthy string ("no") sampled
        raise ValueError(f"{arg('do_sample')}: expected True or False, got {do_sample!r}")
    do_sample = bool(do_sample)
    if n > 1 and not do_sample:  # HF generate's ValueError, where its beam search (which foxlm has not) would not run
        raise ValueError(f"{arg('num_return_sequences')}: greedy decoding gives one sequence a prompt, got {n} (as "
                         f"in HF generate without beam search); sample them with do_sample=True")
    # greedy decoding ignores the temperature, but a negative one (or NaN, or a string) is a mistake all the same, as
    # top_k's and top_p's are; 0 stays a greedy caller's way of saying greedy
    if not (_is_real(temperature) and (temperature > 0 if do_sample else temperature >= 0)):
        raise ValueError(f"{arg('temperature')}: expected > 0{'' if do_sample else ' (or 0 when greedy)'}, got "
                         f"{temperature!r}")
    if not (_is_real(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"{arg('top_p')}: expected a probability mass in (0, 1], got {top_p!r}")
    if not (_is_real(min_p) and 0.0 <= min_p <= 1.0):
        raise ValueError(f"{arg('min_p')}: expected a fraction of the likeliest token's probability in [0, 1], got "
                         f"{min_p!r}")
    if not (_is_real(repetition_penalty) and 0.0 < repetition_penalty < math.inf):
        raise ValueError(f"{arg('repetition_penalty')}: expected a positive number (1: no penalty), got "
                         f"{repetition_penalty!r}")
    # the caller's min_new_tokens only: the config's, as in HF generate, holds back what stops there are, if any
    if min_new_tokens > max_new_tokens and "min_new_tokens" not in from_config:
        raise ValueError(f"min_new_tokens: expected at most max_new_tokens ({max_new_tokens}), got {min_new_tokens}")
    if min_new_tokens and not stops and "min_new_tokens" not in from_config:  # a no-op the caller did not mean
        raise ValueError("min_new_tokens: needs eos_token_id, the stop it holds back (without one no row stops early)")
    # min_new_tokens holds back the stops with -inf logits, which an infinite temperature makes NaN: torch.multinomial
    # failed on them after the prefill, as in HF generate, naming neither
    if do_sample and temperature == math.inf and min_new_tokens and any(t < (vocab_size or vocab) for t in stops):
        raise ValueError(f"{arg('temperature')}: inf cannot sample while {arg('min_new_tokens')} holds back "
                         f"eos_token_id (its -inf logit over an infinite temperature is NaN); give a finite one")
    if not isinstance(evict, bool):  # a truthy string ("no") evicted
        raise ValueError(f"evict: expected True or False, got {evict!r}")
    if generator is not None and not isinstance(generator, torch.Generator):  # ignored when greedy
        raise ValueError(f"generator: expected a torch.Generator or None, got {generator!r}")
    if evict and model.config.gate == "none":
        raise ValueError("evict: needs a forget gate, and this model has gate='none': none of its keys ever decays, "
                         "so eviction would free nothing")
    prompts = [p for p in prompts for _ in range(n)]  # HF's expansion: each prompt's sequences one after another
    was_training = model.training
    model.eval()  # no dropout while decoding; the caller's mode comes back after
    try:
        device = next(model.parameters()).device
        B, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, width, dtype=torch.long)
        mask = torch.zeros(B, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        padded = bool((mask == 0).any())
        max_length = width + max_new_tokens
        num_pages = None
        if evict:  # start with the prompts' pages (plus one per row and head); the pool grows if it must
            cfg = model.config
            per_row = sum(-(-(len(p) + page_size) // page_size) for p in prompts)
            num_pages = 1 + cfg.num_hidden_layers * cfg.num_key_value_heads * per_row
        cache = PagedFoxCache.from_model(model, B, max_length, page_size=page_size, num_pages=num_pages,
                                         tolerance=tolerance)
        if evict and cache.logit_bounds is None:
            raise ValueError("evict: needs a QK-norm model (qk_norm=True), whose norm weights bound every logit")
        decoder = CachedDecoder(model, cache, cuda_graph)  # before the prefill: it checks cuda_graph
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        pick = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    generator=generator)
        stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
        # the stops min_new_tokens holds back: those the (cut) logits have, picked once, not with a sync every step
        held = torch.tensor([t for t in stops if t < (vocab_size or vocab)], dtype=torch.long, device=device)
        seen = None
        if repetition_penalty != 1.0:  # [B, V]: the tokens of each row so far (its prompt's, not padding)
            seen = torch.zeros(B, vocab, dtype=torch.bool)
            for b, p in enumerate(prompts):
                seen[b, p] = True
            seen = seen.to(device)

        def next_tokens(logits: torch.Tensor, position: int) -> torch.Tensor:
            """Tokens [B] at new-token index ``position`` from logits [B, V]: the processors, then sample_next."""
            if vocab_size is not None:
                logits = logits[:, :vocab_size]
            if seen is not None:  # in fp32, as HF generate processes its logits
                logits = logits.float()
                scaled = torch.where(logits < 0, logits * repetition_penalty, logits / repetition_penalty)
                logits = torch.where(seen[:, :logits.shape[-1]], scaled, logits)
            if position < min_new_tokens:
                logits = logits.index_fill(-1, held, float("-inf"))
            tokens = sample_next(logits, **pick)
            if seen is not None:
                seen[torch.arange(B, device=device), tokens] = True
            return tokens

        t0 = time.perf_counter()
        for a in range(0, width, prefill_chunk):
            b = min(width, a + prefill_chunk)
            out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b] if padded else None, cache=cache,
                        use_cache=True, logits_to_keep=1)
        tokens = next_tokens(out.logits[:, -1], 0)
        if evict:
            cache.evict()
        sync()
        t1 = time.perf_counter()

        new = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
        new[:, 0] = tokens
        done = torch.zeros(B, dtype=torch.bool, device=device)
        steps, first_step = 1, 0.0
        for i in range(1, max_new_tokens):
            if stops:
                done |= torch.isin(tokens, stop_ids)
                if i % 16 == 0 and bool(done.all()):  # a host sync now and then, not every step
                    break
            tokens = next_tokens(decoder.step(tokens), i)
            if stops:
                tokens = tokens.masked_fill(done, stops[0])
            new[:, i] = tokens
            steps += 1
            if evict and i % page_size == 0:
                cache.evict()
            if i == 1:  # the warm-up step, timed apart: one sync
                sync()
                first_step = time.perf_counter() - t1
        sync()
        t2 = time.perf_counter()
        sequences = []
        for row in new[:, :steps].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), None)
            if end is not None:
                row = row[: end + 1]
            sequences.append(row)
        return GenerateOutput(sequences, cache.stats(), t1 - t0, t2 - t1, steps, first_step, B)
    finally:
        model.train(was_training)
