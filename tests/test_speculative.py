"""Speculative decoding inside `generate` (the loop `SpeculativeRunner` captures as one graph per cycle, run eagerly
here): token for token stock greedy output whatever the draft proposes (CPU, fp32), the reference loop's acceptance
with a real draft, stops, later turns, sampled answers distributed as the target's, and the plain loop (with its
notice) wherever it does not apply."""

import pytest
import torch

from conftest import chat, new_pair
from qwen3vl_static.compat_qwen3vl_graph import CACHE_KWARG, returned_cache
from qwen3vl_static.draft_qwen3vl_graph import speculative_greedy
from qwen3vl_static.presets import TINY_VOCAB, tiny_inputs
from test_draft import PROMPTS, save_draft, tiny_draft_tensors
from test_multi_turn import next_turn
from test_sampling_distribution import SIGNIFICANCE, chi_square_quantile


@pytest.fixture(scope="module")
def pair():
    return new_pair()


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_draft(tmp_path_factory.mktemp("drafts") / "shared", tensors=tiny_draft_tensors(embed=False))


class ScriptedDraft:
    """A draft for the loop in the graphs that proposes a known continuation `expected` `(1, n)`, wrong at index
    `miss` of each chain: its chain reads the slot it starts at (a device tensor), as the real one's steps do."""

    layer_ids = (0, 1, 2)

    def __init__(self, expected, miss=None):
        self.expected = torch.cat([expected[0], expected.new_zeros(64)])  # past the end: anything
        self.miss = miss

    def prepare(self, ops, slots, rotary_emb, rotary_components=None):
        pass

    def rotary_tables(self, positions, slots):
        assert positions.shape == (3, slots.shape[0], 1)
        return (positions[0, :, 0],)

    def extend(self, tokens, features, rotary, slots, kv_len):
        """Its hidden state at a slot: the slot itself (the chain reads it from the row the cycle keeps)."""
        n = tokens.shape[0]
        assert features.shape[0] == n and features.shape[1] % 3 == 0 and rotary[0].shape == slots.shape == (n,)
        return slots[:, None], slots[:, None]

    def chain(self, hidden, normed, rotary, slots, kv_len, out):
        count = out.shape[0]
        assert hidden.shape == normed.shape == (1, 1) and rotary[0].shape == slots.shape == (count - 1,)
        proposals = self.expected[hidden[0, 0] + 2 + torch.arange(count, device=out.device)]
        if self.miss is not None:
            proposals[self.miss] = (proposals[self.miss] + 1) % TINY_VOCAB
        return out.copy_(proposals)

    def extend_and_chain(self, tokens, features, positions, slots, chain_position, count, kv_len):
        hidden, normed = self.extend(tokens, features, self.rotary_tables(positions, slots), slots, kv_len)
        chained = slots[-1] + torch.arange(1, count, device=slots.device)
        out = torch.empty(count, dtype=torch.long, device=slots.device)
        return self.chain(hidden[-1:], normed[-1:], (chained,), chained, kv_len, out)


def expected_kept(new: int, k: int, kept: int) -> list:
    """Tokens per cycle when every cycle keeps `kept` proposals, after the prefill's token, up to `new` tokens."""
    counts, left = [], new - 1
    while left > 0:
        counts.append(min(kept + 1, left))
        left -= counts[-1]
    return counts


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generate_with_a_draft_equals_stock(pair, draft_dir, prompt):
    """A real draft of the published format keeps what the reference loop keeps, and drafts always right or wrong at
    their second or first proposal keep K + 1, 2 or 1 tokens a cycle: the output is stock's token for token."""
    ours, stock = pair
    conversations, media = PROMPTS[prompt]
    inputs = tiny_inputs(conversations, **media)
    k, new = 3, 17
    expected = stock.generate(**inputs, do_sample=False, max_new_tokens=new, eos_token_id=None)
    try:
        draft = ours.load_draft(draft_dir, num_draft_tokens=k)
        got = ours.generate(**inputs, do_sample=False, max_new_tokens=new, eos_token_id=None)
        assert got.tolist() == expected.tolist()
        _, reference = speculative_greedy(ours, draft, max_new_tokens=new, num_draft_tokens=k, **inputs)
        assert ours.speculative_stats["kept_per_cycle"][:-1] == [kept + 1 for kept in reference["accepted"][:-1]]
        assert sum(ours.speculative_stats["kept_per_cycle"]) == new - 1
        for miss, kept in ((None, k), (1, 1), (0, 0)):
            ours.use_draft(ScriptedDraft(expected, miss), k)
            got = ours.generate(**inputs, do_sample=False, max_new_tokens=new, eos_token_id=None)
            assert got.tolist() == expected.tolist()
            assert ours.speculative_stats["kept_per_cycle"] == expected_kept(new, k, kept)
    finally:
        ours.use_draft(None)


