"""`specdecode bench serve --workload edit`: iterative code editing, speculative against plain decoding on one server.

For each edit prompt (the built-in `edit` set by default: "rename x to count and output the whole function", ...):
turn 1 sends the prompt as a chat user message; turn 2 re-sends that history (the prompt, turn 1's answer) with a
follow-up that makes the model output most of the code again (by default: add a one-line docstring to every
function). Requests are greedy and go one at a time, and each turn is sent twice with identical messages: first with
the server's speculation (num_speculative_tokens "auto", or the K given), then with num_speculative_tokens 0, plain
decoding on the same server and models (our server's extension; another server ignores the field, which the report
shows: its plain sends propose drafts too, or report no statistics at all).

The order is part of the measurement. A server run with `--draft suffix` indexes every earlier prompt and answer, so
the speculative send comes first: sent after the plain one, it would copy the answer it had just seen, a regenerate,
not an edit. For the same reason turn 2 carries the speculative send's answer as history (a chat client re-sends
the answer it got), and a rerun of this workload on the same server measures regenerates: start a fresh server for
each run. The plain send, second, finds the prompt in the prefix cache and its first token sooner; so the speed
compared is the decode rate after the first token, (tokens - 1) / (last token's time - first token's time), and the
TTFT of both is reported apart.

Reported per turn: the median decode rate of each send, the speedup (the median of the per-prompt ratios, and the
ratio of the summed tokens over the summed decode times), the TTFT medians, the server's acceptance statistics, and
whether both sends gave the same text: greedy decoding is exact, so every difference is counted and listed. A prompt
stops at its first failed request (turn 2 needs turn 1's answer). Requests go only to the URL given: 4 per prompt.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from ..errors import OptionError
from ..policy.speculation import AUTO, MAX_K, Speculation
from .prompts import load_builtin
from .serve import ClientSettings, closed_loop, make_client, request_row, totals
from .serve_chat import ChatRecord, chat_request, group_row

DEFAULT_FOLLOW_UP = ("Now add a one-line docstring to every function and output the whole code again, changing "
                     "nothing else.")
MODES = ("speculative", "plain")  # the order each turn is sent in (see the module's docstring)
TURNS = (1, 2)


@dataclass
class EditBenchSettings(ClientSettings):
    prompts: Sequence[str] = ()  # the edit prompts (empty: the built-in edit set)
    nb_prompts: int | None = None  # only the first N of them (None: all)
    follow_up: str = DEFAULT_FOLLOW_UP  # turn 2's user message
    k: int | str = AUTO  # the speculative send's num_speculative_tokens ("auto": the server's own)
    max_tokens: int = 256  # an edit re-emits the code: room for a whole function

    def __post_init__(self):
        if self.temperature != 0:
            raise OptionError("temperature", "temperature must be 0 for the edit workload: it compares the texts of "
                                             f"speculative and plain decoding, equal only when greedy (got "
                                             f"{self.temperature:g})")
        if self.max_tokens < 2:
            raise OptionError("max_tokens", f"max_tokens must be >= 2 (a decode rate needs a token after the "
                                            f"first), got {self.max_tokens}")
        self.k = speculative_k(self.k)
        if self.nb_prompts is not None and self.nb_prompts < 1:
            raise OptionError("nb_prompts", f"nb_prompts must be >= 1, got {self.nb_prompts}")
        if not self.follow_up.strip():
            raise OptionError("follow_up", "follow_up (turn 2's message) is empty")
        prompts = list(self.prompts) or [p.text for p in load_builtin("edit")]
        self.prompts = prompts[:self.nb_prompts]

    @property
    def planned(self) -> int:
        return len(self.prompts) * len(TURNS) * len(MODES)


def speculative_k(value) -> int | str:
    """The speculative send's num_speculative_tokens: "auto" or 1..MAX_K (K = 0 is the plain send, every turn's)."""
    try:
        k = Speculation.parse(value).k
    except ValueError:
        k = -1
    if k is not None and k < 1:
        raise OptionError("k", f"k (the speculative send's num_speculative_tokens) must be 'auto' or an integer "
                               f"1..{MAX_K}, got {value!r}")
    return AUTO if k is None else k


@dataclass
class EditRecord(ChatRecord):
    mode: str = "speculative"  # or "plain"

    @property
    def decode_s(self) -> float | None:
        """Seconds from the first token to the last, when there were two tokens or more."""
        if not self.ok or self.ttft_s is None or self.last_token_s is None or self.output_tokens < 2:
            return None
        span = self.last_token_s - self.ttft_s
        return span if span > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        return None if self.decode_s is None else (self.output_tokens - 1) / self.decode_s


async def send_turn(http, settings: EditBenchSettings, messages: list[dict], index: int, turn: int,
                    t0: float) -> list[EditRecord]:
    """A turn's two sends, speculative then plain, with the same messages; no plain send after a failed one."""
    records = []
    for mode in MODES:
        record = EditRecord(index, time.perf_counter() - t0, conversation=index, turn=turn, mode=mode)
        k = settings.k if mode == "speculative" else 0
        records.append(await chat_request(http, settings, list(messages), record, num_speculative_tokens=k))
        if not record.ok:
            break
    return records


