"""The suffix drafter's CPU cost per decode step on novel text (issue 33): observe + outlook for one row, as the
session calls them when it decodes one token a step (the policy declines the drafts).

    python scripts/suffix_step_cost.py [--row README.md] [--context 2000] [--history 4000] [--steps 2000] [--k 8]

Text: the project's own files tokenized with the Qwen2.5-Coder tokenizer (a byte-level stand-in where it is not
cached). The history holds --history tokens of docs/*.md and then src/**/*.py (not the row's file), in documents of
1500 tokens; the row's prompt is --context tokens of --row and it then decodes the text that follows, token by
token. Prints the median and mean microseconds per step of each call and a digest of every draft (tokens, score,
match, ends, docs, limit, rows): run it on two checkouts (PYTHONPATH=.../src) to compare their cost, interleaved,
and check that their drafts are the same.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = Path.home() / ".cache/specdecode/tokenizers/qwen2.5-coder-1.5b-instruct/tokenizer.json"


def tokenize(paths: list[Path]) -> list[list[int]]:
    texts = [p.read_text(encoding="utf-8") for p in paths]
    if TOKENIZER.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(TOKENIZER))
        return [tok.encode(t, add_special_tokens=False).ids for t in texts]
    return [list(t.encode("utf-8")) for t in texts]


def run(row: str, context: int, history_tokens: int, steps: int, k: int) -> tuple[list[int], list[int], str]:
    from specdecode import SuffixDrafter, SuffixHistory
    from specdecode.drafters import DraftOutcome, DraftRows, RowChange, RowText

    files = [*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]
    row_text, *others = tokenize([ROOT / row] + [f for f in files if f.resolve() != (ROOT / row).resolve()])
    history = SuffixHistory()
    added = 0
    for doc in others:
        for start in range(0, len(doc), 1500):  # documents of a realistic size
            if added >= history_tokens:
                break
            history.add(doc[start:start + 1500])
            added += len(doc[start:start + 1500])
    drafter = SuffixDrafter(history)
    stream = row_text * (1 + (context + steps) // len(row_text))
    text = RowText(0, stream[:context], [])
    drafter.relayout(RowChange((0,), (text,)))
    digest = hashlib.sha256()
    update_ns, draft_ns = [], []
    for token in stream[context:context + steps]:
        t0 = time.perf_counter_ns()
        drafter.observe(DraftOutcome([text], [[token]], [0]))
        text.output.append(token)
        t1 = time.perf_counter_ns()
        outlook = drafter.outlook(DraftRows([text], [k], k))
        t2 = time.perf_counter_ns()
        update_ns.append(t1 - t0)
        draft_ns.append(t2 - t1)
        d = outlook.plan[1][0]  # the row's draft (suffix.py's plan)
        digest.update(repr((d.tokens, d.score, d.match, d.ends, sorted(d.docs), d.limit, d.rows)).encode())
    return update_ns, draft_ns, digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", default="README.md", help="the row's text, a path under the repository")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--history", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import specdecode

    print(f"specdecode from {Path(specdecode.__file__).parent}")
    for _ in range(args.repeat):
        update_ns, draft_ns, digest = run(args.row, args.context, args.history, args.steps, args.k)
        total = [u + d for u, d in zip(update_ns, draft_ns)]
        print(f"observe {statistics.median(update_ns) / 1e3:6.1f} us (mean {statistics.mean(update_ns) / 1e3:6.1f})"
              f"  outlook {statistics.median(draft_ns) / 1e3:6.1f} us (mean {statistics.mean(draft_ns) / 1e3:6.1f})"
              f"  total {statistics.median(total) / 1e3:6.1f} us (mean {statistics.mean(total) / 1e3:6.1f})"
              f"  drafts {digest}")


if __name__ == "__main__":
    main()
