"""The multi-turn workload of `specdecode bench` (--prompts multi-turn): conversations replayed turn by turn.

A session is a short conversation that a server would see request after request, the case where copying drafts
(prompt lookup, the suffix drafter's history of earlier requests) can pay:
- edit:       a code file edited again and again: turn 1 asks for an edit and the whole file back, each later turn
              sends the chat history (with the previous answer) and one more edit;
- regenerate: the same request sent again (a chat client's "regenerate"): turn 2's prompt is turn 1's;
- agent:      an agent loop that re-reads a tool's output: each turn sends the history, the same output again and a
              new question.
The built-in set is prompts/multi_turn.jsonl (the kinds alternate, so --nb-prompts 3 takes one of each). A user's
file has the same form, one session a line: {"id", "kind", "context" (optional: text that "{context}" in a turn
stands for, the file or the tool output), "turns": [a user message, or {"regenerate": true}, ...]}.

Later turns hold earlier answers, so the prompts are built before anything is timed, from ONE reference: ours
plain (AutoregressiveGenerator), greedy, each answer stopped at its end-of-generation token or max_new_tokens.
That is the target's own greedy text, the text every exact method must produce at T = 0, so every method then
decodes the very same prompts (token ids) and the bench checks that each gives the reference's answers. The
timed runs replay the prompts in order, sessions one after another, through one generator per method, so a
drafter's history holds the earlier turns and the earlier sessions of the run; the bench empties it before every
run (methods/specdecode.py, fresh_history), so it never holds an answer from an earlier run of the same turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

BUILTIN = "multi-turn"  # its --prompts name; the data is prompts/multi_turn.jsonl
REGENERATE = {"regenerate": True}  # a turn that sends the previous turn's request again


@dataclass(frozen=True)
class Session:
    id: str
    kind: str  # edit, regenerate, agent (a user's file may name others)
    turns: tuple  # each a user message (str) or REGENERATE
    context: str = ""  # what "{context}" stands for in a turn's message

    def message(self, turn: int) -> str:
        """The user message of turn `turn` (0-based); plain replace, not format: code holds braces."""
        return self.turns[turn].replace("{context}", self.context)


@dataclass
class TurnPlan:
    """Every turn's prompt, in the order they are decoded (sessions one after another, turns in order), and the
    reference's answer to it (token ids, end-of-generation token included, and text)."""

    sessions: list[Session]
    prompt_ids: list[list[int]] = field(default_factory=list)
    rows: list[tuple[int, int]] = field(default_factory=list)  # (session index, turn number from 1) of each prompt
    reference_ids: list[list[int]] = field(default_factory=list)
    reference_texts: list[str] = field(default_factory=list)

    @property
    def reference_lengths(self) -> list[int]:
        return [len(ids) for ids in self.reference_ids]

    def turn_of(self, i: int) -> int:
        return self.rows[i][1]

    def kind_of(self, i: int) -> str:
        return self.sessions[self.rows[i][0]].kind

    def session_of(self, i: int) -> str:
        return self.sessions[self.rows[i][0]].id

    def check(self, prompt_ids: list[list[int]], settings) -> None:
        """A bench of these turns decodes exactly their prompts, under check_settings."""
        if prompt_ids != self.prompt_ids:
            raise ValueError("the multi-turn workload's prompts are its turns' (TurnPlan.prompt_ids)")
        check_settings(settings)


def check_settings(settings) -> None:
    """The multi-turn workload compares every method with the reference's greedy answers, one turn at a time
    (BenchSettings, checked before anything is loaded)."""
    if settings.temperatures != [0.0]:
        raise ValueError("the multi-turn workload is greedy (--temperature 0): its later turns hold the reference's "
                         "greedy answers, which every exact method must reproduce")
    if settings.batch_size != 1:
        raise ValueError("the multi-turn workload decodes one turn at a time (--batch-size 1): a turn needs the "
                         "answer before it")


