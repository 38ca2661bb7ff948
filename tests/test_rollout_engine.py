"""The native rollout engine against HF generate() and the train engine."""

import copy

import pytest
import torch

from rlhf.data import build_rl_batch, encode_prompts
from rlhf.rollout.engine import RolloutEngine, SamplingParams, prefix_plan
from rlhf.train.engine import token_logprobs
from tests.conftest import diverse_model

PROMPTS = ["1+2=", "33+44=", "5+66=", "98+99=", "0+0=", "7+8=", "12+3=", "45+54="]
# rollout vs train logprobs: the same fp32 arithmetic in another order (the engine folds RMSNorm weights into
# its matmuls), which the diverse model's large weights amplify to ~1e-4; a real mismatch (temperature,
# position, mask) is 1e-2 or more
LOGPROB_TOL = 3e-4
LAYOUTS = ["block", "grouped"]  # the generated cache's two layouts (auto picks by n x max_new_tokens)


@pytest.fixture
def nan_for_uninitialised_memory():
    """torch.empty and friends return NaN-filled memory: a read of a cache slot nobody wrote shows up as NaN."""
    import torch.utils.deterministic

    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]


def _hf_greedy(model, prompt_ids, max_new, pad_id, stop_ids):
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad_id, eos_token_id=stop_ids)
    result = []
    for row in out[:, width:].tolist():
        toks = []
        for t in row:
            toks.append(t)
            if t in stop_ids:
                break
        result.append(toks)
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-gqa"])
def test_greedy_equals_hf_generate(preset, layout):
    model, tok = diverse_model(preset, seed=3)
    engine = RolloutEngine(model, tok)
    engine.layout = layout
    prompt_ids = encode_prompts(tok, PROMPTS)
    # Random init rarely emits EOS: use a token the model does emit as an extra stop id, so some
    # rows stop early and leave the batch (exercises compaction) while others run to the length.
    free = engine.generate(prompt_ids, {"max_new_tokens": 10, "temperature": 0.0})
    rows = [set(r["output_ids"]) for r in free]
    some = [t for t in sorted(set().union(*rows)) if 0 < sum(t in r for r in rows) < len(rows)]
    assert some, "random model emitted the same token set on every row; pick another seed"
    stops = [tok.eos_token_id, some[0]]
    ours = engine.generate(prompt_ids, {"max_new_tokens": 10, "temperature": 0.0, "stop_token_ids": stops[1:]})
    theirs = _hf_greedy(model, prompt_ids, 10, tok.pad_token_id, stops)
    assert [r["output_ids"] for r in ours] == theirs
    assert any(r["meta_info"]["finish_reason"]["type"] == "stop" for r in ours)
    assert any(r["meta_info"]["finish_reason"]["type"] == "length" for r in ours)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-gqa"])