def test_it_stops_at_eos_and_max_new_tokens_inside_a_cycle(pair):
    """An EOS id or `max_new_tokens` in the middle of a cycle's kept tokens ends the output there, as stock."""
    ours, stock = pair
    inputs = tiny_inputs(*PROMPTS["text"][:1])
    prompt_len = inputs["input_ids"].shape[1]
    long = stock.generate(**inputs, do_sample=False, max_new_tokens=24, eos_token_id=None)
    try:
        ours.use_draft(ScriptedDraft(long), 4)
        for new in (1, 2, 5, 6, 7, 11):
            got = ours.generate(**inputs, do_sample=False, max_new_tokens=new, eos_token_id=None)
            assert got.tolist() == long[:, :prompt_len + new].tolist()
        eos = long[0, prompt_len + 7].item()
        expected = stock.generate(**inputs, do_sample=False, max_new_tokens=24, eos_token_id=eos)
        got = ours.generate(**inputs, do_sample=False, max_new_tokens=24, eos_token_id=eos)
        assert got.tolist() == expected.tolist()
        assert got[0, -1].item() == eos and got.shape[1] <= prompt_len + 8
    finally:
        ours.use_draft(None)


def test_calls_it_does_not_cover_run_the_plain_loop_with_a_notice(pair, draft_dir, caplog):
    """A (padded) batch, a logits processor: the plain loop's output, and one line saying why."""
    ours, stock = pair
    batch = tiny_inputs([[PROMPTS["text"][0][0][0]], [PROMPTS["image"][0][0][0]]], images=PROMPTS["image"][1]["images"])
    try:
        ours.load_draft(draft_dir, num_draft_tokens=2)
        got = ours.generate(**batch, do_sample=False, max_new_tokens=6)
        assert got.tolist() == stock.generate(**batch, do_sample=False, max_new_tokens=6).tolist()
        assert ours.speculative_stats == {}  # the plain loop ran
        ours.generate(**tiny_inputs(*PROMPTS["text"][:1]), do_sample=False, repetition_penalty=1.5, max_new_tokens=3)
    finally:
        ours.use_draft(None)
    err = caplog.text
    assert "a batch of 2 prompts runs the plain decode loop" in err
    assert "logits processors or stopping criteria the device loop does not cover runs the plain decode loop" in err


def test_num_draft_tokens_is_checked(pair, draft_dir):
    ours, _ = pair
    with pytest.raises(ValueError, match="num_draft_tokens must be within 1..15, got 0"):
        ours.load_draft(draft_dir, num_draft_tokens=0)
    with pytest.raises(ValueError, match="num_draft_tokens must be within 1..15, got 16"):
        ours.use_draft(ScriptedDraft(torch.zeros(1, 8, dtype=torch.long)), 16)
    assert ours._draft is None


