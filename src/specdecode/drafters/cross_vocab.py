"""A draft model of another tokenizer: its text, turned into the target's tokens (Timor et al., ICML 2025).

Each row's text is kept on both sides by text/token_bridge.py (RowText): the target's bytes, and the draft's tokens
of them. A step brings the draft's KV to those tokens (DraftKV: the common prefix stays, the rest is fed in the
step's first forward), then drafts, per row, by one of two methods:

- SLEM (string-level exact match): the draft continues greedily in its own vocabulary; after each draft forward its
  new text is tokenized by the target's tokenizer (RowText.proposal: with the row's last target tokens, so a token
  straddling the row's end is handled; the last word's tokens only once the text ends: more text may change them),
  until the row has its K whole target tokens, or has run the forwards its draft tokens per target token (in the
  row's text so far) say K target tokens take, plus one. The proposals are
  deterministic (q = None): the verifier keeps a draft x with probability p(x) and otherwise samples p without x,
  which is the target's distribution exactly whatever x is (rejection.py), under every temperature, top-k/top-p,
  min_p, penalty, logit_bias and grammar (the session cuts a chain at the first draft the grammar forbids). A slot
  the draft's text did not fill within those forwards holds the token that text was still growing into: every
  slot is verified anyway (the loop asked for K), so the best guess at hand costs nothing more.
- TLI (token-level intersection): the draft's distribution restricted to the tokens that are the same bytes in both
  vocabularies, renormalised: a distribution over target tokens, warped, penalised and masked exactly as the
  target's p (DraftContext), sampled with the row's uniforms (coupled rows: its Gumbel noise), handed over as q.
  The standard rejection rule then keeps the output exact. A draft drawn there is a draft token too, fed next.

method "auto" (the default) drafts a greedy row by SLEM: a greedy row keeps a draft only where it is the target's
argmax, and SLEM proposes the draft's own greedy text in the target's tokens where TLI can propose only shared tokens
(on the real models TLI kept fewer greedy drafts in every pair and set measured: docs/BENCHMARKS.md, "Drafts of
another tokenizer"). A sampled row it drafts by the method that kept the larger share of that row's drafts
(MethodRecord): SLEM first (on code it kept more than TLI, where the shared vocabulary lacks the target's code
tokens), then TLI as long, then the one that kept more, trying the other again now and then as the text changes.
The choice reads only the row's settings and past outcomes, never this step's random numbers, so every row stays
exact. "slem" and "tli" use one method for every row.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..backends import as_backend
from ..backends.base import ModelBackend, capabilities, pad
from ..backends.prefix_cache import PrefixCache
from ..backends.rows import RowChange, RowText, move_rows
from ..exact.sampling import greedy, sample_with_uniforms
from ..text.token_bridge import WINDOW, BridgedRow, DraftKV, SharedVocabulary, TokenText, shared_vocabulary
from ..text.vocab import VocabularyMismatchError, check_same_tokenizer, unwrap_model
from .base import DraftChoice, DraftContext, Drafter, DraftOutcome, DraftOutlook, DraftRows, Proposal

METHODS = ("auto", "slem", "tli")
MAX_FORWARDS = 3  # SLEM: draft forwards a step may run per target token asked (a draft of much shorter tokens)
MIN_SHARED = 0.25  # TLI needs this share of the draft's vocabulary in the target's (else its q is too narrow)
EXPLORE = 4  # "auto": drafts each method proposes for a row before their shares kept are compared
REVISIT = 64  # ... and drafts of the better one before the other is tried again (a row's text turns: prose, code)
DECAY = 0.9  # a method's record, per proposal of it: the share kept follows the row's recent text


class Bridge:
    """What every row of one (draft tokenizer, target tokenizer) pair shares: both read as bytes, and their shared
    tokens. Built once per pair (reading a 262k vocabulary takes a second or two)."""

    def __init__(self, draft_tokenizer, target_tokenizer):
        self.target = TokenText(target_tokenizer, "target")
        self.draft = TokenText(draft_tokenizer, "draft")
        self.shared: SharedVocabulary = shared_vocabulary(self.draft, self.target)
        self.tli_possible = len(self.shared) >= MIN_SHARED * self.draft.size

    def row(self, tokens: list[int]) -> BridgedRow:
        row = BridgedRow(self.target, self.draft, self.shared)
        row.commit(tokens)
        return row


@dataclass
class MethodRecord:
    """What "auto" chooses a row's method by: the drafts each method kept and proposed for it (decayed), the drafts
    each has proposed in all, and how many drafts ago each was last used."""

    kept: dict = field(default_factory=lambda: {"slem": 0.0, "tli": 0.0})
    proposed: dict = field(default_factory=lambda: {"slem": 0.0, "tli": 0.0})
    tried: dict = field(default_factory=lambda: {"slem": 0, "tli": 0})
    since: dict = field(default_factory=lambda: {"slem": 0, "tli": 0})

    def share(self, method: str) -> float:
        return self.kept[method] / self.proposed[method] if self.proposed[method] else 0.0

    def choose(self) -> str:
        for method in ("slem", "tli"):
            if self.tried[method] < EXPLORE:
                return method
        best = "tli" if self.share("tli") > self.share("slem") else "slem"  # a tie: SLEM, the cheaper
        other = "slem" if best == "tli" else "tli"
        return other if self.since[other] >= REVISIT else best

    def record(self, method: str, kept: int, proposed: int) -> None:
        if self.since[method] >= REVISIT:  # tried again after REVISIT drafts: what it kept then is stale
            self.kept[method] = self.proposed[method] = 0.0
        self.kept[method] = DECAY * self.kept[method] + kept
        self.proposed[method] = DECAY * self.proposed[method] + proposed
        self.tried[method] += proposed
        self.since[method] = 0
        self.since["slem" if method == "tli" else "tli"] += proposed


@dataclass
class _Row:
    """One row: its text where the session keeps it, the draft's tokens of it, and what the draft's KV holds."""

    text: RowText
    bridged: BridgedRow
    kv: DraftKV
    changed: int  # the first draft id that changed since the KV's last sync
    prompt_length: int  # draft ids of the prompt: all a parked entry of its KV may lend
    read: int  # the row's tokens (prompt and output) its draft side has read
    methods: MethodRecord = field(default_factory=MethodRecord)  # "auto"'s record of this row
    pending: tuple[str, int] | None = None  # the method and drafts of its proposal not yet observed

    # What move_rows and the prefix cache read of a row (as of a RowText): here its draft side, what its KV holds.
    @property
    def prompt(self) -> list[int]:
        return self.bridged.draft.ids[: self.prompt_length]

    def tokens(self) -> list[int]:
        return list(self.kv.held)


class CrossVocabDrafter(Drafter):
    """Drafts for a target whose tokenizer differs from the draft model's (see the module's doc).

    model: what load_model returns (a model with its tokenizer), or a (model or backend, tokenizer) pair.
    target_tokenizer: the target's tokenizer (its tokens are what this drafter proposes). method: "auto", "slem" or
    "tli"."""

    catch_up_window = 32
    drafts_from_model = True

    def __init__(self, model, target_tokenizer, method: str = "auto"):
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        inner, tokenizer = model if isinstance(model, tuple) else unwrap_model(model)
        if tokenizer is None or target_tokenizer is None:
            raise VocabularyMismatchError(
                "a draft whose vocabulary differs from the target's needs both tokenizers to match their text: load "
                "both models with load_model (or pass the draft as a (model, tokenizer) pair and the target's "
                "tokenizer=), or use a draft that shares the target's tokenizer")
        self.bridge = Bridge(tokenizer, target_tokenizer)
        if method == "tli" and not self.bridge.tli_possible:
            raise VocabularyMismatchError(
                f"method 'tli' needs the vocabularies to overlap: only {len(self.bridge.shared)} of the draft's "
                f"{self.bridge.draft.size} tokens are target tokens; use method 'slem' (or 'auto')")
        self.method = method
        self.backend: ModelBackend = as_backend(inner, self.bridge.draft.size)
        self.backend.reset(0)  # rows join through relayout, into forks (a fresh llama.cpp backend holds one row)
        self.vocab_size = self.bridge.target.size  # what it proposes: target tokens (and q over them)
        self._capabilities = capabilities(self.backend)
        self.max_rows = self._capabilities.max_rows
        self.forward_calls = 0
        self.prefix_cache: PrefixCache | None = None
        self._rows: dict[int, _Row] = {}  # per row id, in the backend's row order
        self.counts = {"slem_rows": 0, "tli_rows": 0, "short_slots": 0}  # rows drafted by each method, and SLEM
        # slots the draft's text had not filled in its forwards

    def draft_tokens(self, target_ids: list[int]) -> list[int]:
        """The draft's tokens of a text given as target tokens (what it reads for a prompt): for timing it alone."""
        return self.bridge.row(target_ids).draft.ids

    @property
    def backends(self) -> tuple:
        return (self.backend,)

    def set_prefix_cache(self, max_tokens: int) -> None:
        """Keep up to max_tokens tokens of finished rows' prompts' KV (their draft tokens) for later prompts."""
        self.prefix_cache = PrefixCache(max_tokens) if max_tokens and self._capabilities.prefix_caching else None

    # ------------------------------------------------------------------ rows
    def relayout(self, change: RowChange) -> None:
        """Joining rows get their text's draft tokens and an empty KV (or their prompt's longest cached prefix),
        fed lazily by their first proposal; rows that leave park their prompt's KV in the prefix cache (as
        ModelDrafter; keyed by draft tokens). After a failed step nothing is kept."""
        if change.broken:
            self.backend.reset(0)
            self._rows = {}
            return
        before = list(self._rows.values())
        joining = [self._join(text) for text in change.appended]
        fork = self._fork(joining) if joining else None
        # move_rows reads a row's prompt and tokens(): here the draft's side of it (what its KV holds)
        move_rows(self.backend, RowChange(change.keep, tuple(joining)), before, self.prefix_cache, fork,
                  [r.kv.base == 0 for r in before])
        rows = before + joining
        self._rows = {rows[i].text.id: rows[i] for i in change.keep}

    def _join(self, text: RowText) -> _Row:
        bridged = self.bridge.row(text.prompt)
        prompt_length = len(bridged.draft.ids)
        bridged.commit(text.output)
        return _Row(text, bridged, DraftKV(), 0, prompt_length, len(text))  # an empty KV: everything is to feed

    def _fork(self, joining: list[_Row]) -> ModelBackend:
        """A fork of the KV for joining rows, each from its prompt's longest cached prefix where at least 2 of its
        draft tokens are left to feed (as ModelDrafter._fork)."""
        cache = self.prefix_cache
        if cache is not None:
            cache.make_room(self.backend, len(joining), [])
        fork = self.backend.fork(len(joining))
        if cache is None:
            fork.reset(len(joining))
            return fork
        hits = []
        for row in joining:
            ids = row.prompt
            hit = cache.lookup(fork, ids, [], None)
            if hit is not None and len(ids) - hit[1] < 2:
                hit = None
            hits.append(hit)
            cache.record(len(ids), hit[1] if hit else 0)
        if any(hits):
            fork.load_prefixes(hits)
            for row, hit in zip(joining, hits):
                if hit:
                    row.kv.fed(0, row.prompt[: hit[1]])
        return fork

    def observe(self, outcome: DraftOutcome) -> None:
        """Each row's drafts kept go to its method's record ("auto" chooses by it). The rows' new tokens are read
        from their texts when the next proposal needs them (_read), so plain steps cost no tokenizing; the next
        proposal keeps the KV as far as it agrees with the row's draft tokens."""
        if outcome.proposal is None or self.method != "auto":  # a plain step, or no choice to make: nothing read
            return
        for row, kept in zip(self._rows.values(), outcome.kept):
            if row.pending is not None:
                row.methods.record(row.pending[0], kept, row.pending[1])
                row.pending = None

    def _read(self) -> None:
        """Each row's draft side reads what its text gained since it last did."""
        for row in self._rows.values():
            if len(row.text) > row.read:
                row.changed = min(row.changed, row.bridged.commit(row.text.since(row.read)))
                row.read = len(row.text)

    # ------------------------------------------------------------------ the step
    def outlook(self, rows: DraftRows) -> DraftOutlook:
        """Every row can take the step's widest K; behind: the draft tokens its KV lacks, a target token not read yet
        counted as one. The rows are not read here: reading tokenizes the new text (0.47 ms of a 65 ms step on 2
        cores on the real pair), and a policy that decodes plainly asks the outlook on every step; behind only
        prices a catch-up, and K may be any function of the past, so an estimate keeps the output exact."""
        behind = [r.kv.behind(r.bridged.draft.ids, r.changed) + len(r.text) - r.read for r in self._rows.values()]
        return DraftOutlook([rows.widest] * len(behind), behind=behind,
                            probe_behind=[min(n, self.catch_up_window) for n in behind])

    def _limit_catch_up(self) -> None:
        """Rows more than catch_up_window draft tokens behind restart their KV from their last catch_up_window
        tokens (only q and the SLEM drafts change: still exact)."""
        lengths, far = list(self.backend.lengths), False
        for b, row in enumerate(self._rows.values()):
            if row.kv.behind(row.bridged.draft.ids, row.changed) > self.catch_up_window:
                row.kv.restart(row.bridged.draft.ids, self.catch_up_window)
                # the KV holds nothing now: ids that changed before its window are not its concern (left below the
                # window's start, plan() would read them as a change inside the KV and feed the whole text again)
                row.changed = max(row.changed, row.kv.base)
                lengths[b], far = 0, True
        if far:
            self.backend.trim(lengths)

    def _methods(self, k_rows: list[int], greedy_rows: list[bool]) -> list[str]:
        """Each row's method this step, noted for observe(): "auto" drafts a greedy row by SLEM and asks a sampled
        row's record (MethodRecord)."""
        rows = list(self._rows.values())
        if self.method != "auto":
            return [self.method] * len(rows)
        methods = [r.methods.choose() if self.bridge.tli_possible and not greedy else "slem"
                   for r, greedy in zip(rows, greedy_rows)]
        for row, method, n, greedy in zip(rows, methods, k_rows, greedy_rows):
            row.pending = (method, n) if n and not greedy else None
        return methods

    def propose(self, choice: DraftChoice, context: DraftContext) -> Proposal:
        self._read()
        if choice.trial:  # a probe: its draft need not read every token it missed
            self._limit_catch_up()
        calls, rows = self.forward_calls, list(self._rows.values())
        plans = [r.kv.plan(r.bridged.draft.ids, r.changed) for r in rows]
        self.backend.trim([keep for keep, _ in plans])
        for row, (keep, feed) in zip(rows, plans):
            row.kv.fed(keep, feed)
            row.changed = len(row.bridged.draft.ids)
        feeds = [feed for _, feed in plans]
        catch_up, catch_up_s, catch_up_tokens = max(map(len, feeds), default=0), 0.0, 0
        if catch_up > 2 and min(map(len, feeds)) >= 2:
            # Every row is behind (plain steps, or a prompt): feed all but each row's last token in a forward of its
            # own, so that what follows is timed as steady drafting, the cost the policy learns (as ModelDrafter).
            start = time.perf_counter()
            catch_up_tokens = sum(len(f) - 1 for f in feeds)
            ids, valid = pad([f[:-1] for f in feeds], self.backend.device, side="right")
            self.backend.forward(ids, valid, last_only=True)
            self.forward_calls += 1
            feeds = [f[-1:] for f in feeds]
            catch_up_s = time.perf_counter() - start
        cold = self._capabilities.cold_forwards
        colds = cold() if cold is not None else 0
        methods = self._methods(choice.k_rows, context.greedy_rows)
        tokens, q = self._draft(choice.k, context, choice.k_rows, feeds, methods)
        clean = (bool(catch_up_s) or catch_up <= 2) and (cold() if cold is not None else 0) == colds
        return Proposal(tokens, q, catch_up_s, catch_up_tokens if catch_up_s else 0, clean=clean,
                        forward_calls=self.forward_calls - calls)

    def _draft(self, k: int, context: DraftContext, num_drafts, feeds, methods):
        """The drafting forwards: tokens [B, k] (target ids) and q [S, k, V] where a sampled row drafts by TLI."""
        rows = list(self._rows.values())
        tails = [text.tail(2 * WINDOW) for text in context.texts]
        slem = [m == "slem" for m in methods]
        tli_rows = [b for b, m in enumerate(methods) if m == "tli"]
        self.counts["slem_rows"] += sum(slem)
        self.counts["tli_rows"] += len(tli_rows)
        sampled_tli = any(not context.greedy_rows[b] for b in tli_rows)
        drafted = [[] for _ in methods]  # SLEM rows: the draft ids drawn
        proposals = [[] for _ in methods]  # SLEM rows: their target tokens so far
        done = [not s or not n for s, n in zip(slem, num_drafts)]
        chain, probs, token = [], [], None  # TLI: the target tokens [B] and q [S, V] per position
        ids, valid = pad(feeds, self.backend.device, side="right")
        # SLEM: as many forwards as the row's draft tokens per target token say its K tokens take, and one more for
        # its last word (more text may change it), at most MAX_FORWARDS per token; a row drafts no further than its
        # own K asks, whatever the other rows' (its drafts, and so its seeded text, never depend on them). TLI: K.
        need = [min(math.ceil(n * len(r.bridged.draft.ids) / max(1, len(t))) + 1, MAX_FORWARDS * n) if s else n
                for n, r, t, s in zip(num_drafts, rows, context.texts, slem)]
        steps = max([k] + need)
        for i in range(steps):
            logits = self.backend.forward(ids, valid, last_only=True)[:, -1]
            self.forward_calls += 1
            nxt = greedy(logits).tolist()  # SLEM: the draft's own greedy token
            if tli_rows and i < k:
                token, q = self._tli_position(logits, i, context, chain, token)
                chain.append(token)
                if q is not None:
                    probs.append(q)
                to_draft = self.bridge.shared.target_to_draft
                for b, t in zip(tli_rows, token[tli_rows].tolist()):
                    # a target token outside the shared vocabulary (drawn only where the grammar left nothing
                    # shared): the draft reads its first draft token instead; its q stays what it was drawn from
                    nxt[b] = to_draft.get(t) if t in to_draft else (self.bridge.draft.encode(
                        self.bridge.target.pieces[t].decode("utf-8", errors="replace")) or [nxt[b]])[0]
            for b in range(len(methods)):
                if slem[b] and not done[b]:
                    drafted[b].append(nxt[b])
                    ended, last = nxt[b] in self.bridge.draft.eos, i + 1 >= need[b]
                    if ended or last or i + 2 >= num_drafts[b]:  # before that, rarely enough text for its K tokens
                        proposals[b] = rows[b].bridged.proposal(drafted[b], tails[b])
                    done[b] = ended or last or len(proposals[b]) >= num_drafts[b]
            if i + 1 >= steps or (all(done) and i + 1 >= (k if tli_rows else 0)):
                break
            for row, t in zip(rows, nxt):
                row.kv.drafted(t)
            ids, valid = torch.tensor(nxt, dtype=torch.long, device=self.backend.device).unsqueeze(1), None
        return self._assemble(k, context, num_drafts, slem, drafted, proposals, chain, probs, sampled_tli, rows,
                              tails)

    def _tli_position(self, logits, i: int, context: DraftContext, chain, previous):
        """TLI at draft position i: the draft's logits on the shared tokens as target logits, through the rows'
        penalties (along their drafts), grammar mask and warping, as the target's p; greedy rows take the argmax,
        sampled rows draw with their uniforms, coupled rows with their noise. (token [B], q [S, V] or None)."""
        projected = context.penalized(self.bridge.shared.project(logits, self.vocab_size), chain)
        mask = context.draft_mask(i, previous)
        token = greedy(context.masked(projected, mask))
        if context.all_greedy:
            return token, None
        q = context.probs(projected) if mask is None else context.probs(projected, mask)
        sampled = context.sampled_index
        token[sampled] = sample_with_uniforms(q, context.uniforms[sampled, i])
        context.couple_drafts(token, q, i)
        return token, q

    def _assemble(self, k, context, num_drafts, slem, drafted, proposals, chain, probs, sampled_tli, rows, tails):
        out, tli = [], torch.stack(chain, dim=1).tolist() if chain else None
        for b, is_slem in enumerate(slem):
            if not is_slem:
                out.append(tli[b])
                continue
            mine = proposals[b][:k]
            if len(mine) < num_drafts[b]:
                self.counts["short_slots"] += num_drafts[b] - len(mine)
                mine = rows[b].bridged.proposal(drafted[b], tails[b], growing=True)[:k]  # the token still growing
            filler = mine[-1] if mine else tails[b][-1]
            out.append(mine + [filler] * (k - len(mine)))
        tokens = torch.tensor(out, dtype=torch.long)
        if not sampled_tli:
            return tokens, None  # every sampled row's drafts are deterministic: one-hot q, exactly, without a tensor
        q = torch.stack(probs, dim=1)  # [S, k, V]
        sampled = [b for b, g in enumerate(context.greedy_rows) if not g]
        for s, b in enumerate(sampled):
            if slem[b]:  # a SLEM row's q is one-hot at its drafts: the deterministic rule, exactly
                q[s] = torch.nn.functional.one_hot(tokens[b], q.shape[-1]).to(q.dtype)
        return tokens, q