def test_static_shapes_decode_as_the_eager_loop_does(preset, layout):
    """The decode step CUDA graphs capture (every row every step, slots masked until written) gives the
    eager loop's tokens and logprobs; on CPU it runs uncaptured, so its arithmetic is checked here."""
    model, tok = diverse_model(preset, seed=3)
    engine = RolloutEngine(model, tok)
    engine.layout = layout
    prompts = encode_prompts(tok, PROMPTS)
    free = engine.generate(prompts, {"max_new_tokens": 10, "temperature": 0.0})
    counts = {}
    for r in free:
        for t in set(r["output_ids"]):
            counts[t] = counts.get(t, 0) + 1
    stop = min(counts, key=lambda t: abs(counts[t] - len(free) / 2))  # ends about half the rows early
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, n=3, stop_token_ids=(stop,))
    with torch.inference_mode():
        eager = engine._decode(prompts, sp, static=False)
        static = engine._decode(prompts, sp, static=True)
    assert eager[0] == static[0] and eager[2] == static[2]  # tokens, finish reasons
    assert 0 < sum(len(t) < 10 for t in eager[0]) < len(eager[0])  # some rows stopped early, some did not
    for a, b in zip(eager[1], static[1]):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rollout_logprobs_equal_train_engine_logprobs(diverse, layout, nan_for_uninitialised_memory):
    """Sampled groups whose rows stop at different steps (rows leave the computation, caches stay): every
    logprob matches the train engine's, and no row reads a cache slot left unwritten (NaN here)."""
    model, tok = diverse
    engine = RolloutEngine(model, tok, seed=5)
    engine.layout = layout
    prompt_ids = encode_prompts(tok, PROMPTS)
    for temperature in (1.0, 0.7):
        params = {"max_new_tokens": 8, "temperature": temperature, "n": 4,
                  "stop_token_ids": tok.encode("123abc", add_special_tokens=False)}
        results = engine.generate(prompt_ids, params, return_logprob=True)
        batch = build_rl_batch([p for p in prompt_ids for _ in range(4)], results, tok.pad_token_id)
        with torch.no_grad():
            lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature)
        diff = ((lp - batch["old_logprobs"]) * batch["response_mask"]).abs().max().item()
        assert diff <= LOGPROB_TOL, f"rollout vs train logprobs differ by {diff} at T={temperature}"
        lengths = batch["response_mask"].sum(1)
        assert lengths.min() < 8 < lengths.max() + 1  # some rows stopped early, some ran to the length


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_that_leave_early_leave_no_unwritten_slot_to_read(diverse, layout, nan_for_uninitialised_memory):
    """Once half of the rows have stopped, the rest run alone while the caches keep their layout (the rows
    that left write no more slots, and in the block layout their group's other queries still read, masked,
    those columns); once a quarter are left, their caches are copied into a dense layout. With
    uninitialised memory NaN, every logprob must still equal the train engine's."""
    model, tok = diverse
    prompt_ids = encode_prompts(tok, PROMPTS)
    free = RolloutEngine(model, tok, seed=5).generate(prompt_ids, {"max_new_tokens": 8, "n": 4})
    counts: dict[int, int] = {}
    for r in free:
        for t in r["output_ids"]:
            counts[t] = counts.get(t, 0) + 1
    stops = sorted(counts, key=counts.get)[-6:]  # the 6 most frequent tokens: most rows stop, at varied steps
    engine = RolloutEngine(model, tok, seed=5)
    engine.layout = layout
    cut_steps, dense_steps = [], []
    step = engine._decode_step

    def spy(tokens, positions, t, idx, state):
        if idx is not None:
            cut_steps.append(t)
        if state["B"] < len(prompt_ids) * 4:
            dense_steps.append(t)
        return step(tokens, positions, t, idx, state)

    engine._decode_step = spy
    results = engine.generate(prompt_ids, {"max_new_tokens": 8, "n": 4, "stop_token_ids": stops}, return_logprob=True)
    assert cut_steps and dense_steps, "no step ran with rows left out, or none in a dense layout; pick other stops"
    batch = build_rl_batch([p for p in prompt_ids for _ in range(4)], results, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 1.0)
    diff = ((lp - batch["old_logprobs"]) * batch["response_mask"]).abs().max().item()
    assert diff <= LOGPROB_TOL, f"rollout vs train logprobs differ by {diff}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-gqa"])
