"""Token trees (token_tree.py): the multi-candidate rule exactly (its output law computed from the rule, and sampled),
greedy walks, the transformers backend's tree forward against plain forwards, the suffix drafter's trees, and
decoding with trees on and off: greedy token for token, sampled against the target's enumerated joint."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import tiny_qwen
from drafting import Driver, asked
from reference import assert_first_tokens_follow_target, assert_matches, exact_joint
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, SuffixDrafter, SuffixHistory
from specdecode.backends.hf import HFBackend
from specdecode.drafters.suffix_drafts import Draft, speculate_tree
from specdecode.drafters.suffix_index import SEP
from specdecode.exact.token_tree import (ancestors_mask, chain, children, depths, verify_tree_greedy,
                                   verify_tree_sampled)

V = 5


# ---------------------------------------------------------------------------------------------- the structure
def test_depths_children_and_the_attention_of_each_position():
    parents = [-1, -1, 0, 2, 1]
    assert depths(parents) == [1, 1, 2, 3, 2]
    assert children(parents) == [[0, 1], [2], [4], [3], [], []]
    mask = ancestors_mask(parents)
    assert mask[4].tolist() == [True, True, False, True, True, False]  # node 3: root, 0, 2, itself
    assert mask[5].tolist() == [True, False, True, False, False, True]  # node 4: root, 1, itself
    assert ancestors_mask(chain(3)).equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="after its parent"):
        depths([-1, 2, 0])


# ---------------------------------------------------------------------------------------------- the rule
def _distributions(seed: int, positions: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(positions, V, generator=g, dtype=torch.float64) ** 3
    p[:, 3] = 0.0  # a token of probability 0 (drafted below: it can never be kept)
    return p / p.sum(-1, keepdim=True)


def _law(tokens, parents, probs) -> dict[tuple, float]:
    """The output law of the multi-candidate rule, from its definition (accept candidate i with its residual
    probability, then the final residual), as a map from emitted sequences to probabilities."""
    kids = children(parents)
    law: dict[tuple, float] = {}

    def walk(at: int, prefix: tuple, mass: float) -> None:
        p = probs[at].clone()
        for c in kids[at]:
            x = tokens[c]
            accept = float(p[x])
            walk(c + 1, prefix + (x,), mass * accept)
            mass *= 1 - accept
            p[x] = 0.0
            if p.sum() > 0:
                p = p / p.sum()
        for t in range(V):
            if mass * p[t] > 0:  # (an unreachable duplicate's subtree adds nothing)
                law[prefix + (t,)] = law.get(prefix + (t,), 0.0) + mass * float(p[t])

    walk(0, (), 1.0)
    return law


TREES = [  # (tokens, parents): a chain, a fan, a deep tree with a drafted zero-probability token, duplicates
    ([1, 2, 0], chain(3)),
    ([1, 2, 0, 4], [-1, -1, -1, -1]),
    ([1, 2, 0, 4, 3, 2], [-1, -1, 0, 0, 1, 2]),
    ([1, 1, 2], [-1, -1, 1]),
]


@pytest.mark.parametrize("tokens, parents", TREES)
def test_the_rule_emits_exactly_the_targets_joint(tokens, parents):
    """Every emitted sequence has the probability that sampling the target token by token gives it: the target's
    distribution at each tree position is the distribution after that node's tokens."""
    probs = _distributions(len(tokens), len(tokens) + 1)
    law = _law(tokens, parents, probs)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    prefix_of, position = {-1: ()}, {(): 0}  # a duplicate candidate's subtree is unreachable: the first one counts
    for i, parent in enumerate(parents):
        prefix_of[i] = prefix_of[parent] + (tokens[i],)
        position.setdefault(prefix_of[i], i + 1)
    for seq, mass in law.items():
        expected = 1.0
        for j, t in enumerate(seq):
            expected *= float(probs[position[seq[:j]], t])
        assert mass == pytest.approx(expected, abs=1e-12), seq