def across_tokenizers(draft, draft_tokenizer, target_tokenizer, method: str = "auto"):
    """(draft, the tokenizer the generator checks against the target's): a draft model whose tokenizer differs from
    the target's becomes a CrossVocabDrafter, and so does suffix+MODEL's MODEL; they propose target tokens, so
    nothing is left to check. Anything else is returned as it is (a mismatch the generator's check then names)."""
    from .model import ModelDrafter
    from .suffix_model import SuffixModelDrafter

    if draft is None or draft_tokenizer is None or target_tokenizer is None:
        return draft, draft_tokenizer
    try:
        check_same_tokenizer(target_tokenizer, draft_tokenizer)
        return draft, draft_tokenizer
    except VocabularyMismatchError:
        pass
    if isinstance(draft, SuffixModelDrafter) and isinstance(draft.model_drafter, ModelDrafter):
        draft.model_drafter = CrossVocabDrafter((draft.model_drafter.backend, draft_tokenizer), target_tokenizer,
                                                method)
        draft.vocab_size, draft.model_tokenizer = draft.model_drafter.vocab_size, None
        return draft, None
    if isinstance(draft, Drafter):
        return draft, draft_tokenizer
    return CrossVocabDrafter((draft, draft_tokenizer), target_tokenizer, method), None