def test_samples_that_drew_the_same_tokens_are_computed_once_and_keep_their_logprobs(preset, layout,
                                                                                     nan_for_uninitialised_memory):
    """top_k 2 at temperature 0.5 makes a group's 8 samples branch slowly, top_k 1 keeps them alike: steps compute
    the distinct sequences only, also once rows have left (half of them end after 2 tokens: cut from the step;
    a quarter after 4: the rest copied into a dense layout), and every row's logprobs still equal the train
    engine's (a sequence's keys/values copied into another row's cache columns, or a row handed another
    sequence's logits, would be off by far more than rounding)."""
    from rlhf.rollout.engine import StepControl

    class EndSamples(StepControl):  # samples 4-7 of each group end at t=1, samples 2-3 at t=3
        def step(self, t, rows, tokens):
            ends = {1: (4, 5, 6, 7), 3: (2, 3)}.get(t, ())
            return {r: {"type": "abort", "message": "test"} for r in range(64) if r % 8 in ends}

    model, tok = diverse_model(preset, seed=3)
    prompt_ids = encode_prompts(tok, PROMPTS)
    engine = RolloutEngine(model, tok, seed=5)
    engine.layout = layout
    steps = []  # (rows the step serves, sequences it computed, rows left out of it)
    step = engine._decode_step

    def spy(tokens, positions, t, idx, state):
        served = state["B"] if idx is None else idx.shape[0]
        steps.append((served, tokens.shape[0], idx is not None))
        return step(tokens, positions, t, idx, state)

    engine._decode_step = spy
    for top_k in (2, 1):  # 2: branching samples; 1: a group's samples all alike, so every step shares
        params = {"max_new_tokens": 8, "n": 8, "top_k": top_k, "temperature": 0.5, "ignore_eos": True}
        steps.clear()
        results = engine.generate(prompt_ids, params, return_logprob=True, control=EndSamples())
        assert [len(r["output_ids"]) for r in results[:8]] == [8, 8, 4, 4, 2, 2, 2, 2]
        assert [served for served, _, _ in steps] == [64, 32, 32, 16, 16, 16, 16]  # cut at t=1, dense from t=3
        if top_k == 2:
            assert steps[0][1] <= len(prompt_ids) * 2  # the first step: each group's 2 first tokens at most
            assert steps[1][2] and steps[1][1] < 32  # rows cut from the step, and shared
            assert steps[-1][1] == 16  # late steps where every sequence differs compute every row
        else:
            assert all(computed == len(prompt_ids) for _, computed, _ in steps)  # one sequence a group
        batch = build_rl_batch([p for p in prompt_ids for _ in range(8)], results, tok.pad_token_id)
        with torch.no_grad():
            lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.5)
        diff = ((lp - batch["old_logprobs"]) * batch["response_mask"]).abs().max().item()
        assert diff <= LOGPROB_TOL, f"rollout vs train logprobs differ by {diff} (top_k {top_k})"

    engine.share = False  # RLHF_ROLLOUT_SHARE=0: every row computed at every step
    steps.clear()
    engine.generate(prompt_ids, params, control=EndSamples())
    assert all(computed == served for served, computed, _ in steps)


def _common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_prefix_plan_names_each_prefill_rows_state():
    # prompts left-padded to 3 columns, flat rows i*3 + c: "1 2 3", "_ 1 2", "1 2 3" again, "_ _ 4"
    firsts, expand, shared = prefix_plan([[1, 2, 3], [1, 2], [1, 2, 3], [4]], 3)
    assert firsts == [0, 1, 2, 3, 11]  # "1", "1 2", "1 2 3", a pad, "4": where each first appears
    assert expand == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 3, 4]  # a prefix is one state at any padding
    assert shared == [0, 2, 3, 0]  # tokens an earlier prompt holds (pads not counted)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-gqa"])