@pytest.mark.parametrize("tokens, parents", TREES[1:3])
def test_the_implementation_samples_the_rules_law(tokens, parents):
    probs = _distributions(len(tokens), len(tokens) + 1)
    law = _law(tokens, parents, probs)
    index = {s: i for i, s in enumerate(law)}
    counts = torch.zeros(len(law) + 1)
    u = torch.rand(20000, len(tokens) + 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for row in u:
        path, last = verify_tree_sampled(tokens, parents, probs, row)
        assert all(parents[b] == a for a, b in zip([-1] + path, path))  # a path down the tree
        counts[index.get(tuple(tokens[i] for i in path) + (last,), len(law))] += 1
    assert_matches(counts, list(law.values()) + [0.0], min_p=1e-4)


def test_greedy_follows_the_argmax_down_the_tree():
    tokens, parents = [1, 2, 0, 4], [-1, -1, 1, 1]
    scores = torch.full((5, V), -1.0)
    scores[0, 2] = scores[2, 4] = scores[4, 3] = 1.0  # root -> 2 (node 1) -> 4 (node 3) -> then 3
    assert verify_tree_greedy(tokens, parents, scores) == ([1, 3], 3)
    scores[2, 4], scores[2, 1] = -1.0, 1.0  # node 1's argmax is no child: stop there with it
    assert verify_tree_greedy(tokens, parents, scores) == ([1], 1)


# ---------------------------------------------------------------------------------------------- the backend
@torch.no_grad()
def test_a_tree_forward_scores_every_branch_as_a_plain_forward_and_keeps_only_the_path(tiny_pair):
    model = tiny_pair[0]
    backend = HFBackend(model)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    backend.reset(2)
    backend.forward(torch.tensor([prompts[0], [0, 0, 0] + prompts[1]]),
                    torch.tensor([[True] * 6, [False] * 3 + [True] * 3]), last_only=True)  # left-padded
    tree = [[-1, -1, 0, 2], [-1, 0, 0, -1]]
    nodes = [[20, 21, 22, 23], [30, 31, 32, 33]]
    last = [prompts[0][-1] + 1, prompts[1][-1] + 1]
    logits = backend.forward_tree(torch.tensor([[a] + n for a, n in zip(last, nodes)]), tree)
    for b in range(2):
        context = prompts[b] + [last[b]]
        for i, parent in enumerate(tree[b]):
            branch, at = [nodes[b][i]], parent
            while at >= 0:
                branch.insert(0, nodes[b][at])
                at = tree[b][at]
            plain = model(torch.tensor([context + branch])).logits[0, -1]
            assert torch.allclose(logits[b, i + 1], plain, atol=1e-4), (b, i)
    backend.keep_paths([[0, 2], []])
    assert backend.lengths == [6 + 3, 3 + 1]
    after = backend.forward(torch.tensor([[40], [41]]))
    for b, kept in enumerate([[20, 22], []]):
        plain = model(torch.tensor([prompts[b] + [last[b]] + kept + [40 + b]])).logits[0, -1]
        assert torch.allclose(after[b, 0], plain, atol=1e-4)


# ---------------------------------------------------------------------------------------------- the drafter
def test_the_suffix_tree_is_grown_best_first_and_is_the_chain_at_width_one():
    # continuations after the match: 7 8 9 (three times), 7 5 (twice), 6 (once), one that ended there (SEP)
    rows = [[7, 8, 9], [7, 8, 9], [7, 5, SEP], [7, 8, 9], [6, SEP, SEP], [7, 5, SEP], [SEP, SEP, SEP]]
    draft = Draft(rows=rows, limit=3)
    assert speculate_tree(draft, 8, 0.1, 1) == ([7, 8, 9], [-1, 0, 1], pytest.approx(11 / 7))
    # 7 (5/7), 7 8 (3/7), 7 8 9 (3/7), 7 5 (2/7), 6 (1/7)
    assert speculate_tree(draft, 8, 0.1, 3) == ([7, 8, 9, 5, 6], [-1, 0, 1, 0, -1], pytest.approx(14 / 7))
    assert speculate_tree(draft, 3, 0.1, 3)[:2] == ([7, 8, 9], [-1, 0, 1])  # the best 3 nodes
    assert speculate_tree(draft, 8, 0.2, 3)[:2] == ([7, 8, 9, 5], [-1, 0, 1, 0])  # 6 is below min_prob
    # at most 2 leaves: 6 (a third leaf) is passed over; a child of a leaf would have replaced it
    assert speculate_tree(draft, 8, 0.1, 3, max_leaves=2)[:2] == ([7, 8, 9, 5], [-1, 0, 1, 0])
    assert speculate_tree(draft, 8, 0.1, 3, max_leaves=1)[:2] == ([7, 8, 9], [-1, 0, 1])


def test_the_drafter_proposes_trees_only_when_the_session_can_verify_them():
    history = SuffixHistory()
    drafter = Driver(SuffixDrafter(history, tree_width=2))
    for tail in ([4, 5], [4, 6], [4, 5]):
        drafter.join([[1, 2, 3] + tail])
        drafter.keep([])
    drafter.join([[1, 2, 3]])
    assert drafter.propose(3, [3]).parents is None
    proposal = drafter.propose(3, drafter.max_drafts(3, trees=True))
    assert proposal.tokens.tolist() == [[4, 5, 6]] and proposal.parents == [[-1, 0, 0]]
    with pytest.raises(ValueError, match="tree_width"):
        SuffixDrafter(tree_width=0)


# ---------------------------------------------------------------------------------------------- decoding
@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["def quicksort(arr):\n    if len(arr) <= 1:\n        return arr", "The quick brown fox"]
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_output_is_the_targets_own_with_trees(tiny_pair, prompts, k):
    target = tiny_pair[0]
    plain = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=40, temperature=0.0, ignore_eos=True)
    history = SuffixHistory()
    history.add(prompts[0] + plain.token_ids[0][:20] + [7, 7, 7])  # a rival continuation: a branch point
    gen = SpeculativeGenerator(target, SuffixDrafter(history, tree_width=3), num_speculative_tokens=k)
    for _ in range(2):
        result = gen.generate(prompts, max_new_tokens=40, temperature=0.0, ignore_eos=True, return_logprobs=2)
        assert result.token_ids == plain.token_ids
    reference = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=40, temperature=0.0,
                                                         ignore_eos=True, return_logprobs=2)
    for mine, theirs in zip(result.logprobs, reference.logprobs):
        assert mine == pytest.approx(theirs, abs=1e-4)