async def edit_prompt(http, settings: EditBenchSettings, index: int, t0: float) -> list[EditRecord]:
    """One prompt's turns in order; it stops at its first failure."""
    messages = [{"role": "user", "content": settings.prompts[index]}]
    records = []
    for turn in TURNS:
        sent = await send_turn(http, settings, messages, index, turn, t0)
        records += sent
        if len(sent) < len(MODES) or not all(r.ok for r in sent):
            break
        # The history a chat client re-sends: the answer it got, the speculative send's.
        messages = [*messages, {"role": "assistant", "content": sent[0].text},
                    {"role": "user", "content": settings.follow_up}]
    return records


async def run_edit(settings: EditBenchSettings) -> tuple[list[EditRecord], float]:
    # One request at a time: a decode rate measured beside other requests would be the batch's, not the method's.
    async with make_client(settings, 1) as http:
        t0 = time.perf_counter()
        end = t0 + settings.duration_s if settings.duration_s else None
        prompts = await closed_loop(lambda i: edit_prompt(http, settings, i, t0), range(len(settings.prompts)), 1,
                                    end)
        return [r for records in prompts for r in records], time.perf_counter() - t0


def pairs(records: list[EditRecord], turn: int) -> list[tuple[EditRecord, EditRecord]]:
    """(speculative, plain) of each prompt whose two sends of this turn both succeeded, in prompt order."""
    sent = {(r.prompt_index, r.mode): r for r in records if r.turn == turn and r.ok}
    prompts = sorted({index for index, _ in sent})
    return [(sent[i, "speculative"], sent[i, "plain"]) for i in prompts if (i, "speculative") in sent
            and (i, "plain") in sent]


def total_rate(records) -> float | None:
    """Tokens after the first over the decode seconds, summed over the requests that have a decode rate."""
    timed = [r for r in records if r.decode_s is not None]
    seconds = sum(r.decode_s for r in timed)
    return sum(r.output_tokens - 1 for r in timed) / seconds if seconds else None


def speculation(records: list[EditRecord]) -> dict:
    """The server's statistics summed over the requests that report them (None when none does)."""
    stats = [r.speculative for r in records if r.ok and r.speculative]
    proposed = sum(s.get("proposed_tokens", 0) for s in stats)
    steps = sum(s.get("verification_steps", 0) for s in stats)
    emitted = sum(s.get("mean_accepted_length", 0.0) * s.get("verification_steps", 0) for s in stats)
    return {"proposed_tokens": proposed if stats else None,
            "acceptance_rate": sum(s.get("accepted_tokens", 0) for s in stats) / proposed if proposed else None,
            "mean_accepted_length": emitted / steps if steps else None}


def mode_row(records: list[EditRecord]) -> dict:
    rates = [r.decode_tok_s for r in records if r.decode_tok_s is not None]
    return {**group_row(records), "decode_tok_s_median": statistics.median(rates) if rates else None,
            "decode_tok_s_total": total_rate(records), **speculation(records)}


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def turn_row(records: list[EditRecord], turn: int) -> dict:
    both = pairs(records, turn)
    rated = [(s, p) for s, p in both if s.decode_tok_s is not None and p.decode_tok_s is not None]
    ratios = [s.decode_tok_s / p.decode_tok_s for s, p in rated]
    spec_total, plain_total = total_rate([s for s, _ in rated]), total_rate([p for _, p in rated])
    mismatches = [{"prompt": s.prompt_index, "first_difference": first_difference(s.text, p.text),
                   "speculative_chars": len(s.text), "plain_chars": len(p.text)} for s, p in both if s.text != p.text]
    return {"turn": turn, **{mode: mode_row([r for r in records if r.turn == turn and r.mode == mode])
                             for mode in MODES},
            "pairs": len(both), "rated_pairs": len(rated),
            "speedup_median": statistics.median(ratios) if ratios else None,
            "speedup_of_totals": spec_total / plain_total if spec_total and plain_total else None,
            "identical": len(both) - len(mismatches), "mismatches": mismatches}


def summarize_edit(records: list[EditRecord], wall_s: float, settings: EditBenchSettings) -> dict:
    config = {k: v for k, v in asdict(settings).items() if k not in ("prompts", "api_key")}
    config.update(num_prompts=len(settings.prompts), order="speculative, then plain, per turn")
    rows = [turn_row(records, turn) for turn in TURNS]
    return {"workload": "edit", "config": config, **totals(records, wall_s),
            "skipped": settings.planned - len(records), "per_turn": rows,
            "mismatches": sum(len(row["mismatches"]) for row in rows),
            "per_request": [{"prompt": r.prompt_index, "turn": r.turn, "mode": r.mode, **request_row(r),
                             "decode_tok_s": r.decode_tok_s, "speculative": r.speculative, "text": r.text}
                            for r in records]}


def bench_edit(settings: EditBenchSettings) -> dict:
    records, wall_s = asyncio.run(run_edit(settings))
    return summarize_edit(records, wall_s, settings)