def test_prompts_with_a_common_prefix_compute_it_once_in_the_prefill(preset, nan_for_uninitialised_memory):
    """A template before every prompt (at a different column in each, as prompt lengths differ) and a prompt
    passed twice: the prefill computes each distinct prefix once, and every logprob still equals the train
    engine's (a row handed another prefix's keys/values, a wrong position or mask would be off by far more)."""
    model, tok = diverse_model(preset, seed=3)
    prompt_ids = encode_prompts(tok, ["Sum: " + p for p in PROMPTS] + ["Sum: 1+2="])
    distinct = {tuple(p[:k]) for p in prompt_ids for k in range(1, len(p) + 1)}  # prefixes of real tokens
    pads = len({len(p) for p in prompt_ids}) > 1
    engine = RolloutEngine(model, tok, seed=5)
    computed = []
    prefill = engine._prefill

    def spy(ids, valid, fused, rope, store, share=None):
        computed.append(ids.numel() if share is None else share[0].numel())
        return prefill(ids, valid, fused, rope, store, share)

    engine._prefill = spy
    for n, temperature in ((1, 0.0), (4, 1.0)):
        results = engine.generate(prompt_ids, {"max_new_tokens": 6, "n": n, "temperature": temperature},
                                  return_logprob=True)
        assert computed[-1] == len(distinct) + pads < len(prompt_ids) * max(map(len, prompt_ids))
        # cached_tokens: a prompt's first sample did not compute its longest common prefix with an earlier prompt
        # (all of it for the repeated one), a group's other samples none of their prompt
        common = [max((_common_prefix(p, q) for q in prompt_ids[:i]), default=0) for i, p in enumerate(prompt_ids)]
        assert [r["meta_info"]["cached_tokens"] for r in results[::n]] == common
        assert common[-1] == len(prompt_ids[-1]) and all(
            r["meta_info"]["cached_tokens"] == r["meta_info"]["prompt_tokens"] for k, r in enumerate(results) if k % n)
        batch = build_rl_batch([p for p in prompt_ids for _ in range(n)], results, tok.pad_token_id)
        with torch.no_grad():
            lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], max(temperature, 1.0))
        diff = ((lp - batch["old_logprobs"]) * batch["response_mask"]).abs().max().item()
        assert diff <= LOGPROB_TOL, f"rollout vs train logprobs differ by {diff} (n {n})"
    engine.share = False  # RLHF_ROLLOUT_SHARE=0: every prefill row computed
    engine.generate(prompt_ids, {"max_new_tokens": 2})
    assert computed[-1] == len(prompt_ids) * max(map(len, prompt_ids))


def test_groups_are_adjacent_and_fields_follow_sglang(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok, seed=1)
    engine.weight_version = "7"
    out = engine.generate(encode_prompts(tok, PROMPTS[:2]), {"max_new_tokens": 3, "n": 3}, return_logprob=True)
    assert len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [5, 5, 5, 7, 7, 7]
    for o in out:
        meta = o["meta_info"]
        assert meta["weight_version"] == "7"
        assert meta["completion_tokens"] == len(o["output_ids"]) == len(meta["output_token_logprobs"])
        assert all(t == tid and lp <= 0 for (lp, tid, _), t in zip(meta["output_token_logprobs"], o["output_ids"]))
        assert o["text"] == tok.decode(o["output_ids"])


def test_sampling_is_deterministic_by_seed_and_top_k_1_is_greedy(diverse):
    model, tok = diverse
    prompt_ids = encode_prompts(tok, PROMPTS)
    params = {"max_new_tokens": 6, "temperature": 1.0, "n": 2}
    a = RolloutEngine(model, tok, seed=11).generate(prompt_ids, params)
    b = RolloutEngine(model, tok, seed=11).generate(prompt_ids, params)
    c = RolloutEngine(model, tok, seed=12).generate(prompt_ids, params)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    assert [r["output_ids"] for r in a] != [r["output_ids"] for r in c]
    greedy = RolloutEngine(model, tok).generate(prompt_ids, {"max_new_tokens": 6, "temperature": 0.0})
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        sampled = RolloutEngine(model, tok, seed=3).generate(prompt_ids, {"max_new_tokens": 6, "temperature": 1.5, **extra})
        assert [r["output_ids"] for r in sampled] == [r["output_ids"] for r in greedy]


def test_weight_update_changes_outputs_and_version(diverse):
    model, tok = diverse
    from rlhf.weights import checksum, export_state

    engine = RolloutEngine(copy.deepcopy(model), tok)
    other, _ = diverse_model("tiny-llama", seed=99)
    prompt_ids = encode_prompts(tok, PROMPTS)
    before = engine.generate(prompt_ids, {"max_new_tokens": 5, "temperature": 0})
    engine.update_weights_from_tensors(export_state(other), weight_version="3")
    after = engine.generate(prompt_ids, {"max_new_tokens": 5, "temperature": 0})
    assert engine.weight_version == "3" and after[0]["meta_info"]["weight_version"] == "3"
    assert engine.weights_checksum() == checksum(export_state(other))
    assert [r["output_ids"] for r in before] != [r["output_ids"] for r in after]