VOCAB = 16
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def small_target():
    return tiny_qwen(VOCAB, seed=10, layers=2, hidden=32)


@pytest.mark.parametrize("k, seed", [(3, 3), ("auto", 7)])
def test_sampled_output_with_trees_follows_the_target_exactly(small_target, k, seed):
    """A history of earlier samples gives branching continuations; the first three tokens' joint against the
    target's, enumerated (seeded + auto: Gumbel-coupled rows walk the tree with their positions' noise)."""
    earlier = AutoregressiveGenerator(small_target).generate([PROMPT] * 20, max_new_tokens=6, temperature=0.8,
                                                             seed=1, ignore_eos=True)
    history = SuffixHistory()
    for row in earlier.token_ids:
        history.add(PROMPT + row)
    drafter = SuffixDrafter(history, tree_width=3, min_prob=0.05)
    gen = SpeculativeGenerator(small_target, drafter, num_speculative_tokens=k)
    result = gen.generate([PROMPT] * 3000, max_new_tokens=4, temperature=0.8, seed=seed, ignore_eos=True)
    assert result.stats.proposed_tokens > 0
    assert_first_tokens_follow_target(small_target, PROMPT, result.token_ids, temperature=0.8)


def test_trees_were_used_and_branches_were_kept(small_target):
    """Greedy, with a branch point where the more frequent continuation is wrong: the chain drafts only that, the
    tree also the right one below it, which is kept (fewer target forwards, the same tokens)."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # no repeats: the drafts come from the history
    greedy = AutoregressiveGenerator(small_target).generate([prompt], max_new_tokens=12, temperature=0.0,
                                                            ignore_eos=True).token_ids[0]
    history = SuffixHistory()
    for _ in range(3):  # the prefill emits greedy[0]; the first drafted position is the branch point
        history.add(prompt + greedy[:1] + [(greedy[1] + 1) % VOCAB])
    history.add(prompt + greedy)
    runs = {}
    for width in (1, 2):
        gen = SpeculativeGenerator(small_target, SuffixDrafter(history, tree_width=width), num_speculative_tokens=5)
        runs[width] = gen.generate([prompt], max_new_tokens=12, temperature=0.0, ignore_eos=True)
        assert runs[width].token_ids[0] == greedy
    assert runs[2].stats.target_forward_calls < runs[1].stats.target_forward_calls
    assert runs[1].provenance[0][1] == "resampled"  # the chain proposed only the frequent, wrong token
    assert runs[2].provenance[0][1:6] == ["accepted"] * 4 + ["bonus"]  # the tree's second branch, to its leaf


def test_the_exact_joint_helper_sees_every_sequence():  # guards the reference the tests above lean on
    model = tiny_qwen(4, seed=3, layers=1, hidden=16)
    joint = exact_joint(model, [1, 2], 2, lambda x: x)
    assert set(joint) == set(itertools.product(range(4), repeat=2))
    assert sum(joint.values()) == pytest.approx(1.0)


def test_the_cli_takes_a_tree_width_and_keeps_greedy_output(tiny_model_dirs):
    import json

    from typer.testing import CliRunner

    from specdecode.cli.app import app

    def run(*args):
        return CliRunner().invoke(app, ["generate", "def quicksort(arr):\n    return quicksort(arr)", "-n", "16",
                                        "--ignore-eos", "--json", "--target", tiny_model_dirs["target"], *args])

    trees, plain = run("--draft", "suffix", "-k", "3", "--tree-width", "3"), run("--draft", "none")
    assert trees.exit_code == 0 and plain.exit_code == 0, trees.output
    assert json.loads(trees.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    bad = run("--draft", "suffix", "--tree-width", "0")
    assert bad.exit_code != 0 and "--tree-width" in bad.output


def _llama(path, rows=1, trees=True):
    from specdecode.backends.llamacpp import EXACT_TOKENS_PER_FORWARD, LlamaCppBackend

    # the exact mode: forwards of at most 3 tokens, which llama.cpp computes as it decodes token by token
    return LlamaCppBackend(path, n_ctx=1024, max_rows=rows, n_threads=1, token_trees=trees,
                           max_tokens_per_forward=EXACT_TOKENS_PER_FORWARD)


def test_llamacpp_scores_a_tree_as_plain_forwards_and_keeps_any_path_bit_for_bit(smol_path):
    """Two rows, each node's logits against a forward of its own branch; after keeping a path that lies on a
    spare sequence's branch (row 0) and none (row 1), the next token's logits as if only that path had been fed."""
    target, reference = _llama(smol_path, rows=2), _llama(smol_path, trees=False)
    prompts = [list(range(1000, 1012)), list(range(2000, 2009))]
    target.reset(2)
    target.forward(torch.tensor([prompts[0], [0] * 3 + prompts[1]]),
                   torch.tensor([[True] * 12, [False] * 3 + [True] * 9]), last_only=True)
    tree, nodes, last = [[-1, -1, 0, 2], [-1, 0, 0, -1]], [[20, 21, 22, 23], [30, 31, 32, 33]], [5, 6]

    def plain(tokens):
        reference.reset(1)
        return reference.forward(torch.tensor([tokens]))[0, -1]

    logits = target.forward_tree(torch.tensor([[a] + n for a, n in zip(last, nodes)]), tree)
    for b in range(2):
        assert torch.equal(logits[b, 0], plain(prompts[b] + [last[b]]))
        for i in range(4):
            branch, at = [], i
            while at >= 0:
                branch.insert(0, nodes[b][at])
                at = tree[b][at]
            assert torch.equal(logits[b, i + 1], plain(prompts[b] + [last[b]] + branch)), (b, i)
    target.keep_paths([[1], []])
    assert target.lengths == [12 + 2, 9 + 1]
    after = target.forward(torch.tensor([[40], [41]]))
    assert torch.equal(after[0, 0], plain(prompts[0] + [5, 21, 40]))
    assert torch.equal(after[1, 0], plain(prompts[1] + [6, 41]))
    target.select_rows([])
    lib, memory = target._shared.lib, target._shared.memory
    assert not target._shared.holds  # the rows' held branches went with them
    assert all(lib.llama_memory_seq_pos_max(memory, s) == -1 for s in target._shared.tree_seqs)


def test_llamacpp_greedy_with_trees_is_llamacpps_own_token_for_token(smol_path):
    """A branch point whose more frequent continuation is wrong: trees keep the other branch (fewer forwards), and
    the exact mode's tokens and logprobs are plain decoding's, bit for bit. (With several rows in the shared KV
    stream a row's token can land between another row's cells and round differently: docs/CORRECTNESS.md.)"""
    target = _llama(smol_path)
    prompt = list(range(1000, 1040))
    plain = AutoregressiveGenerator(target).generate([prompt], max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                                     return_logprobs=0)
    greedy = plain.token_ids[0]
    history = SuffixHistory()
    for _ in range(3):
        history.add(prompt + greedy[:1] + [(greedy[1] + 7) % 40000])
    history.add(prompt + greedy)
    runs = {}
    for width in (1, 3):
        gen = SpeculativeGenerator(target, SuffixDrafter(history, tree_width=width), num_speculative_tokens=5)
        runs[width] = gen.generate([prompt], max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                   return_logprobs=0)
        assert runs[width].token_ids[0] == greedy
        assert runs[width].logprobs[0] == plain.logprobs[0]
    assert runs[3].stats.target_forward_calls < runs[1].stats.target_forward_calls


def test_padding_continues_the_last_node_and_adds_no_leaf():
    from specdecode.exact.token_tree import padded

    def leaves(parents):
        kids = children(parents)
        return sum(1 for i in range(len(parents)) if not kids[i + 1])

    assert padded([], 3) == chain(3)  # a row with no drafts: one chain, one leaf (its own sequence)
    for tree in ([-1], [-1, -1], [-1, 0, -1, 1], [-1, 0, 0, 1]):
        assert padded(tree, 7)[:len(tree)] == tree and len(padded(tree, 7)) == 7
        assert leaves(padded(tree, 7)) == leaves(tree)
    assert padded([-1, 0], 2) == [-1, 0]


def test_llamacpp_trees_of_a_batch_whose_rows_have_few_real_nodes_fit_its_spare_sequences(smol_path):
    """One row drafts a 24-token copy, eleven have nothing to copy: their drafts are padding (never verified). Padding
    hung below the root was a leaf per node, a spare sequence each: 11 x 23 > the 243 spare sequences of a 12-row
    context, and the first step failed ("needs more spare sequences"). Padding now continues the row's last branch.
    Row 0 is plain decoding's text up to where a near-tie flips: in llama.cpp's default mode a forward of 4+ tokens
    goes through other kernels than a one-token step, by CPU (docs/CORRECTNESS.md), and on one CI machine the
    token after the copy's end parted (a flip within 1 nat of plain decoding's choice)."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    rows = 12
    target = LlamaCppBackend(smol_path, n_ctx=2048, max_rows=rows, n_threads=1, token_trees=True)
    assert target.tree_leaves == 20  # (244 spare - 1 free - 12 held) // 12 rows, + the row's own sequence
    loop = [1000 + i for i in range(30)]
    prompts = [loop * 2 + loop[:4]] + [[2000 + 40 * r + i for i in range(6)] for r in range(1, rows)]
    gen = SpeculativeGenerator(target, SuffixDrafter(SuffixHistory(0), tree_width=2), num_speculative_tokens=24)
    result = gen.generate(prompts, max_new_tokens=26, temperature=0.0, ignore_eos=True)
    plain = AutoregressiveGenerator(target).generate(prompts[:1], max_new_tokens=26, temperature=0.0,
                                                     ignore_eos=True, return_logprobs=5)
    ours, theirs = result.token_ids[0], plain.token_ids[0]
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if parted is not None:
        assert parted >= 14, (ours, theirs)  # the copied loop, where SmolLM is sure, is plain decoding's
        top = dict(plain.top_logprobs[0][parted])
        assert ours[parted] in top and top[ours[parted]] > plain.logprobs[0][parted] - 1.0, (parted, top)
    assert [len(t) for t in result.token_ids] == [26] * rows
    assert result.stats.accepted_tokens >= 14  # SmolLM copies the loop 14 tokens long: the row's drafts were kept