def test_sampled_answers_follow_the_targets_distribution(pair):
    """Sampling with a draft that proposes the greedy continuation (kept where the target's draw equals it, the draw
    output otherwise) draws each answer with the target's own probability: a chi-square goodness-of-fit test of 3,000
    answers of 3 tokens (temperature 0.8, top-k 3: at most 27 answers) against the stock model's exact probabilities.
    Both branches of the rule ran: some cycles kept proposals, some kept none."""
    ours, stock = pair
    inputs = tiny_inputs(*PROMPTS["text"][:1])
    prompt = inputs["input_ids"]
    temperature, top_k, draws = 0.8, 3, 3000

    def next_token_probabilities(sequences):
        with torch.no_grad():
            logits = stock(input_ids=sequences).logits[:, -1].float() / temperature
        return logits.masked_fill(logits < logits.topk(top_k).values[:, -1:], -torch.inf).softmax(-1)

    expected = {(): 1.0}
    for _ in range(3):
        grown = {}
        for answer, probability in expected.items():
            sequence = torch.cat([prompt, torch.tensor([answer], dtype=torch.long).view(1, -1)], dim=1)
            for token, p in enumerate(next_token_probabilities(sequence)[0].tolist()):
                if p > 0:
                    grown[(*answer, token)] = probability * p
        expected = grown
    greedy = stock.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=None)
    counts, kept = {}, []
    try:
        ours.use_draft(ScriptedDraft(greedy), 2)
        torch.manual_seed(0)
        for _ in range(draws):
            out = ours.generate(**inputs, do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0,
                                max_new_tokens=3, eos_token_id=None)
            answer = tuple(out[0, prompt.shape[1]:].tolist())
            counts[answer] = counts.get(answer, 0) + 1
            kept += ours.speculative_stats["kept_per_cycle"]
    finally:
        ours.use_draft(None)
    assert set(counts) <= set(expected)
    assert 1 in kept and max(kept) > 1  # proposals rejected and kept
    # Answers expected fewer than 5 times are pooled (the chi-square approximation needs 5).
    rare = [answer for answer, p in expected.items() if p * draws < 5]
    cells = [([answer], p) for answer, p in expected.items() if answer not in rare]
    cells.append((rare, sum(expected[answer] for answer in rare)))
    statistic = sum((sum(counts.get(answer, 0) for answer in answers) - p * draws) ** 2 / (p * draws)
                    for answers, p in cells if p > 0)
    assert statistic <= chi_square_quantile(1 - SIGNIFICANCE, len(cells) - 1), (statistic, len(cells))


def test_a_later_turn_continues_the_drafts_cache(pair, draft_dir, caplog):
    """A second turn passing the returned cache back, after a first turn the draft ran: only the new tokens are
    prefilled, for the model and the draft, and the answer is stock's, reusing its cache or fresh; with a draft right
    about the second answer, cycles keep every proposal. After a first turn the draft did not run, the plain loop runs
    the second, with a notice."""
    ours, stock = pair
    first_inputs = tiny_inputs([[chat("Describe a cat in one line.")]])
    greedy = dict(max_new_tokens=8, do_sample=False)
    expected_first = stock.generate(**first_inputs, **greedy, return_dict_in_generate=True)
    resumed, fresh = next_turn(first_inputs, expected_first.sequences)
    # Stock reuses its returned cache once (it grows it), with the M-RoPE offsets of its last call: first.
    reused = stock.generate(**resumed, **greedy, **{CACHE_KWARG: returned_cache(expected_first)})
    try:
        for draft in ("published", "scripted"):
            if draft == "published":
                ours.load_draft(draft_dir, num_draft_tokens=3)
            got_first = ours.generate(**first_inputs, **greedy, return_dict_in_generate=True)
            assert got_first.sequences.tolist() == expected_first.sequences.tolist()
            if draft == "scripted":  # right about both answers (the first turn is the same call as above)
                ours.use_draft(ScriptedDraft(stock.generate(**fresh, max_new_tokens=16, do_sample=False)), 3)
                got_first = ours.generate(**first_inputs, **greedy, return_dict_in_generate=True)
            got = ours.generate(**resumed, **greedy, **{CACHE_KWARG: returned_cache(got_first)})
            assert got.tolist() == reused.tolist() == stock.generate(**fresh, **greedy).tolist()
            assert sum(ours.speculative_stats["kept_per_cycle"]) == got.shape[1] - resumed["input_ids"].shape[1] - 1
        assert max(ours.speculative_stats["kept_per_cycle"]) == 4
        ours.use_draft(None)
        got_first = ours.generate(**first_inputs, **greedy, return_dict_in_generate=True)
        ours.load_draft(draft_dir, num_draft_tokens=3)
        got = ours.generate(**resumed, **greedy, **{CACHE_KWARG: returned_cache(got_first)})
        assert got.tolist() == reused.tolist() and ours.speculative_stats == {}
    finally:
        ours.use_draft(None)
    assert "a later turn whose earlier turns the draft did not run" in caplog.text