def test_sampler_draws_the_softmax_distribution_and_never_a_masked_token():
    from rlhf.rollout.engine import sample_tokens

    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])  # token 1 masked (-inf logit)
    rows = 40_000
    logits = probs.log().expand(rows, -1).contiguous() * 2.0  # temperature 2 undoes the doubling
    for top_k in (-1, 4):  # top-4 keeps the four tokens with mass: the same distribution
        tokens, logprobs = sample_tokens(logits, SamplingParams(temperature=2.0, top_k=top_k),
                                         torch.Generator().manual_seed(0))
        freq = torch.bincount(tokens, minlength=5).double() / rows
        assert freq[1] == 0
        sigma = (probs.double() * (1 - probs.double()) / rows).sqrt()
        assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-12).all(), freq
        assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-5)


def test_two_level_inverse_cdf_draws_the_distribution_of_a_large_vocabulary():
    """From 2048 tokens on the sampler finds the block, then the token: the same distribution (mass on tokens at
    block edges, in the last, padded block, and at the very end), never a zero-weight token, and the token one
    scan over the whole row gives, but for rounding."""
    from rlhf.rollout.engine import CDF_BLOCK, inverse_cdf

    V = 20 * CDF_BLOCK + 77  # not a whole number of blocks
    where = torch.tensor([0, CDF_BLOCK - 1, CDF_BLOCK, 7 * CDF_BLOCK + 5, 20 * CDF_BLOCK + 3, V - 1])
    probs = torch.tensor([0.2, 0.1, 0.25, 0.05, 0.15, 0.25])
    rows = 40_000
    weights = torch.zeros(rows, V)
    weights[:, where] = probs
    tokens = inverse_cdf(weights, torch.rand(rows, 1, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(tokens, minlength=V).double() / rows
    assert freq.sum() == 1 and freq[where].sum() == 1  # only weighted tokens
    sigma = (probs.double() * (1 - probs.double()) / rows).sqrt()
    assert ((freq[where] - probs.double()).abs() <= 5 * sigma).all(), freq[where]
    random_rows = torch.softmax(torch.randn(256, 32_000, generator=torch.Generator().manual_seed(1)) * 3, dim=-1)
    uniform = torch.rand(256, 1, generator=torch.Generator().manual_seed(2))
    cdf = random_rows.cumsum(dim=-1)
    one_scan = torch.searchsorted(cdf, (1 - uniform) * cdf[:, -1:]).squeeze(1)
    assert (inverse_cdf(random_rows, uniform) == one_scan).float().mean() >= 0.99
    u_one = torch.full((1, 1), 0.999999)  # a point just past the first block's mass: rounding must not leave it
    w = torch.zeros(1, V)
    w[0, 3], w[0, CDF_BLOCK + 9] = 1e-30, 1.0
    assert inverse_cdf(w, u_one).item() in (3, CDF_BLOCK + 9)


def test_bad_sampling_params_are_named():
    with pytest.raises(ValueError, match="unknown field.*temprature"):
        SamplingParams.from_dict({"temprature": 1.0})
    with pytest.raises(ValueError, match="out of range"):
        SamplingParams.from_dict({"top_p": 0.0})
    with pytest.raises(ValueError, match=r"stop_token_ids \[3, -1\]"):
        SamplingParams.from_dict({"stop_token_ids": [3, -1]})


def test_min_new_tokens_masks_the_stop_token_until_then():
    model, tok = diverse_model("tiny-llama", seed=3)
    engine = RolloutEngine(model, tok)
    prompt_ids = encode_prompts(tok, PROMPTS[:1])
    first = engine.generate(prompt_ids, {"max_new_tokens": 1, "temperature": 0})[0]["output_ids"][0]
    now = engine.generate(prompt_ids, {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]})
    assert now[0]["output_ids"] == [first]  # it stops at once
    held = engine.generate(prompt_ids, {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first],
                                        "min_new_tokens": 3})[0]["output_ids"]
    assert len(held) > 3 and first not in held[:3]  # three tokens before a stop may be drawn, as in sglang
    beyond = engine.generate(prompt_ids, {"max_new_tokens": 8, "temperature": 0, "min_new_tokens": 3,
                                          "stop_token_ids": [first, 10 ** 9]})[0]["output_ids"]
    assert beyond == held  # an id past the vocabulary is never drawn and masks nothing