def test_llamacpp_rows_with_bushy_trees_keep_to_the_leaves_that_always_fit(smol_path):
    """40 rows whose histories fork 8 ways right after their first token: 8 leaves each, 40 x 7 spare sequences
    > the 216 of a 40-row context. Each row's tree keeps to tree_leaves (5) whatever the other rows' trees."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    rows = 40
    target = LlamaCppBackend(smol_path, n_ctx=128, max_rows=rows, n_threads=1, token_trees=True)
    assert target.tree_leaves == 1 + (216 - 1 - rows) // rows == 5
    prompt = [3000 + i for i in range(8)]
    first = AutoregressiveGenerator(target).generate([prompt], max_new_tokens=1, temperature=0.0).token_ids[0]
    history = SuffixHistory()
    for branch in range(8):
        history.add(prompt + first + [4000 + 10 * branch + i for i in range(4)])
    drafter = SuffixDrafter(history, tree_width=8)
    seen = asked(drafter)
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=8)
    result = gen.generate([prompt] * rows, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    assert [len(t) for t in result.token_ids] == [10] * rows and result.token_ids[0][:1] == first
    assert result.stats.proposed_tokens >= 8 * rows  # every row drafted its 8-node tree at the first step
    assert seen and all(r.max_leaves == 5 for r in seen)


def test_the_pair_builds_llamacpp_for_trees_only_when_asked(smol_path):
    from specdecode.pairing.pair import ModelOptions, load_target

    def target(**options):
        return load_target(ModelOptions(target=smol_path, threads=1, **options)).model

    assert target(draft="suffix", tree_width=3).supports_trees
    assert not target(draft="suffix").supports_trees
    assert not target(draft="none", tree_width=3).supports_trees


def test_llamacpp_verifies_chains_without_token_trees(smol_path):
    """Built without token_trees each row keeps a KV stream of its own (kv_unified off), where a token cannot
    belong to several sequences: the session asks for chains, and the output is still llama.cpp's greedy text."""
    target = _llama(smol_path, trees=False)
    assert not target.supports_trees
    prompt = list(range(1000, 1040)) * 2
    plain = AutoregressiveGenerator(target).generate([prompt], max_new_tokens=24, temperature=0.0, ignore_eos=True)
    drafter = SuffixDrafter(tree_width=3)
    seen = asked(drafter)
    got = SpeculativeGenerator(target, drafter, num_speculative_tokens=3).generate(
        [prompt], max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert got.token_ids == plain.token_ids and got.stats.proposed_tokens > 0
    assert seen and not any(r.trees for r in seen)


# ---------------------------------------------------------------------------------------------- model drafts
def _model_drafter(draft, width):
    from specdecode.backends import as_backend
    from specdecode.drafters import ModelDrafter

    return ModelDrafter(as_backend(draft), tree_width=width)


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_model_draft_trees_keep_greedy_output(tiny_pair, prompts, k):
    target, draft = tiny_pair
    plain = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=32, temperature=0.0, ignore_eos=True)
    drafter = _model_drafter(draft, 3)
    result = SpeculativeGenerator(target, drafter, num_speculative_tokens=k).generate(
        prompts, max_new_tokens=32, temperature=0.0, ignore_eos=True)
    assert result.token_ids == plain.token_ids
    if k == 4:
        assert result.stats.proposed_tokens > 0 and result.stats.draft_forward_calls > 0