# ----------------------------------------------------------------------------------------------- the sessions
def is_sessions(spec: str | None) -> bool:
    """Whether a --prompts value names multi-turn sessions: the built-in set, or a .jsonl file whose first object
    has "turns"."""
    if spec == BUILTIN:
        return True
    if not spec or not spec.endswith(".jsonl") or not Path(spec).expanduser().is_file():
        return False
    first = next((line for line in Path(spec).expanduser().read_text(encoding="utf-8").splitlines()
                  if line.strip()), "")
    try:
        item = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(item, dict) and "turns" in item


def load_sessions(spec: str, nb: int | None = None) -> list[Session]:
    """The sessions of the built-in set or of a file, the first nb of them (None: all)."""
    if spec == BUILTIN:
        text = resources.files("specdecode.bench.prompts").joinpath("multi_turn.jsonl").read_text(encoding="utf-8")
    else:
        text = Path(spec).expanduser().read_text(encoding="utf-8")
    sessions = parse_sessions(text, spec)
    if nb is not None:
        if nb < 1:
            raise ValueError(f"--nb-prompts must be >= 1 (sessions of {spec}), got {nb}")
        sessions = sessions[:nb]
    return sessions


def parse_sessions(text: str, name: str) -> list[Session]:
    """Sessions from JSON lines; errors name the file and the line."""
    sessions = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            sessions.append(_session(line, f"{name} line {lineno}", f"{Path(name).stem}-{len(sessions)}"))
    if not sessions:
        raise ValueError(f"{name} holds no sessions (JSON lines of {{\"turns\": [...]}})")
    return sessions


def _session(line: str, where: str, default_id: str) -> Session:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    turns = item.get("turns") if isinstance(item, dict) else None
    if not isinstance(turns, list) or not turns:
        raise ValueError(f'{where}: expected an object with a non-empty list "turns"')
    for i, turn in enumerate(turns):
        if turn == REGENERATE and i == 0:
            raise ValueError(f"{where}: the first turn cannot be a regenerate (there is no request to send again)")
        if turn != REGENERATE and not (isinstance(turn, str) and turn.strip()):
            raise ValueError(f'{where}: turn {i + 1} must be a non-empty user message or {{"regenerate": true}}')
    context = item.get("context", "")
    if not isinstance(context, str):
        raise ValueError(f'{where}: "context" must be a string')
    return Session(str(item.get("id", default_id)), str(item.get("kind", "session")),
                   tuple(REGENERATE if t == REGENERATE else t for t in turns), context)


# ----------------------------------------------------------------------------------------------- the turns
def encode_turn(tokenizer, messages: list[dict], chat: bool) -> list[int]:
    """A conversation's token ids ready for the assistant: through the chat template (chat=True, when the
    tokenizer has one), else as a plain transcript."""
    from ..text.chat import encode_chat, has_chat_template

    if chat and has_chat_template(tokenizer):
        return encode_chat(tokenizer, messages)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
    return list(tokenizer(text)["input_ids"])


def build_turns(generator, sessions: list[Session], max_new_tokens: int, chat: bool = True,
                progress=None) -> TurnPlan:
    """Every turn's prompt, built from the reference's answers: generator (ours plain) decodes each turn greedily
    until its end of generation or max_new_tokens, and its answer joins the history the next turn sends."""
    from .methods.specdecode_plain import run_ours

    plan = TurnPlan(list(sessions))
    for s, session in enumerate(sessions):
        history, request = [], []  # the conversation so far; the messages of the last request
        for t, turn in enumerate(session.turns):
            if turn != REGENERATE:  # a regenerate sends the last request again, the history as it was then
                request = history + [{"role": "user", "content": session.message(t)}]
            ids = encode_turn(generator.tokenizer, request, chat)
            answer = run_ours(generator, [[ids]], max_new_tokens, 0.0, 0, 1.0, seed=0, until_eos=True)
            plan.prompt_ids.append(ids)
            plan.rows.append((s, t + 1))
            plan.reference_ids.append(answer.token_ids[0])
            plan.reference_texts.append(answer.texts[0])
            history = request + [{"role": "assistant", "content": answer.texts[0]}]
            if progress is not None:
                progress(f"reference {session.id} turn {t + 1}")
    return plan