def test_step_control_finishes_rows_with_its_reason():
    from rlhf.rollout.engine import StepControl

    model, tok = diverse_model("tiny-llama", seed=3)
    engine = RolloutEngine(model, tok)

    class AbortSecondPromptAtStep(StepControl):
        wants_tokens = True

        def __init__(self):
            self.seen = []

        def step(self, t, rows, tokens):
            self.seen.append((t, list(rows)))
            return {2: {"type": "abort", "message": "test"}, 3: {"type": "abort", "message": "test"}} if t == 2 else {}

    control = AbortSecondPromptAtStep()
    out = engine.generate(encode_prompts(tok, PROMPTS[:2]), {"max_new_tokens": 6, "n": 2, "ignore_eos": True},
                          control=control)
    assert [len(r["output_ids"]) for r in out] == [6, 6, 3, 3]
    assert [r["meta_info"]["finish_reason"]["type"] for r in out] == ["length", "length", "abort", "abort"]
    assert control.seen[0] == (0, [0, 1, 2, 3]) and all(2 not in rows for t, rows in control.seen if t > 2)


def test_top_logprobs_rank_the_distribution_the_sample_came_from():
    model, tok = diverse_model("tiny-llama", seed=3)
    engine = RolloutEngine(model, tok, seed=1)
    out = engine.generate(encode_prompts(tok, PROMPTS[:2]), {"max_new_tokens": 5, "ignore_eos": True},
                          return_logprob=True, top_logprobs_num=4)
    for r in out:
        for (lp, token, _), top in zip(r["meta_info"]["output_token_logprobs"], r["meta_info"]["output_top_logprobs"]):
            values = [v for v, _i, _ in top]
            assert values == sorted(values, reverse=True) and len(top) == 4
            assert lp <= values[0] + 1e-6
            if token in [i for _v, i, _ in top]:
                assert abs(dict((i, v) for v, i, _ in top)[token] - lp) < 1e-5


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-gqa"])
def test_decode_attention_as_two_matmuls_gives_the_fused_attentions_tokens(preset, monkeypatch):
    """RLHF_DECODE_ATTENTION=bmm (the block layout's decode step as matmul, fp32 softmax, matmul) samples the tokens
    and logprobs of PyTorch's fused attention, greedy and sampled, with stops and groups."""
    from rlhf.rollout.engine import attention

    model, tok = diverse_model(preset, seed=3)
    prompts = encode_prompts(tok, PROMPTS)
    params = {"max_new_tokens": 10, "temperature": 1.0, "n": 4}
    got = {}
    for mode in ("sdpa", "bmm"):
        monkeypatch.setattr(attention, "DECODE_ATTENTION", mode)
        engine = RolloutEngine(model, tok, seed=5)
        engine.layout = "block"
        got[mode] = engine.generate(prompts, params, return_logprob=True)
    assert [r["output_ids"] for r in got["bmm"]] == [r["output_ids"] for r in got["sdpa"]]
    for a, b in zip(got["bmm"], got["sdpa"]):
        lp = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx([x[0] for x in b["meta_info"]["output_token_logprobs"]], abs=1e-4)