@pytest.mark.parametrize("k, method, seed", [(3, "leviathan", 3), (4, "chen", 5), ("auto", "leviathan", 7)])
def test_model_draft_trees_sample_the_targets_joint(small_target, k, method, seed):
    """A draft model's chain with siblings of its first token, all deterministic candidates: the first three
    tokens' joint against the target's, enumerated (the method applies to chains; trees have one rule)."""
    draft = tiny_qwen(VOCAB, seed=11, layers=1, hidden=32)
    drafter = _model_drafter(draft, 2)
    gen = SpeculativeGenerator(small_target, drafter, num_speculative_tokens=k, method=method)
    result = gen.generate([PROMPT] * 3000, max_new_tokens=4, temperature=0.8, seed=seed, ignore_eos=True)
    if k != "auto":  # the policy may decode plainly where drafts do not pay
        assert result.stats.proposed_tokens > 0
    assert_first_tokens_follow_target(small_target, PROMPT, result.token_ids, temperature=0.8)


def test_a_model_draft_tree_is_its_chain_and_the_next_best_first_tokens(tiny_pair):
    target, draft = tiny_pair
    drafter = Driver(_model_drafter(draft, 3))
    drafter.join([[5, 6, 7, 8]])
    proposal = drafter.propose(4, [4], trees=True)
    assert proposal.parents == [[-1, 0, -1, -1]] and proposal.q is None
    first = draft(torch.tensor([[5, 6, 7, 8]])).logits[0, -1]
    assert proposal.tokens[0, [0, 2, 3]].tolist() == torch.topk(first, 3).indices.tolist()
    with pytest.raises(ValueError, match="tree_width"):
        _model_drafter(draft, 0)
